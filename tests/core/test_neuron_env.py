"""workbench.core.neuron_env: the compiler's logical NeuronCore setting, set for a block and restored after it."""

from __future__ import annotations

import os

import pytest


def test_compiled_for_lnc_sets_and_restores_the_variable(monkeypatch):
    from workbench.core.neuron_env import LNC_ENV, compiled_for_lnc, logical_nc_config

    monkeypatch.delenv(LNC_ENV, raising=False)
    with compiled_for_lnc(1):
        assert logical_nc_config() == 1
    assert LNC_ENV not in os.environ  # unset before: unset after
    monkeypatch.setenv(LNC_ENV, "2")
    with pytest.raises(RuntimeError), compiled_for_lnc(1):
        raise RuntimeError  # restored on the way out of a failure too
    assert os.environ[LNC_ENV] == "2"

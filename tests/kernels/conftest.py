"""Kernel tests run with the compiler's logical NeuronCore degree pinned to 1 (NEURON_LOGICAL_NC_CONFIG=1).

Since NKI 0.7.0 a kernel's launch grid must equal the compiler's LNC, which is 2 on trn2 when the variable is unset
(`workbench.core.neuron_env.logical_nc_config`); a test that launches on two cores sets it to 2 itself.
"""

import pytest


@pytest.fixture(autouse=True)
def _compiler_lnc_1(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")

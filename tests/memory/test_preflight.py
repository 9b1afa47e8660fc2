"""workbench.memory.preflight: the check before a launch: a CPU launch whose lower bound alone exceeds the RAM is
refused with the numbers and the fix, unplanned; a device that cannot run the attention backend is refused."""

from __future__ import annotations

import pytest

from tests.run_helpers import ROOT
from workbench.core import errors


def test_the_cpu_memory_gate_refuses_with_the_numbers_and_the_fix():
    from workbench.core.config import check_device, load_config
    from workbench.memory import preflight

    job = load_config(ROOT / "configs/cpu_dense.toml", training__local_batch_size=4096)
    floor = 4096 * 128 * 151936 * 4  # the fp32 logits alone (the tiny model's weights come on top)
    assert preflight.cpu_floor_bytes(job) > floor
    floor_gib = preflight.cpu_floor_bytes(job) / 1024**3
    with pytest.raises(errors.ConfigError, match=rf"needs at least {floor_gib:.1f} GiB per rank .* lower "
                                                 r"--training.local_batch_size"):
        preflight.check_fits(job, 1, "cpu")
    job = load_config(ROOT / "configs/cpu_dense.toml", model__attn_backend="flex")
    with pytest.raises(errors.ConfigError,
                       match="model.attn_backend='flex' runs on CUDA and Neuron only .* this device is cpu"):
        check_device(job, "cpu")
    check_device(job, "cuda")
    check_device(job, "neuron")  # torch-neuronx 2.34.0 release notes: flex and varlen_attn run there

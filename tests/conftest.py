"""Fixtures shared by the tests; launch helpers live in tests/run_helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run_helpers import FIRST_12_OF_30, cached_run, use_machine_cpu_path


@pytest.fixture(scope="module", autouse=True)
def launch_cpu_path(request):
    """In a module marked `machine_cpu_path`, everything the tests launch runs on this machine's own CPU path
    (`MACHINE_CPU_PATH` in run_helpers.py: why and when); module scope, so its shared launches do too."""
    if request.node.get_closest_marker("machine_cpu_path") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        use_machine_cpu_path(mp)
        yield


@pytest.fixture
def outdir(tmp_path: Path) -> Path:
    d = tmp_path / "outputs"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def native_moe_2rank(tmp_path_factory) -> Path:
    """configs/cpu_moe.toml, native, 12 of 30 steps, 2 ranks: also the reference for the other MoE paths."""
    return cached_run(tmp_path_factory, "configs/cpu_moe.toml", "--model.backend", "native", *FIRST_12_OF_30,
                      nproc=2)[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Two tiny checkpoints written by transformers itself (save_pretrained, default published format; vocab 512):
    "dense" tied, "moe" untied, so both tie paths are crossed."""
    import torch
    from transformers import AutoModelForCausalLM

    from workbench.core import flavors

    shapes = {
        "dense": flavors.Qwen3Shape(64, 2, 4, 2, head_dim=16, ffn_dim=128, vocab_size=512, tied=True,
                                    max_seq_len=512),
        "moe": flavors.Qwen3Shape(64, 2, 4, 2, head_dim=16, vocab_size=512, max_seq_len=512, num_experts=8, top_k=2,
                                  moe_ffn_dim=32),
    }
    out = {}
    for name, shape in shapes.items():
        torch.manual_seed(0)
        out[name] = tmp_path_factory.mktemp(f"ckpt_{name}")
        AutoModelForCausalLM.from_config(flavors.hf_config(shape)).save_pretrained(out[name])
    return out

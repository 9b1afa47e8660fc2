"""`python -m workbench.plan`: bad input, and every shipped trn2 config fitting 24 GiB per rank with >= 10% headroom
under each backend it names, as its comment quotes. The plan itself (traced from the real model under fake tensors
and a fake process group) against one real step in this process, the re-planned suggestions and the measurement:
tests/memory/; against real launches: tests/integration/test_memory_plan.py.

What a trn2 rank holds beyond a CPU trace: the nki_moe kernels' own HBM tensors (equal to what the real kernels
allocate in the emulator), SDPA's math-path scores where no fused kernel is known, the device runtime's reserve.
The first-launch check (measured peak per rank after steps 1 and 2 against the plan) runs on CPU itself and
through the neuron stand-in; its cuda/neuron branch (torch.<device>.max_memory_allocated) has run nowhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from workbench import plan
from workbench.core.config import load_config
from workbench.memory import report, tables, tracer

pytestmark = pytest.mark.machine_cpu_path  # quoted plans are fake-tensor traces: no CPU kernel runs (run_helpers.py)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.flavor", "tiny", "--training.seq_len", "256", "--training.local_batch_size", "2"]
MiB, GiB = 2**20, 2**30


def test_bad_input(capsys):
    assert plan.main(["--device", "tpu", *TINY]) == 2
    assert "trn2, h100, h200, cpu" in capsys.readouterr().err
    # Parallel degrees that do not fit --nproc: the training launcher's own message.
    assert plan.main(["--job.config_file", str(ROOT / "configs/trn2_qwen3_30b_a3b.toml"), "--nproc", "3"]) == 2
    assert "Parallel degrees do not fit 3 rank(s)" in capsys.readouterr().err
    assert plan.main(["--model.flavor", "72B"]) == 2
    assert "model.flavor" in capsys.readouterr().err
    assert plan.main(["--reserve-gib", "-1", *TINY]) == 2
    assert "--reserve-gib -1.0: give the device runtime's share in GiB, >= 0." in capsys.readouterr().err


SHIPPED = {  # config -> (backends its header quotes, those re-planned here: ~20-40 s of CPU each; every backend
    # is re-planned in one config at least, nki_moe in the 30B-A3B recipe)
    "trn2_qwen3_8b.toml": (["native"], ["native"]),
    "qwen3_trainium.toml": (["native", "nki_moe", "huggingface_v5"], ["huggingface_v5"]),
    "trn2_qwen3_30b_a3b.toml": (["native", "nki_moe"], ["nki_moe"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(SHIPPED))
def test_shipped_trn2_configs_fit(config):
    """Every backend a shipped config quotes in its header fits 24 GiB with >= 10% headroom, the Neuron runtime's
    share, SDPA's math path and (nki_moe) the kernels' own buffers included; the re-planned ones must equal their
    quotes (python -m workbench.plan re-plans any)."""
    backends, replanned = SHIPPED[config]
    quoted = report.quoted_plans(ROOT / "configs" / config)
    assert sorted(quoted) == sorted(backends)
    for backend in backends:
        assert quoted[backend]["peak_bytes"] <= 0.9 * 24 * 2**30, (backend, quoted[backend])
    for backend in replanned:
        job = load_config(ROOT / "configs" / config, argv=["--model.backend", backend], world_size=64)
        p = tracer.plan_in_subprocess(job, "trn2", 64)
        assert p["fits"] and p["headroom"] >= 0.10, p
        assert quoted[backend]["peak_bytes"] / 2**30 == pytest.approx(p["peak_bytes"] / 2**30, abs=0.01), (
            f"the config's PLAN comment for {backend} is stale: re-plan and update it")
        cats = p["categories"]
        assert cats["device runtime"] == sum(r["bytes"] for r in tables.runtime_reserve("trn2")) > 0
        assert cats["attention scores"] > 0 and p["sdpa"]["kernel"].startswith("math")  # no fused SDPA on neuron
        assert (cats["nki kernel buffers"] > 0) == (backend == "nki_moe")
        assert (p["nki_kernels"] != {}) == (backend == "nki_moe")


def test_memory_measure_takes_only_its_values(capsys):
    assert plan.main(["--job.memory_measure", "sometimes", *TINY]) == 2
    assert "job.memory_measure" in capsys.readouterr().err

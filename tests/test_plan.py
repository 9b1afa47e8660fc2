"""workbench.plan: the per-rank memory plan traced from the real model (fake tensors, fake process group).

Validation against real runs: the plan of a one-rank tiny step equals the same step measured with real tensors
over gloo (within 15% overall and per category; benchmarks/plan_validation.py has the full table), a two-rank
case through torchrun, re-planned suggestions, bad input, and every shipped trn2 config fitting 24 GiB per rank
with >= 10% headroom under each backend it names, as its comment quotes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from workbench import plan
from workbench.config import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
TINY = ["--model.flavor", "tiny", "--training.seq_len", "256", "--training.local_batch_size", "2"]


def _close(planned: dict, measured: dict, tol: float = 0.15) -> None:
    assert abs(planned["peak_bytes"] / measured["peak_bytes"] - 1) <= tol, (planned, measured)
    for cat, real in measured["categories"].items():
        if real > 0.02 * measured["peak_bytes"]:  # categories that matter to the peak
            assert abs(planned["categories"][cat] / real - 1) <= tol, (cat, planned["categories"], measured)


def test_plan_matches_real_step_one_rank():
    import plan_validation

    job = load_config(argv=TINY)
    planned = plan.trace(job, "cpu", 1)
    measured = plan_validation.measure(TINY)
    _close(planned, measured)
    # The logits dominate a tiny real-vocabulary model: 512 tokens x 151,936 x fp32 x (logits, log-softmax, grad).
    assert planned["categories"]["logits and loss"] >= 3 * 512 * 151_936 * 4 * 0.99
    assert planned["categories"]["optimizer state"] == pytest.approx(2 * planned["categories"]["sharded parameters"],
                                                                      rel=0.01)


@pytest.mark.slow
def test_plan_matches_real_step_moe_nki_moe():
    """MoE (tiny-moe, bf16 as on the device) through the nki_moe path: blockwise experts, static-shape block plan."""
    import plan_validation

    planned, measured = plan_validation.run_case(1, [*plan_validation.MOE_BF16, *plan_validation.COMMON,
                                                     "--model.backend", "nki_moe"])
    _close(planned, measured)


@pytest.mark.slow
def test_plan_matches_real_step_two_ranks():
    import plan_validation

    planned, measured = plan_validation.run_case(2, [*TINY, "--model.backend", "huggingface_v5"])
    _close(planned, measured)
    assert planned["world_size"] == 2


def test_not_fitting_is_replanned_with_a_working_change(monkeypatch, capsys):
    base = plan.trace(load_config(argv=TINY), "cpu", 1)["peak_bytes"]
    # A device just too small for the plain loss: the planner must find (by re-planning) what fits.
    monkeypatch.setitem(plan.DEVICES, "trn2", ("cpu", 0.8 * base))
    p = plan.plan(load_config(argv=TINY), "trn2", 1)
    assert not p["fits"] and p["peak_bytes"] == base
    good = [s for s in p["suggestions"] if s["fits"]]
    assert good and good[-1]["peak_bytes"] < 0.8 * base
    assert "loss_chunks" in p["suggestions"][0]["change"]
    assert "DOES NOT FIT" in plan.render(p) and good[-1]["change"] in plan.render(p)


def test_bad_input(capsys):
    assert plan.main(["--device", "tpu", *TINY]) == 2
    assert "trn2, h100, h200, cpu" in capsys.readouterr().err
    # Parallel degrees that do not fit --nproc: the training launcher's own message.
    assert plan.main(["--job.config_file", str(ROOT / "configs/trn2_qwen3_30b_a3b.toml"), "--nproc", "3"]) == 2
    assert "Parallel degrees do not fit 3 rank(s)" in capsys.readouterr().err
    assert plan.main(["--model.flavor", "72B"]) == 2
    assert "model.flavor" in capsys.readouterr().err


SHIPPED = {  # config -> (backends its header names, the one re-planned here: ~1 min of CPU each)
    "trn2_qwen3_8b.toml": (["native"], "native"),
    "qwen3_trainium.toml": (["native", "nki_moe", "huggingface_v5"], "native"),
    "trn2_qwen3_30b_a3b.toml": (["native", "nki_moe", "huggingface_v5"], "nki_moe"),
}


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(SHIPPED))
def test_shipped_trn2_configs_fit(config):
    """Every backend a shipped config names is quoted in its header as fitting 24 GiB with >= 10% headroom; one
    backend per config is re-planned here and must equal its quote (python -m workbench.plan re-plans any)."""
    backends, replanned = SHIPPED[config]
    quoted = plan.quoted_plans(ROOT / "configs" / config)
    assert sorted(quoted) == sorted(backends)
    for backend in backends:
        assert quoted[backend]["peak_bytes"] <= 0.9 * 24 * 2**30, (backend, quoted[backend])
    job = load_config(ROOT / "configs" / config, argv=["--model.backend", replanned], world_size=64)
    p = plan.trace_in_subprocess(job, "trn2", 64)
    assert p["fits"] and p["headroom"] >= 0.10, p
    assert quoted[replanned]["peak_bytes"] / 2**30 == pytest.approx(p["peak_bytes"] / 2**30, abs=0.01), (
        "the config's PLAN comment is stale: re-plan and update it")

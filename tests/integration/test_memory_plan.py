"""The memory plan against real launches (torchrun over gloo): a 1-rank MoE step through the nki_moe path (bf16) and a
2-rank step, each within 15% of the plan overall and per category (benchmarks/plan_validation.py has the table)."""

from __future__ import annotations

import pytest

from tests.run_helpers import assert_plan_close

pytestmark = [pytest.mark.slow, pytest.mark.machine_cpu_path]  # compared only with the plan (run_helpers.py)

TINY = ["--model.flavor", "tiny", "--training.seq_len", "256", "--training.local_batch_size", "2"]


def test_plan_matches_real_step_moe_nki_moe():
    """MoE (tiny-moe, bf16 as on the device) through the nki_moe path: blockwise experts, static-shape block plan."""
    from benchmarks import plan_validation

    planned, measured = plan_validation.run_case(1, [*plan_validation.MOE_BF16, *plan_validation.COMMON,
                                                     "--model.backend", "nki_moe"])
    assert_plan_close(planned, measured)


def test_plan_matches_real_step_two_ranks():
    from benchmarks import plan_validation

    planned, measured = plan_validation.run_case(2, [*TINY, "--model.backend", "huggingface_v5"])
    assert_plan_close(planned, measured)
    assert planned["world_size"] == 2

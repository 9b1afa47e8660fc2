"""Every path trains for real through the launcher (torchtitan's Trainer, FSDP2 over gloo, 2 ranks) and learns.

native writes the run folder and checkpoints and resumes exactly, after SIGKILL too and from 2 ranks to 1 and back;
huggingface_v5 (transformers' Qwen3 / Qwen3-MoE) resumes exactly and its exported `hf/` loads in
`transformers.AutoModelForCausalLM`; nki_moe matches native from the same init (on CPU the blockwise torch reference
computes the experts; the NKI kernels against it through the emulator: tests/kernels/). Two agents (`--nnodes=2`,
c10d rendezvous on 127.0.0.1) against one: tests/integration/test_trn2_sbatch.py, through the Slurm script."""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.run_helpers import FIRST_12_OF_30, cached_run, kill_run_when, losses_by_step, read_metrics, run_train
from workbench.run.run_folder import step_dirs

pytestmark = pytest.mark.slow
DENSE, MOE = "configs/cpu_dense.toml", "configs/cpu_moe.toml"


def assert_learns(run_dir: Path, steps: int = 12) -> list[float]:
    losses = [losses_by_step(run_dir)[s] for s in range(1, steps + 1)]
    assert all(math.isfinite(x) for x in losses)
    first5, last5 = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last5 <= first5 - 1.0, f"loss did not fall by 1.0: first-5 mean {first5:.3f}, last-5 mean {last5:.3f}"
    return losses


# ---- native ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [DENSE, MOE])
def test_native_trains_12_steps(config, tmp_path_factory):
    """2 ranks (the shared launches); 1 rank runs the same model on every step and is held to its golden curve."""
    run_dir, stdout = cached_run(tmp_path_factory, config, "--model.backend", "native", *FIRST_12_OF_30, nproc=2)
    assert_learns(run_dir)
    # run folder contract
    assert (run_dir / "config.toml").is_file()
    rec = read_metrics(run_dir)[-1]
    for key in ("step", "loss", "tokens_per_second", "mfu", "peak_memory_bytes", "backend"):
        assert key in rec
    assert rec["backend"] == "native" and 0 < rec["mfu"] < 1 and rec["peak_memory_bytes"] > 0
    # rank 0 prints one progress line per step and a summary; the other rank stays quiet
    assert stdout.count("step 12/12") == 1 and "done: native" in stdout


COMMON = ("--model.backend", "native", "--checkpoint.enable", "true", "--checkpoint.interval", "5",
          "--lr_scheduler.total_steps", "30")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, dict]:
    """The reference records by step: the shared 2-rank launch, 12 steps of the same 30-step lr schedule as COMMON
    (saving checkpoints changes no number, so the launch without them serves)."""
    run_dir, _ = cached_run(tmp_path_factory, DENSE, "--model.backend", "native", *FIRST_12_OF_30, nproc=2)
    return {m["step"]: m for m in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[Path, int, int]:
    """A 2-rank 12-step launch (checkpoints every 5 steps) SIGKILLed, torchrun and both ranks at once, once step 6
    is logged: (its dump folder, the last step it logged, its newest complete checkpoint). Tests resume copies."""
    outdir = tmp_path_factory.mktemp("killed")
    run_dir = outdir / "cpu_dense"
    victims = kill_run_when(DENSE, *COMMON, "--job.dump_folder", str(outdir), "--training.steps", "12", nproc=2,
                            timeout=300, ready=lambda: ((run_dir / "metrics.jsonl").is_file()
                                                        and max(losses_by_step(run_dir), default=0) >= 6))
    time.sleep(0.5)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in victims)
    killed_at = max(losses_by_step(run_dir))
    return outdir, killed_at, max(step_dirs(run_dir / "checkpoint", complete=True))  # committed: checksums written


def test_sigkill_loses_at_most_one_interval(uninterrupted, killed, tmp_path):
    """The same command relaunched after a SIGKILL continues from the newest complete checkpoint, exactly."""
    src, killed_at, resume_from = killed
    assert 6 <= killed_at < 12, killed_at
    assert killed_at - resume_from < 5  # at most one interval lost
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    proc = run_train(DENSE, *COMMON, "--job.dump_folder", str(tmp_path), "--training.steps", "12", nproc=2)
    assert f"steps {resume_from + 1}-12" in proc.stdout
    after = losses_by_step(tmp_path / "cpu_dense")
    for step in range(resume_from + 1, 13):
        assert abs(after[step] - uninterrupted[step]["loss"]) <= 1e-6, (step, after[step], uninterrupted[step])


def test_resume_two_ranks_to_one_to_two_keeps_the_batch_and_the_counts(uninterrupted, killed, tmp_path):
    """The killed 2-rank run (local batch 2) resumed on 1 rank with the same command, then on 2 again: the
    checkpoint's global batch of 4 rows is kept (2 accumulation steps on 1 rank, said at launch), the data position
    is global, so every step sees the uninterrupted run's rows (only the order of fp32 reductions differs), and
    n_tokens_seen counts every rank's tokens across both resumes."""
    src, _, resume_from = killed
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    mid = min(resume_from + 2, 11)
    one = run_train(DENSE, *COMMON, "--job.dump_folder", str(tmp_path), "--training.steps", str(mid), nproc=1)
    assert (f"workbench: resuming with the checkpoint's global batch of 4 rows: 1 data-parallel rank(s) x local batch "
            f"2 x 2 accumulation step(s) (step {resume_from} trained with 2 data-parallel rank(s) x local batch 2 x 1 "
            "accumulation step(s)).") in one.stdout
    assert f"steps {resume_from + 1}-{mid}" in one.stdout
    two = run_train(DENSE, *COMMON, "--job.dump_folder", str(tmp_path), "--training.steps", str(mid + 1), nproc=2)
    assert f"steps {mid + 1}-{mid + 1}" in two.stdout and "resuming with" not in two.stdout  # the config's batch
    records = {m["step"]: m for m in read_metrics(tmp_path / "cpu_dense")}
    for step in range(resume_from + 1, mid + 2):
        assert abs(records[step]["loss"] - uninterrupted[step]["loss"]) <= 1e-4, (step, records[step])
        assert records[step]["n_tokens_seen"] == uninterrupted[step]["n_tokens_seen"] == step * 4 * 128


# ---- huggingface_v5 -------------------------------------------------------------------------------------------------

HF_V5 = ("--model.backend", "huggingface_v5")


CHECKPOINT_EVERY_5 = ("--checkpoint.enable", "true", "--checkpoint.interval", "5")


@pytest.fixture(scope="module")
def hf_dense_run(tmp_path_factory) -> Path:
    """12 of 30 steps of configs/cpu_dense.toml, checkpoints at 5 and 10: the learning check, the resume test's
    checkpoint and reference (and a golden curve: saving checkpoints changes no number)."""
    return cached_run(tmp_path_factory, DENSE, *HF_V5, *FIRST_12_OF_30, *CHECKPOINT_EVERY_5, nproc=2)[0]


@pytest.fixture(scope="module")
def hf_moe_run(tmp_path_factory) -> Path:
    """12 of 30 steps of configs/cpu_moe.toml, exported to <run>/hf at the end (and a golden curve)."""
    return cached_run(tmp_path_factory, MOE, *HF_V5, *FIRST_12_OF_30, "--checkpoint.export_hf", "true",
                      "--checkpoint.export_dtype", "float32", nproc=2)[0]


def test_huggingface_v5_dense_trains_12_steps(hf_dense_run):
    assert_learns(hf_dense_run)
    assert read_metrics(hf_dense_run)[-1]["backend"] == "huggingface_v5"


def test_huggingface_v5_moe_trains_12_steps(hf_moe_run):
    assert_learns(hf_moe_run)
    assert read_metrics(hf_moe_run)[-1]["backend"] == "huggingface_v5"


def test_huggingface_v5_resume_continues_exactly(hf_dense_run, outdir):
    """`hf_dense_run`'s step-5 checkpoint, relaunched to step 10 in a new run folder (as a run stopped after its step-5
    save would be), gives the same losses for steps 6-10 as the uninterrupted run: one launch, its reference shared.
    Both follow the 30-step lr schedule (`lr_scheduler.total_steps 30`)."""
    step5 = hf_dense_run / "checkpoint" / "step-5"
    assert (step5 / ".metadata").is_file()
    shutil.copytree(step5, outdir / "cpu_dense" / "checkpoint" / "step-5")
    proc = run_train(DENSE, *HF_V5, *CHECKPOINT_EVERY_5, "--lr_scheduler.total_steps", "30", "--training.steps", "10",
                     "--job.dump_folder", str(outdir), nproc=2)
    assert "steps 6-10" in proc.stdout
    resumed, reference = losses_by_step(outdir / "cpu_dense"), losses_by_step(hf_dense_run)
    assert sorted(resumed) == list(range(6, 11))
    for step in range(6, 11):
        assert abs(resumed[step] - reference[step]) <= 1e-6, (step, resumed[step], reference[step])


def test_huggingface_v5_export_loads_in_transformers(hf_moe_run):
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    from workbench.data.loader import PackedDataset

    model, info = AutoModelForCausalLM.from_pretrained(hf_moe_run / "hf", output_loading_info=True)
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tiny-moe is tied
    row, labels = next(iter(PackedDataset("shakespeare", "", 128)))
    with torch.no_grad():
        logits = model(input_ids=row["input"][None]).logits
    loss = torch.nn.functional.cross_entropy(logits[0], labels).item()
    # the trained weights, not an initialisation (ln 151936 = 11.93 at init; ~9.9 after 12 steps)
    assert loss < read_metrics(hf_moe_run)[0]["loss"] - 1.5, loss


# ---- nki_moe --------------------------------------------------------------------------------------------------------

def test_nki_moe_trains_and_matches_native(native_moe_2rank, tmp_path_factory):
    run_dir, _ = cached_run(tmp_path_factory, "configs/cpu_moe.toml", "--model.backend", "nki_moe",
                            "--model.moe_block_size", "32", *FIRST_12_OF_30, nproc=2)  # shared with test_golden_losses
    nki = assert_learns(run_dir)
    native = losses_by_step(native_moe_2rank)
    assert abs(nki[0] - native[1]) <= 1e-4, (nki[0], native[1])  # step-0 loss (first logged step, same init)
    for step in range(1, 13):
        rel = abs(nki[step - 1] - native[step]) / abs(native[step])
        assert rel <= 1e-3, f"step {step}: nki_moe {nki[step - 1]:.6f} vs native {native[step]:.6f}"
    assert all(math.isfinite(x) for x in nki)


def test_nki_moe_on_a_dense_flavor_is_a_config_error():
    proc = run_train("configs/cpu_dense.toml", "--model.backend", "nki_moe", check=False)
    assert proc.returncode != 0  # the rank exits 2; torchrun reports it as a failed child (1)
    assert "nki_moe replaces MoE expert layers, but flavor 'tiny' is dense" in proc.stderr
    assert "step 1/" not in proc.stdout

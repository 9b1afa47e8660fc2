"""Golden loss curves: the fp32 CPU losses of the tiny configs, per backend, on 1 and 2 ranks.

"The loss fell by 1.0" cannot see a change that shifts every backend equally (an init, the data order, the lr
schedule, a torchtitan upgrade); a stored curve can. Each case below is one launch; its first `GOLDEN_STEPS`
losses must match `tests/assets/losses/<case>.json` to `ATOL` (fp32 on CPU repeats to ~1e-6).

The 2-rank cases (and the 1-rank native ones) use exactly the arguments of runs other tests already make, so
`cached_run` shares them within a pytest session; only the three 1-rank huggingface_v5/nki_moe cases are extra
launches, shortened to `GOLDEN_STEPS` steps.

Regenerate deliberately, only after a change that is meant to move the curves (say which in the commit):

    PYTHONPATH=. OMP_NUM_THREADS=1 python tests/test_golden_losses.py            # all cases
    PYTHONPATH=. OMP_NUM_THREADS=1 python tests/test_golden_losses.py dense-native-1rank

then review `git diff tests/assets/losses/`. Recorded with torch 2.14.0 / torchtitan 0.3.0 / transformers 5.23.0
on an x86-64 CPU; the 1-rank curves repeat with 1 or 2 intra-op threads (2-rank runs use 1, torchrun's default).
A different CPU family or library version may move the last digits: regenerate there and say so.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # run as a script too (regeneration)
from run_helpers import cached_run, losses_by_step  # noqa: E402

pytestmark = pytest.mark.slow
ASSETS = Path(__file__).parent / "assets" / "losses"
GOLDEN_STEPS = 8
ATOL = 1e-5
SHORT = ("--training.steps", str(GOLDEN_STEPS))
NATIVE, HF, NKI = ("--model.backend", "native"), ("--model.backend", "huggingface_v5"), \
    ("--model.backend", "nki_moe", "--model.moe_block_size", "32")
HF_EXPORT = ("--checkpoint.export_hf", "true", "--checkpoint.export_dtype", "float32")

# name -> (config, args, nproc). Arguments equal to another test's cached_run share its launch: keep them in step.
CASES: dict[str, tuple[str, tuple[str, ...], int]] = {
    "dense-native-1rank": ("configs/cpu_dense.toml", NATIVE, 1),          # test_training_native
    "dense-native-2rank": ("configs/cpu_dense.toml", NATIVE, 2),          # test_training_native
    "dense-huggingface_v5-1rank": ("configs/cpu_dense.toml", HF + SHORT, 1),
    "dense-huggingface_v5-2rank": ("configs/cpu_dense.toml", HF, 2),      # test_huggingface_v5::dense_run
    "moe-native-1rank": ("configs/cpu_moe.toml", NATIVE, 1),              # test_training_native
    "moe-native-2rank": ("configs/cpu_moe.toml", NATIVE, 2),              # conftest::native_moe_2rank
    "moe-huggingface_v5-1rank": ("configs/cpu_moe.toml", HF + SHORT, 1),
    "moe-huggingface_v5-2rank": ("configs/cpu_moe.toml", HF + HF_EXPORT, 2),  # test_huggingface_v5::moe_run
    "moe-nki_moe-1rank": ("configs/cpu_moe.toml", NKI + SHORT, 1),
    "moe-nki_moe-2rank": ("configs/cpu_moe.toml", NKI, 2),                # test_nki_moe_backend
}


def golden_curve(run_dir: Path) -> dict[str, float]:
    losses = losses_by_step(run_dir)
    return {str(s): losses[s] for s in range(1, GOLDEN_STEPS + 1)}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_curve_matches_golden(name, tmp_path_factory):
    config, args, nproc = CASES[name]
    golden_file = ASSETS / f"{name}.json"
    golden = json.loads(golden_file.read_text())
    assert golden["config"] == config and golden["args"] == list(args) and golden["nproc"] == nproc, (
        f"{golden_file} was recorded for another launch; regenerate it (see this module's docstring)")
    run_dir, _ = cached_run(tmp_path_factory, config, *args, nproc=nproc)
    got = golden_curve(run_dir)
    assert all(math.isfinite(x) for x in got.values())
    off = {s: (got[s], want) for s, want in golden["losses"].items() if abs(got[s] - want) > ATOL}
    assert not off, (f"{name}: losses moved from {golden_file.name} (step: (now, golden)) {off}. A deliberate "
                     "change? Regenerate as this module's docstring says and review the diff.")


def regenerate(names: list[str]) -> None:
    """Launches each case in a temporary folder and rewrites its JSON file."""
    import tempfile

    class _Factory:  # cached_run's tmp_path_factory, outside pytest
        def __init__(self, root: str):
            self.root, self.n = Path(root), 0

        def mktemp(self, base: str) -> Path:
            self.n += 1
            (p := self.root / f"{base}{self.n}").mkdir()
            return p

    with tempfile.TemporaryDirectory() as tmp:
        factory = _Factory(tmp)
        for name in names:
            config, args, nproc = CASES[name]
            run_dir, _ = cached_run(factory, config, *args, nproc=nproc)
            record = {"config": config, "args": list(args), "nproc": nproc, "losses": golden_curve(run_dir)}
            (ASSETS / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
            print(name, record["losses"])


if __name__ == "__main__":
    regenerate(sys.argv[1:] or list(CASES))

"""Helpers shared by the tests: launching real training runs (torchrun over gloo) and reading their run folders, the
CPU code path every test process runs on, child processes, crafted pickles, transformers' reference models.

A module of its own (not conftest.py): notebooks/ has a conftest.py too, and `from conftest import` would be
ambiguous.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from workbench.run.metrics import read_metrics  # noqa: F401  (re-exported for the tests)

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# One CPU code path for every test process and everything it launches (the repository's conftest.py applies it
# before anything imports torch; children inherit it), so stored numbers hold on every x86-64 machine.
# fp32 CPU results depend on the path the libraries pick for the CPU: ATen's vector kernels
# (ATEN_CPU_CAPABILITY default / avx2 / avx512), MKL's GEMM branch (MKL_CBWR), oneDNN's ISA (ONEDNN_MAX_CPU_ISA)
# and the intra-op thread count (reduction order). The 2-rank MoE golden curves amplify a last-bit difference
# through the router's top-k: forcing another path on one AVX-512 machine moved them by up to ~1e-3 by step 8
# (`python -m tests.integration.test_golden_losses spread`). The pin is the baseline every x86-64 CPU has: ATen's
# default kernels, MKL's conditional-numerical-reproducibility branch COMPATIBLE (the same results on Intel and AMD
# CPUs, per MKL's CNR documentation), oneDNN capped at SSE4.1, one intra-op thread. It overrides the caller's
# environment on purpose (`ATEN_CPU_CAPABILITY=avx2 make test` passes too). Not pinned, because it cannot be
# from here: the C library's math functions (glibc's expf/logf: one implementation on every x86-64 CPU with FMA).
PINNED_CPU_PATH = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41",
                   "OMP_NUM_THREADS": "1"}
PINNED_ACTIVE = {"aten": "DEFAULT", "mkl_cbwr": "COMPATIBLE", "threads": 1}  # what active_cpu_path() then reads
# The pin costs speed: under it a tiny step (the real 151,936-token vocabulary's logits GEMM) takes about twice as
# long as on the machine's own path. Launches whose numbers are compared only with other launches of the same session
# (resume exactness, refusals, crash recovery, the memory plan against the allocator), never with stored numbers,
# need one path for all of them, not the pinned one: test modules marked `machine_cpu_path` launch on this machine's
# fastest path (ATen's best vector kernels, MKL's CNR branch AUTO: the same results run after run on one machine,
# oneDNN uncapped), one thread as under the pin (tests/conftest.py applies it; `cached_run` keys a launch by its
# path, so a pinned module never reuses one of these). So do the notebooks under nbval (notebooks/conftest.py: their
# checked outputs are sanitized to hold on any machine). The test processes themselves stay pinned.
MACHINE_CPU_PATH = {"ATEN_CPU_CAPABILITY": None, "MKL_CBWR": "AUTO", "ONEDNN_MAX_CPU_ISA": None, "OMP_NUM_THREADS": "1"}

# glibc's malloc for the session's processes (applied with the pin; performance only, no number changes): keep freed
# memory for reuse instead of handing it back to the kernel. Every step of the tiny configs allocates and frees
# logits of the real 151,936-token vocabulary (~155 MB fp32 per rank); by default glibc maps such a block afresh
# (mmap threshold) and unmaps it on free, so the next step page-faults it in again. Measured on a 20-step 2-rank
# cpu_dense launch: 31 of its 81 CPU-s were kernel time, 6 with these settings (68 -> 46 s wall), losses
# bit-identical; the price is RSS: a rank keeps its peak (~1.4 -> ~2.1 GiB).
SESSION_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**36),
                  "MALLOC_TOP_PAD_": str(2**30)}
_MKL_CBWR_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE"}  # mkl_service.h (a refused branch reads as AUTO)


def use_machine_cpu_path(mp) -> None:
    """Sets `MACHINE_CPU_PATH` in this process's environment through `mp` (a pytest.MonkeyPatch), for what it starts
    until `mp` undoes it."""
    for name, value in MACHINE_CPU_PATH.items():
        if value is None:
            mp.delenv(name, raising=False)
        else:
            mp.setenv(name, value)


def active_cpu_path() -> dict:
    """The code path this process runs: ATen's CPU capability, MKL's CNR branch, intra-op threads."""
    import ctypes

    import torch

    torch.ones(2, 2) @ torch.ones(2, 2)  # MKL reads MKL_CBWR when it first runs
    mkl = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))  # MKL linked in
    branch = mkl.mkl_serv_cbwr_get(1)  # MKL_CBWR_BRANCH
    return {"aten": torch.backends.cpu.get_cpu_capability(), "mkl_cbwr": _MKL_CBWR_BRANCHES.get(branch, branch),
            "threads": torch.get_num_threads()}


def train_cmd(config: str, *args: str, nproc: int = 1, extra_torchrun: tuple[str, ...] = ()) -> list[str]:
    """The article's launch line (torchrun ... train.py --job.config_file ...) for this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *extra_torchrun,
            str(ROOT / "train.py"), "--job.config_file", str(ROOT / config), *args]


def run_train(config: str, *args: str, nproc: int = 1, timeout: int = 600, check: bool = True,
              extra_torchrun: tuple[str, ...] = (), env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs a training job to completion (in `env`, default this process's); on failure the assertion shows its
    output."""
    if "--master_port" not in " ".join(extra_torchrun) and "--rdzv" not in " ".join(extra_torchrun):
        extra_torchrun = (*extra_torchrun, f"--master_port={free_port()}")
    proc = subprocess.run(train_cmd(config, *args, nproc=nproc, extra_torchrun=extra_torchrun), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert proc.returncode == 0, (f"training failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}\n"
                                      f"{proc.stderr[-6000:]}")
    return proc


def kill_run_when(config: str, *args: str, ready, nproc: int = 1, timeout: float = 300,
                  env: dict[str, str] | None = None) -> list[int]:
    """Launches a training job like `run_train`, polls `ready()` until it holds (or the run ends, or `timeout`
    seconds pass), then SIGKILLs torchrun and every rank at once: no clean-up, what a crash or the OOM killer does.

    Returns:
        The killed pids (torchrun first), all reaped or gone.
    """
    import signal
    import time

    import psutil

    proc = subprocess.Popen(train_cmd(config, *args, nproc=nproc, extra_torchrun=(f"--master_port={free_port()}",)),
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.05)
    # torchrun starts each rank in its own session: kill the whole tree explicitly.
    victims = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    return victims


def python_child(code: str) -> subprocess.Popen:
    """A Python child running `code` from the repository (the workbench importable); stdout and stderr are pipes."""
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """step -> loss; a resumed run appends to the same file, the latest record of a step wins."""
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SESSION_RUNS: dict[tuple, tuple[Path, str]] = {}

# The shared launches (golden curves, "it learns", the uninterrupted references) train the first 12 steps of the
# configs' 30-step lr schedule: the same losses, step for step, as a 30-step run, for two fifths of its time. 12 is
# enough for "it learns" (the last-5 mean is 1.24-1.35 below the first-5 mean on every path, 2 ranks) and the
# resume tests (checkpoints at 5 and 10).
FIRST_12_OF_30 = ("--training.steps", "12", "--lr_scheduler.total_steps", "30")


def session_dir(tmp_path_factory) -> Path:
    """A folder of this pytest session that every xdist worker sees (the workers' base folders share a parent,
    unique to the session); without xdist, the session's own base folder."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def cached_run(tmp_path_factory, config: str, *args: str, nproc: int = 1) -> tuple[Path, str]:
    """Runs a training job once per test session, whichever xdist worker asks first; returns (run folder, rank-0
    stdout), shared by several tests. A worker that asks while another is launching it waits for that launch."""
    import hashlib

    from filelock import FileLock

    key = (config, args, nproc, tuple(os.environ.get(k) for k in PINNED_CPU_PATH))  # the CPU path: pinned or not
    if key not in _SESSION_RUNS:
        slot = session_dir(tmp_path_factory) / "shared_runs" / hashlib.sha1(repr(key).encode()).hexdigest()[:16]
        slot.mkdir(parents=True, exist_ok=True)
        with FileLock(slot / "lock"):
            stdout = slot / "stdout.txt"  # written last: its presence means the launch succeeded
            if not stdout.exists():
                out = slot / "out"
                shutil.rmtree(out, ignore_errors=True)  # a failed launch of another worker
                out.mkdir()
                stdout.write_text(run_train(config, *args, "--job.dump_folder", str(out), nproc=nproc).stdout)
        (run_dir,) = [p for p in (slot / "out").iterdir() if p.is_dir()]
        _SESSION_RUNS[key] = (run_dir, stdout.read_text())
    return _SESSION_RUNS[key]


_UNBLOCKER = """
import os, sys, time
fifo, flag, every = sys.argv[1], sys.argv[2], float(sys.argv[3])
while True:
    time.sleep(every)
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        open(flag, "w").close()
    except OSError:
        pass
"""


@contextlib.contextmanager
def unblocking(fifo: Path, every_s: float = 5.0):
    """While in the block, a helper process opens `fifo` for writing every `every_s` seconds, which frees a reader
    blocked on it (a blocked `open` holds the GIL in some readers, so no thread of this process could); yields a
    function that says whether a reader ever was blocked: the proof that the code under test hung, where without the
    helper the test would hang instead of failing."""
    flag = Path(f"{fifo}.was-blocked")
    helper = subprocess.Popen([sys.executable, "-c", _UNBLOCKER, str(fifo), str(flag), str(every_s)])
    try:
        yield flag.exists
    finally:
        helper.kill()
        helper.wait()


class PicklePayload:
    """Unpickling it runs `exec`, which writes "ran" into `marker`: the proof that a loader unpickled what it was
    given (a refusal names the class `builtins.exec`)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def assert_plan_close(planned: dict, measured: dict, tol: float = 0.15) -> None:
    """A memory plan against a real step's tracked peak: the peak, and every category that is over 2% of it, within
    `tol` (relative)."""
    assert abs(planned["peak_bytes"] / measured["peak_bytes"] - 1) <= tol, (planned, measured)
    for cat, real in measured["categories"].items():
        if real > 0.02 * measured["peak_bytes"]:  # categories that matter to the peak
            assert abs(planned["categories"][cat] / real - 1) <= tol, (cat, planned["categories"], measured)


def randomize_norms_and_biases(model, seed: int = 0) -> list[str]:
    """Draws every norm weight of a transformers model as 1 + N(0, 0.3) and every bias as N(0, 0.1), in place.

    `from_config` leaves each RMSNorm weight exactly 1.0, so a checkpoint written from it hides a swapped or
    dropped norm (q_norm/k_norm, input/post-attention, final) from every logit comparison. Qwen3 has no biases
    (attention_bias=False; the MoE router has none); any a config adds are drawn too. Returns the names drawn.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    drawn = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                continue
            drawn.append(name)
    return drawn


def hf_model(shape, seed: int = 0):
    """transformers' own model of a `flavors.Qwen3Shape` (seeded init, random norms), fp32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from workbench.core import flavors

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(flavors.hf_config(shape)).eval()
    randomize_norms_and_biases(model, seed)  # from_config's norm weights are all 1.0: a swap would not show
    return model


def hf_logits(model_or_dir, ids):
    """transformers' fp32 logits of `ids`, from a model or a checkpoint folder it loads."""
    import torch
    from transformers import AutoModelForCausalLM

    model = model_or_dir
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def assert_identical(cmp) -> None:
    """A `workbench.compare.Comparison` of a checkpoint with an identical one: equal in every tensor, logit,
    perplexity and generation."""
    assert (cmp.tensors.status == "same keys").all()
    assert (cmp.tensors.max_abs == 0).all() and (cmp.tensors.rel_norm == 0).all()
    assert cmp.heldout["logits_max_abs_diff"] == 0 and cmp.heldout["top1_agreement"] == 1
    assert cmp.heldout["ppl_a"] == cmp.heldout["ppl_b"]
    assert cmp.generations.same.all()


def check_memory_report(run_dir: Path, stdout: str, ranks: int) -> dict:
    """A launch's first-launch memory check (`--job.memory_measure always`): `<run>/memory_check.json` has steps 1
    and 2 of `ranks` ranks against the CPU plan, and the launch printed each step's measured peak. Returns it."""
    import json

    report = json.loads((run_dir / "memory_check.json").read_text())
    assert [s["step"] for s in report["steps"]] == [1, 2] and report["world_size"] == ranks
    assert report["plan"]["device"] == "cpu" and report["plan"]["device_runtime_bytes"] == 0
    for s in report["steps"]:
        assert len(s["measured_bytes"]) == ranks and s["max_bytes"] == max(s["measured_bytes"])
        assert f"memory step {s['step']}: measured peak {s['max_bytes'] / 2**30:.2f} GiB" in stdout
    return report

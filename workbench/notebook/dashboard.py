"""A live training dashboard for notebooks: loss and tokens/s curves plus a progress bar while torchrun trains.

    from workbench.notebook import train_with_dashboard
    run_dir = train_with_dashboard(job, nproc=2)      # live in JupyterLab, a static plot under papermill / nbval

How it is fed: `workbench.train.train(job, stream=dashboard)` hands every output line of the torchrun
subprocess to the dashboard. Lines are only a *clock*: on each one the dashboard reads whatever new records
the trainer appended to `<run>/metrics.jsonl` (the run-folder contract: one JSON object per logged step) and
updates from those, so nothing depends on the wording of the progress lines. The lines themselves are kept
(the last `log_tail`) and printed if training fails, because they hold the real error.

Which records belong to this launch: a resumed run appends to the metrics.jsonl already in the run folder, so the
dashboard starts reading at its end. A fresh run in a reused folder makes the trainer *replace* the file at its
first step (and anything may truncate it), so every poll checks that the file is still the one it was reading
(same inode, not shorter than the read position, same first bytes); if not, it reads the new file from the start.

Two modes:
  * live — a frontend is attached (JupyterLab, classic Notebook, VS Code): a progress bar, a one-line status
    and a PNG of the curves in ipywidgets, redrawn at most every `refresh_s` seconds. They are displayed under a
    display id, and at the end that output is *updated in place* to the static figure (then the widgets are
    closed), so a saved notebook (and GitHub / nbviewer) holds the figure and the summary line only, no dead
    widget placeholders ("0%| | 0/8", "VBox(children=...)").
  * static — nobody is watching (papermill, nbconvert --execute, nbval, plain Python): nothing per step; at the
    end one static matplotlib figure and a short text summary. Widget outputs would be dead weight in an
    executed notebook and would make nbval outputs differ from run to run.

Detection (`live_frontend`): `WORKBENCH_DASHBOARD=live|static` wins (the batch runner sets `static`). Otherwise,
inside an IPython kernel, the current execute request tells: headless executors send `allow_stdin=False`
(nbclient, hence papermill and nbconvert) or `store_history=False` (nbval), interactive frontends send both
true. Outside a kernel (plain Python, a terminal) the mode is static.

Only this package imports ipywidgets; the trainer and `workbench.train` never do.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from workbench.core.config import JobConfig
from workbench.core.errors import TrainingFailed

ENV_MODE = "WORKBENCH_DASHBOARD"
_HEAD = 256  # bytes of metrics.jsonl compared on every poll to notice that the file was replaced


def _kernel():
    """The running ipykernel instance, or None outside a kernel."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return getattr(shell, "kernel", None) if shell is not None else None


def live_frontend() -> bool:
    """True when a notebook frontend is attached that will render widgets as they change.

    See the module docstring for the rules; `WORKBENCH_DASHBOARD=live` / `=static` overrides them.
    """
    forced = os.environ.get(ENV_MODE, "").strip().lower()
    if forced in ("live", "static"):
        return forced == "live"
    kernel = _kernel()
    if kernel is None:
        return False
    try:
        parent = kernel.get_parent("shell") if hasattr(kernel, "get_parent") else kernel._parent_header
        content = (parent or {}).get("content", {})
    except Exception:  # an unusual kernel: assume a person is watching
        return True
    return bool(content.get("allow_stdin", True)) and bool(content.get("store_history", True))


def _display(obj: Any) -> None:
    """IPython display inside a kernel, print elsewhere."""
    if _kernel() is not None:
        from IPython.display import display

        display(obj)
    else:
        print(obj)


class Dashboard:
    """Stream callback for `workbench.train.train(..., stream=...)` that shows training progress.

    Args:
        run_dir: the job's run folder (`job.run_dir`); its metrics.jsonl is tailed.
        total_steps: `training.steps` (the progress bar's length).
        title: heading of the plot and summary (default: the run folder's name).
        live: force live (True) or static (False) mode; None = `live_frontend()`.
        refresh_s: minimum seconds between two redraws of the live plot.
        log_tail: output lines kept for the failure report.
        echo: also print every output line (for debugging; off by default to keep notebooks short).
        checkpoint_steps: steps after which the run saves a checkpoint (the live status says so while it saves).
        export: the run exports Hugging Face weights after its last step (the live status says so meanwhile).

    Use as a context manager (or call `close()`): it draws the final figure and summary.
    """

    def __init__(self, run_dir: str | os.PathLike, total_steps: int, title: str = "", *, live: bool | None = None,
                 refresh_s: float = 1.0, log_tail: int = 60, echo: bool = False,
                 checkpoint_steps: Iterable[int] = (), export: bool = False):
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.total_steps = total_steps
        self.title = title or self.run_dir.name
        self.live = live_frontend() if live is None else live
        self.refresh_s = refresh_s
        self.echo = echo
        self.checkpoint_steps, self.export = set(checkpoint_steps), export
        self.lines: deque[str] = deque(maxlen=log_tail)
        self.records: list[dict[str, Any]] = []
        # Only this launch's records: a resumed run appends to the existing metrics.jsonl, so start at its end;
        # `poll` notices when a fresh run replaces the file instead (module docstring).
        self._offset, self._partial, self._inode, self._head = 0, "", None, b""
        with contextlib.suppress(FileNotFoundError):
            with open(self.metrics_path, "rb") as f:
                self._inode, self._head = os.fstat(f.fileno()).st_ino, f.read(_HEAD)
                self._offset = f.seek(0, os.SEEK_END)
        self._t0 = time.perf_counter()
        self._last_draw = 0.0
        self._closed = False
        self._widgets: dict[str, Any] = {}
        self._fig = None
        self._handle = None  # the live widgets' display handle
        if self.live:
            self._open_widgets()

    # -- feeding --------------------------------------------------------------------------------

    def __call__(self, line: str) -> None:
        """Receives one output line of the training subprocess."""
        self.lines.append(line.rstrip("\n"))
        m = _DEVICE_LINE.search(line)
        if m and " · auto · " in self.title:  # the device "auto" resolved to, as the trainer reports it
            self.title = self.title.replace(" · auto · ", f" · {m[1]} · ")
            if self.live:
                self._widgets["bar"].description = self.title
        if self.echo:
            print(line, end="" if line.endswith("\n") else "\n", flush=True)
        if not self.live:
            self.poll()
        elif self.poll():
            self._update_live()
        elif not self.records:  # still starting: say so, with the time it has taken so far
            self._widgets["status"].value = self._starting_html()
        elif "exported Hugging Face weights" in line:
            self._widgets["status"].value = self._status_html(self.records[-1], "exported; closing the run")

    def poll(self) -> int:
        """Reads records appended to metrics.jsonl since the last call; returns how many were new.

        If the file is no longer the one read so far (replaced by a fresh run, truncated), this launch's records
        are those of the new file, read from its start.
        """
        try:
            f = open(self.metrics_path, "rb")
        except (FileNotFoundError, IsADirectoryError):
            return 0
        with f:
            inode, size = os.fstat(f.fileno()).st_ino, os.fstat(f.fileno()).st_size
            # The inode alone is not enough: unlink + create often reuses the freed inode number; a new file
            # that already outgrew the read position is caught by its different first record.
            if self._inode is not None and (inode != self._inode or size < self._offset
                                            or f.read(len(self._head)) != self._head):
                self._offset, self._partial, self._head = 0, "", b""  # from now on, the new file's first bytes
                self.records.clear()
            self._inode = inode
            if len(self._head) < _HEAD:  # the first bytes may still be being written
                f.seek(0)
                self._head = f.read(_HEAD)
            f.seek(self._offset)
            chunk = f.read()
        if not chunk:
            return 0
        self._offset += len(chunk)
        text = self._partial + chunk.decode("utf-8", errors="replace")
        *complete, self._partial = text.split("\n")  # a line being written stays for the next poll
        new = 0
        for raw in complete:
            if raw.strip():
                try:
                    self.records.append(json.loads(raw))
                    new += 1
                except json.JSONDecodeError:
                    pass
        return new

    # -- live mode (ipywidgets) -------------------------------------------------------------------

    def _open_widgets(self) -> None:
        import ipywidgets as widgets
        from IPython.display import display

        w = self._widgets
        w["bar"] = widgets.IntProgress(value=0, min=0, max=self.total_steps, description=self.title,
                                       style={"description_width": "initial"},
                                       layout=widgets.Layout(width="100%", max_width="900px"))
        w["status"] = widgets.HTML(self._starting_html())
        # Hidden until the first curve exists: an Image widget without data shows a broken-image icon.
        w["image"] = widgets.Image(format="png", layout=widgets.Layout(max_width="100%", display="none"))
        w["box"] = widgets.VBox([w["bar"], w["status"], w["image"]])
        # A display id, so that `close` can replace this very output with the static result.
        self._handle = display(w["box"], display_id=True)

    def _update_live(self, force: bool = False) -> None:
        last = self.records[-1]
        self._widgets["bar"].value = min(int(last["step"]), self.total_steps)
        self._widgets["status"].value = self._status_html(last)
        now = time.perf_counter()
        if force or now - self._last_draw >= self.refresh_s:
            self._last_draw = now
            self._widgets["image"].value = self._png()
            self._widgets["image"].layout.display = None

    def _starting_html(self) -> str:
        return (f"<code>starting: {time.perf_counter() - self._t0:.0f} s (imports, process group, model build, "
                "step 1)…</code>")

    def _after_step(self, step: int) -> str:
        """What the run does after `step` before the next one is logged: saving, exporting, or nothing."""
        phases = []
        if step in self.checkpoint_steps:
            phases.append(f"saving checkpoint step {step}")
        if step >= self.total_steps and self.export:
            phases.append("exporting Hugging Face weights")
        return " · ".join(phases) + "…" if phases else ""

    def _status_html(self, r: dict[str, Any], phase: str | None = None) -> str:
        mem = r.get("peak_memory_bytes", 0) / 2**30
        resumed = self.records[0]["step"] - 1 if self.records else 0
        phase = self._after_step(int(r["step"])) if phase is None else phase
        return (f"<code>step {r['step']}/{self.total_steps}{f' (resumed after step {resumed})' if resumed else ''}"
                f" · loss {r['loss']:.4f} · "
                f"{r['tokens_per_second']:,.0f} tok/s · MFU {100 * r.get('mfu', 0):.2f}% · "
                f"{mem:.2f} GiB · {time.perf_counter() - self._t0:.0f} s</code>"
                + (f"<br><b>{phase}</b>" if phase else ""))

    def _png(self) -> bytes:
        import io

        fig = self.figure()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80)
        return buf.getvalue()

    # -- results -----------------------------------------------------------------------------------

    def frame(self):
        """This launch's records as a DataFrame indexed by step."""
        import pandas as pd

        if not self.records:
            return pd.DataFrame(columns=["loss", "tokens_per_second"])
        return pd.DataFrame(self.records).drop_duplicates("step", keep="last").set_index("step").sort_index()

    def figure(self):
        """The loss / tokens-per-second figure of the records so far (one Figure, redrawn in place)."""
        from workbench.notebook.reports import plot_metrics

        self._fig = plot_metrics(self.frame(), self.title, fig=self._fig)
        return self._fig

    def summary_text(self, ok: bool = True) -> str:
        """A short, human summary of this launch."""
        seconds = time.perf_counter() - self._t0
        if not self.records:
            return f"{self.title}: no steps logged ({'finished' if ok else 'FAILED'} after {seconds:.0f} s)."
        first, last = self.records[0], self.records[-1]
        resumed = f" (resumed after step {first['step'] - 1})" if first["step"] > 1 else ""
        tps = sorted(r["tokens_per_second"] for r in (self.records[1:] or self.records))  # step 1 includes warm-up
        mfu = sorted(r.get("mfu", 0.0) for r in (self.records[1:] or self.records))
        return (f"{self.title}: {'finished' if ok else 'FAILED'} · backend {last.get('backend', '?')} · "
                f"steps {first['step']}–{last['step']} of {self.total_steps}{resumed} · "
                f"loss {first['loss']:.4f} → {last['loss']:.4f} · median {tps[len(tps) // 2]:,.0f} tok/s · "
                f"median MFU {100 * mfu[len(mfu) // 2]:.2f}% · {seconds:.0f} s wall")

    def close(self, ok: bool = True) -> None:
        """Final state (both modes): one static figure and the text summary; on failure also the log tail."""
        if self._closed:
            return
        self._closed = True
        self.poll()
        final = self.figure() if self.records else None
        if self.live:
            # The widgets' output becomes the figure (or nothing): a saved notebook keeps static outputs only.
            # Update first, then close the widget models, so the frontend never shows a dangling view.
            if final is not None:
                self._handle.update(final)
            else:
                self._handle.update({}, raw=True)
            for w in self._widgets.values():
                w.close()
            self._widgets.clear()
        elif final is not None:
            _display(final)
        print(self.summary_text(ok), flush=True)
        if not ok:
            print("--- last output lines ---\n" + "\n".join(self.lines), file=sys.stderr, flush=True)

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)


_DEVICE_LINE = re.compile(r"^workbench: backend .*, device (\w+) x \d+ rank")
_AGENT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def failure_excerpt(lines: list[str], n: int = 20) -> str:
    """The telling part of a failed torchrun's output, for an error message.

    torchrun ends a failed job with its own traceback and a "Root Cause" box, which say only that a rank
    died; the ranks' real error is printed before them. So: the `n` lines before torchrun's "failed
    (exitcode: ...)" report, plus which rank died how; without such a report, the last `n` lines.
    """
    for i, line in enumerate(lines):
        m = _AGENT_FAILED.search(line)
        if m:
            code = int(m[1])
            how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
                else f"exit code {code}"
            body = "\n".join(lines[max(0, i - n):i])
            return f"local rank {m[2]} died with {how}; its last output lines:\n{body}"
    return "last output lines:\n" + "\n".join(lines[-n:])


@contextlib.contextmanager
def transient_progress(done: str = ""):
    """Shows what the body displays (e.g. tqdm progress bars) while it runs, then removes it from the notebook.

    In a live frontend the body's display output goes into an `ipywidgets.Output` shown under a display id; at
    the end that output is replaced by `done` (plain text; empty: nothing), so the saved notebook holds no
    widget placeholders. Headless (papermill, nbval, plain Python) the body runs as is.
    """
    if not live_frontend():
        yield
        return
    import ipywidgets as widgets
    from IPython.display import display

    out = widgets.Output()
    handle = display(out, display_id=True)
    try:
        with out:
            yield
    finally:
        handle.update({"text/plain": done} if done else {}, raw=True)
        out.close()


@contextlib.contextmanager
def status_line(what: str, done: str = ""):
    """A one-line status for a long call that prints nothing itself (compare, parity, plan): "what… 12 s", ticking
    every second, and a `say(text)` to change `what` as phases start. Replaced by `done` (empty: removed) at the
    end, so the saved notebook keeps no widget. Headless (papermill, nbval, plain Python) nothing is shown.

    Yields:
        say(text): sets the status's text (the elapsed time follows it).
    """
    if not live_frontend():
        yield lambda _text: None
        return
    import threading

    import ipywidgets as widgets
    from IPython.display import display

    t0, text, stop = time.perf_counter(), [what], threading.Event()
    label = widgets.HTML()

    def show() -> None:
        label.value = f"<code>{text[0]}… {time.perf_counter() - t0:.0f} s</code>"

    def tick() -> None:
        while not stop.wait(1.0):
            show()

    def say(new: str) -> None:
        text[0] = new
        show()

    show()
    handle = display(label, display_id=True)
    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield say
    finally:
        stop.set()
        ticker.join()
        handle.update({"text/plain": done} if done else {}, raw=True)
        label.close()


def plan_with_status(job: JobConfig, device: str, nproc: int, **kwargs) -> dict:
    """`workbench.memory.report.plan` with a status line while it traces and re-plans (nothing on stderr)."""
    from workbench.memory import report

    with status_line(f"planning {job.model.flavor} {job.model.backend} on {nproc} rank(s) of {device}") as say:
        return report.plan(job, device, nproc, progress=say, **kwargs)


def compare_with_status(a, b, what: str = "comparing", **kwargs):
    """`workbench.compare.compare(a, b, **kwargs)` with a status line while it loads, evaluates and generates."""
    from workbench.compare import compare

    with status_line(f"{what}: loading both checkpoints, held-out logits, greedy generations"):
        return compare(a, b, **kwargs)


def _child_can_import_workbench() -> None:
    """Makes sure the torchrun child imports *this* workbench, whatever the kernel's working directory.

    `train()` runs `python -m workbench.train` with the kernel's environment and cwd; a kernel started in
    `notebooks/` without the project pip-installed would otherwise fail with "No module named workbench".
    """
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *parts])


def fresh_run_dir(run_dir: str | os.PathLike) -> None:
    """Removes an earlier run folder so training starts from scratch (no DCP resume, no old metrics).

    Refuses a folder that does not look like a run folder (no config.toml / launch.toml / metrics.jsonl), so a
    mistyped experiment_name can never delete anything else.
    """
    import shutil

    d = Path(run_dir)
    if not d.exists():
        return
    if not any((d / f).exists() for f in ("config.toml", "launch.toml", "metrics.jsonl")):
        raise FileExistsError(f"{d} exists but is not a run folder; choose another experiment_name or dump_folder.")
    shutil.rmtree(d)


def train_with_dashboard(job: JobConfig, nproc: int = 1, extra_args: list[str] | None = None, *,
                         live: bool | None = None, title: str = "", echo: bool = False, fresh: bool = False) -> Path:
    """Trains `job` with `nproc` ranks (torchrun subprocess) while showing the dashboard; returns the run folder.

    Args:
        job: a validated JobConfig (e.g. from `job_from_params`).
        nproc: ranks on this machine (torchrun --nproc_per_node).
        extra_args: more `--section.key value` overrides for the launch.
        live: force the dashboard mode (None = detect, see `live_frontend`).
        title: heading (default "<config> · <backend> · <flavor> · <dataset> · <steps> steps · <device> · <nproc>
            rank(s)").
        echo: print every output line of the training processes as well.
        fresh: start from scratch: remove an earlier run folder of the same name first (`fresh_run_dir`).
            Otherwise an existing run folder with DCP checkpoints is resumed, as on the command line.

    Raises:
        TrainingFailed: torchrun failed; the message carries the last output lines.
    """
    from workbench.train import train

    _child_can_import_workbench()
    if fresh:
        fresh_run_dir(job.run_dir)
    from workbench.notebook.display import plot_title

    title = title or f"{plot_title(job)} · {nproc} rank(s)"
    ckpt = job.checkpoint
    saves = set(range(ckpt.interval, job.training.steps + 1, ckpt.interval)) | {job.training.steps} \
        if ckpt.enable and ckpt.interval > 0 else set()
    dash = Dashboard(job.run_dir, job.training.steps, title, live=live, echo=echo, checkpoint_steps=saves,
                     export=ckpt.export_hf)
    try:
        run_dir = train(job, nproc=nproc, extra_args=extra_args, stream=dash)
    except subprocess.CalledProcessError as e:
        dash.close(ok=False)
        raise TrainingFailed(f"training exited with code {e.returncode}; {failure_excerpt(list(dash.lines))}") from None
    except BaseException:
        dash.close(ok=False)
        raise
    dash.close(ok=True)
    return Path(run_dir)


__all__ = ["Dashboard", "TrainingFailed", "live_frontend", "train_with_dashboard", "fresh_run_dir", "failure_excerpt",
           "status_line", "plan_with_status", "compare_with_status",
           "transient_progress", "ENV_MODE"]

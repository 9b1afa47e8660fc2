"""One kernel launch in the NKI emulator: LNC cores, the core barrier, cross-core races, instruction emission.

One kernel launch (`kernel[lnc](...)`) runs the kernel's Python body once per core. Cores run one at a time in a
fixed order (core 0 up to its next `core_barrier`, then core 1 up to its next one, ...), so a run is deterministic;
between two barriers each core logs every access to shared HBM, and at the barrier (and at the end of the kernel)
any element written by one core and read or written by another is a race (`lnc-race`), and any compiled loop that
ran a different number of times on the two cores is divergent control flow (`lnc-divergent-control`).

Instructions are recorded, not just executed: outside a compiled loop an instruction runs as soon as it is traced;
inside one (`loops`) it is recorded into the loop's body, which the loop then runs once per runtime iteration.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref

import torch

from .counters import Counters, HbmAllocation, active_counters, bump, merge
from .errors import violation

DOCS = "https://awsdocs-neuron.readthedocs-hosted.com/en"
URL_PROGRAM_ID = f"{DOCS}/v2.33.0/nki/api/generated/nki.language.program_id.html"
URL_BARRIER = f"{DOCS}/v2.33.0/nki/api/generated/nki.isa.core_barrier.html"
URL_LNC = f"{DOCS}/v2.33.1/nki/get-started/about/lnc.html"

_violation = violation

class _Abort(BaseException):
    """Unwinds a core's thread when another core failed."""


class Launch:
    """State of one kernel launch over `lnc` cores."""

    def __init__(self, lnc: int, budget):
        self.lnc = lnc
        self.core = 0
        self.budgets = [budget() for _ in range(lnc)]  # budget: memory.Budget, one core's on-chip memory
        self.shared: list = []  # the n-th nl.shared_hbm allocation, shared by all cores
        self.hbm: list = []  # every HBM storage the kernel allocated (Counters.hbm_allocations)
        self.shared_next = [0] * lnc
        self.trace: list[list] = [[] for _ in range(lnc)]  # stack of compiled-loop bodies being traced, per core
        self.control: list[list] = [[] for _ in range(lnc)]  # per core, (loop, site, trips) of each loop run
        self.static = [dict() for _ in range(lnc)]
        self.executed: dict = {}
        self.stats = Counters()
        self.log: dict = {}  # storage id -> (storage, [records]) for the current epoch (lnc > 1 only)
        self.current = None  # description of the instruction executing now
        self.epoch = 0
        self.abort = False
        self.pending = None  # a deferred uninitialized-read of shared HBM (see memory._uninitialized)
        self.taint: list[str] = []  # poison sources the running instruction has read (see memory._poison)
        self.moved: list = []  # (storage, init, selector) a data movement read, resolved only if it moved poison
        self.tracing = any(c.trace is not None for c in active_counters)
        self.accesses = None  # while tracing: what the executing instruction touched (`touch`)
        # while tracing: storage or register -> its serial number in this launch. Weak keys: holding every tile a
        # loop allocated would keep all their data alive (GBs for a long kernel); an `id()` could be reused
        self.keys = weakref.WeakKeyDictionary()
        self.serials = 0
        if self.tracing:
            self.stats.trace = [[] for _ in range(lnc)]

    # instructions ----------------------------------------------------------------------------------------------
    def emit(self, engine: str, op: str, run, site: str, work=None) -> None:
        """Trace one instruction; run it now, or record it into the compiled loop being traced. `work`: its
        static work descriptor for the time model (nki_emulator.timing), counted per core when it executes."""
        bump(self.static[self.core], engine)
        node = (engine, op, run, site, work)
        stack = self.trace[self.core]
        if stack:
            _detach_closure(run)
            stack[-1].append(node)
        else:
            self.execute(node)

    def execute(self, node) -> None:
        engine, op, run, site, work = node
        if engine == "control":
            run()  # a loop: counts as one instruction per iteration's branch, below
            return
        bump(self.stats.executed, engine)
        bump(self.stats.work, (self.core, engine, op, work))
        self.current = f"core {self.core}: {op} at {site}"
        if not self.tracing:
            run()
            return
        self.accesses = []
        try:
            run()
        finally:
            self.stats.trace[self.core].append((engine, op, work, site, self.accesses))
            self.accesses = None

    def touch(self, storage, kind: str, start: int, pattern, outer) -> None:
        """While tracing, note the box of `storage` the executing instruction reads or writes: rows [r0, r1] and
        columns [c0, c1] of the storage seen as rows of C elements (C: the row length of its outermost dim: one
        partition's bytes on chip, the last dim in HBM), from flat elements start + sum i_k*step_k (`outer`, a row
        gather's offsets, replacing term 0). A term that is not whole rows and not inside one row spans all
        columns (a conservative box: it can only add dependencies)."""
        if self.accesses is None:
            return
        data = storage.data
        C = (data.stride(0) if storage.buffer.on_chip else data.shape[-1]) if data.dim() > 1 else max(1, data.numel())
        r0 = r1 = start // C
        c0 = c1 = start % C
        for k, (s, n) in enumerate(pattern):
            if (k == 0 and outer is not None) or n <= 1:
                continue
            if s % C == 0:
                r1 += s // C * (n - 1)
            elif s * (n - 1) < C:
                c1 += s * (n - 1)
            else:
                c0, c1, r1 = 0, C - 1, r1 + s * (n - 1) // C + 1
        if outer is not None:
            r0, r1 = r0 + int(outer.min()) // C, r1 + int(outer.max()) // C
        if c1 >= C:  # wraps into the next row
            c0, c1, r1 = 0, C - 1, r1 + c1 // C
        self.accesses.append((self.key(storage), kind, r0, r1, c0, c1))

    def key(self, obj) -> int:
        """A serial number for a storage or register, unique within the launch (not its `id()`: that can be reused
        once the object is freed, which would tie unrelated tiles together)."""
        serial = self.keys.get(obj)
        if serial is None:
            serial = self.keys[obj] = self.serials
            self.serials += 1
        return serial

    # control flow ----------------------------------------------------------------------------------------------
    def check_control(self, where: str) -> None:
        """Raise `lnc-divergent-control` if, since the last barrier, the cores' compiled loops ran differently.

        The LNC page (final notes): the SDK assumes the program on each core "is executing the same basic control
        flow as the other cores ... if you use dynamic control flow, and this control-flow is different on the
        different cores, then the behavior is undefined, and you will likely receive an error at runtime".
        """
        if self.lnc == 1:
            return
        for k in range(1, self.lnc):
            a, b = self.control[0], self.control[k]
            for n in range(max(len(a), len(b))):
                mine, theirs = a[n] if n < len(a) else None, b[n] if n < len(b) else None
                if mine != theirs:
                    raise self._divergence(mine, theirs, k, where)
        for events in self.control:
            events.clear()

    def _divergence(self, mine, theirs, k: int, where: str):
        def run(event):
            return "no further compiled loop" if event is None else f"{event[0]} at {event[1]} ({event[2]} iterations)"

        if mine is not None and theirs is not None and mine[:2] == theirs[:2]:
            what = f"{mine[0]} at {mine[1]} runs {mine[2]} iterations on core 0 but {theirs[2]} on core {k}"
        else:
            what = f"core 0 runs {run(mine)} where core {k} runs {run(theirs)}"
        return _violation(
            "lnc-divergent-control", f"{what} ({where}): at LNC {self.lnc} both cores must run the same compiled "
            "control flow (different trip counts are undefined behaviour); give every core the same trip count "
            "(iterate the larger count with no-op iterations, or share one count and split the work inside each "
            "iteration)", URL_LNC)

    # race detection ------------------------------------------------------------------------------------------
    def record(self, storage, kind: str, start: int, pattern, outer) -> None:
        """Log an access to a shared HBM storage: flat elements start + sum i_k*step_k (outer replaces term 0)."""
        if self.lnc == 1 or not getattr(storage, "shared", False):
            return
        lo = hi = start
        for k, (s, n) in enumerate(pattern):
            if k == 0 and outer is not None:
                continue
            lo, hi = lo + min(0, s * (n - 1)), hi + max(0, s * (n - 1))
        if outer is not None:
            lo, hi = lo + int(outer.min()), hi + int(outer.max())
        entry = self.log.setdefault(id(storage), (storage, []))
        entry[1].append((self.core, kind, lo, hi, start, tuple(pattern), outer, self.current))

    def check_races(self, where: str) -> None:
        """Raise `lnc-race` if, since the last barrier, one core wrote an element another core read or wrote."""
        for storage, recs in self.log.values():
            if not any(r[1] == "w" for r in recs):
                continue
            numel = storage.data.numel()
            writes = [torch.zeros(numel, dtype=torch.bool) for _ in range(self.lnc)]
            touched = [torch.zeros(numel, dtype=torch.bool) for _ in range(self.lnc)]
            for r in recs:
                elems = _elements(r)
                touched[r[0]][elems] = True
                if r[1] == "w":
                    writes[r[0]][elems] = True
            for a in range(self.lnc):
                for b in range(self.lnc):
                    clash = writes[a] & touched[b] if a != b else None
                    if clash is not None and bool(clash.any()):
                        self._report(storage, recs, a, b, int(clash.nonzero()[0]), where)
        self.log.clear()
        self.epoch += 1
        if self.pending is not None:
            raise self.pending

    def _report(self, storage, recs, a: int, b: int, elem: int, where: str):
        def first(core, kinds):
            for r in recs:
                if r[0] == core and r[1] in kinds and r[2] <= elem <= r[3] and bool((_elements(r) == elem).any()):
                    return r
            return None

        w, other = first(a, "w"), first(b, "w") or first(b, "r")
        verb = "writes" if other[1] == "w" else "reads"
        exc = _violation(
            "lnc-race",
            f"between two core barriers ({where}) {w[7]} writes element {elem} of shared HBM tensor "
            f"{storage.name or '?'} that {other[7]} {verb}; the cores run concurrently, so split the work so each "
            "core touches disjoint elements, or order them with nisa.core_barrier", URL_BARRIER)
        if _race_findings is None:
            raise exc
        if not any(f"element {elem} of" in f for f in _race_findings):  # each clash is found from both cores
            _race_findings.append(str(exc).split(" (see ")[0])


_race_findings: list | None = None  # races_reported's list while it is active


@contextlib.contextmanager
def races_reported(found: list):
    """Record `lnc-race` findings in `found` instead of stopping the kernel, so its outputs can still be compared.

    The emulator runs core 0 up to each barrier before core 1, so an unordered write pair resolves in program
    order; the race is reported in the table as a finding against the kernel, with the pair of instructions."""
    global _race_findings
    saved, _race_findings = _race_findings, found
    try:
        yield
    finally:
        _race_findings = saved


def _detach_closure(run) -> None:
    """Swap the views a recorded instruction captured for claim-free copies (see tensors._Claim)."""
    for cell in run.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if hasattr(value, "detached"):
            cell.cell_contents = value.detached()
        elif isinstance(value, (list, tuple)):
            cell.cell_contents = type(value)(_detach_item(v) for v in value)


def _detach_item(v):
    if hasattr(v, "detached"):
        return v.detached()
    if isinstance(v, tuple):
        items = tuple(_detach_item(x) for x in v)
        return type(v)(*items) if hasattr(v, "_fields") else items  # keeps work descriptors (NamedTuples)
    return v


def _elements(rec) -> torch.Tensor:
    _, _, _, _, start, pattern, outer, _ = rec
    flat = torch.tensor([start], dtype=torch.int64)
    for k, (s, n) in enumerate(pattern):
        term = outer if (k == 0 and outer is not None) else torch.arange(n, dtype=torch.int64) * s
        flat = (flat.unsqueeze(-1) + term.reshape(1, -1)).reshape(-1)
    return flat


_launch: Launch | None = None


def current() -> Launch | None:
    return _launch


def require(what: str, url: str) -> Launch:
    if _launch is None:
        raise RuntimeError(f"{what} is only valid inside an @nki.jit kernel ({url})")
    return _launch


def call_site() -> str:
    """file:line of the kernel source line that issued the current instruction (first frame outside the emulator)."""
    frame = sys._getframe(1)
    while frame is not None and "nki_emulator" in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"


def emit(engine: str, op: str, run, work=None) -> None:
    """Issue an instruction of `engine` (run immediately, or record into the dynamic loop being traced); `work`:
    its work descriptor for the time model (nki_emulator.timing)."""
    launch = require(f"nisa.{op}", URL_PROGRAM_ID)
    launch.emit(engine, op, run, call_site(), work)


# -- running the cores -------------------------------------------------------------------------------------------------
def run_launch(lnc: int, body, budget):
    """Run `body()` once per core (program_id 0..lnc-1) with barrier hand-offs; return each core's result.
    `budget()` makes one core's on-chip memory budget (`memory.Budget`)."""
    global _launch
    launch, saved = Launch(lnc, budget), _launch
    _launch = launch
    try:
        if lnc == 1:
            results = [body()]
        else:
            results = _run_cores(launch, body)
        launch.check_control("after the last barrier")
        launch.check_races("after the last barrier")
        for engine in set().union(*launch.static):
            bump(launch.stats.static, engine, max(s.get(engine, 0) for s in launch.static))
        launch.stats.launches = 1
        launch.stats.sbuf_peak = max(b.peak["sbuf"] for b in launch.budgets)
        launch.stats.psum_peak = max(b.peak["psum"] for b in launch.budgets)
        outs = results[0] if isinstance(results[0], tuple) else (results[0],)
        position = {id(getattr(o, "_storage", None)): i for i, o in enumerate(outs)}
        launch.stats.hbm_allocations = [HbmAllocation(s.name, tuple(s.data.shape), s.data.dtype, s.buffer.name,
                                                      position.get(id(s))) for s in launch.hbm]
        for c in active_counters:
            merge(c, launch.stats)
        return results
    finally:
        _launch = saved


def _run_cores(launch: Launch, body):
    go = [threading.Semaphore(0) for _ in range(launch.lnc)]
    yielded = threading.Semaphore(0)
    state = ["running"] * launch.lnc
    results: list = [None] * launch.lnc
    errors: list = [None] * launch.lnc

    def core_main(k):
        go[k].acquire()
        try:
            if launch.abort:
                return
            results[k] = body()
            state[k] = "done"
        except _Abort:
            state[k] = "aborted"
        except BaseException as exc:  # noqa: BLE001 - re-raised in the launching thread
            errors[k], state[k] = exc, "error"
        finally:
            yielded.release()

    launch.wait_barrier = lambda k: (state.__setitem__(k, "barrier"), yielded.release(), go[k].acquire(),
                                     _raise_if(launch.abort))
    threads = [threading.Thread(target=core_main, args=(k,), daemon=True) for k in range(launch.lnc)]
    for t in threads:
        t.start()
    torch_threads = torch.get_num_threads()
    try:
        while True:
            for k in range(launch.lnc):
                if state[k] in ("running", "barrier"):
                    state[k] = "running"
                    launch.core = k
                    go[k].release()
                    yielded.acquire()
                    if errors[k] is not None:
                        # garbage from a deferred unwritten read can fail anything after it: report the cause
                        raise launch.pending or errors[k]
            if all(s == "done" for s in state):
                return results
            if all(s == "barrier" for s in state):
                launch.check_control(f"epoch {launch.epoch}")
                launch.check_races(f"epoch {launch.epoch}")
                continue
            counts = {k: s for k, s in enumerate(state)}
            raise _violation("lnc-barrier", f"cores disagree on the number of nisa.core_barrier calls (states "
                             f"{counts}): every core must reach every barrier, or the waiting core hangs (a compiled "
                             "loop with a barrier in its body that runs a different number of times per core does "
                             "this too)", URL_BARRIER)
    finally:
        launch.abort = True
        for k in range(launch.lnc):
            if state[k] == "barrier":
                go[k].release()
        for t in threads:
            t.join(timeout=5)
        torch.set_num_threads(torch_threads)


def _raise_if(flag: bool):
    if flag:
        raise _Abort()


# -- program ids -----------------------------------------------------------------------------------------------------
def program_id(axis: int) -> int:
    launch = require("nl.program_id", URL_PROGRAM_ID)
    if axis != 0:
        raise _violation("lnc-grid", f"program_id({axis}): the LNC launch grid kernel[lnc] is 1-D; use axis 0",
                         URL_PROGRAM_ID)
    return launch.core


def num_programs(axes: int = 0) -> int:
    """`nl.num_programs(axes=0)` (the API page's parameter name; nki-library passes it by keyword)."""
    launch = require("nl.num_programs", URL_PROGRAM_ID)
    axis = axes
    if axis != 0:
        raise _violation("lnc-grid", f"num_programs({axis}): the LNC launch grid kernel[lnc] is 1-D; use axis 0",
                         URL_PROGRAM_ID)
    return launch.lnc


# -- compiled loops ----------------------------------------------------------------------------------------------------

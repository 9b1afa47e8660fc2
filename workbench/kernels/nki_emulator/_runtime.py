"""Launch state of the NKI emulator: LNC cores, the core barrier, cross-core races, compiled loops, counters.

One kernel launch (`kernel[lnc](...)`) runs the kernel's Python body once per core. Cores run one at a time in a
fixed order (core 0 up to its next `core_barrier`, then core 1 up to its next one, ...), so a run is deterministic;
between two barriers each core logs every access to shared HBM, and at the barrier (and at the end of the kernel)
any element written by one core and read or written by another is a race (`lnc-race`), and any compiled loop that
ran a different number of times on the two cores is divergent control flow (`lnc-divergent-control`).

Instructions are recorded, not just executed: outside a compiled loop an instruction runs as soon as it is traced;
`nl.fori_loop` / `nl.while_loop` (NKI >= 0.6; `nl.dynamic_range` under the rules of NKI <= 0.6) trace their body
once into a list of instructions that the loop then runs once per runtime iteration, which is how the compiled
loops of the NKI loops deep dive behave
(https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/deep-dives/nki-loops.html).
"""

from __future__ import annotations

import contextlib
import linecache
import math
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from . import version
from ._rules import violation

DOCS = "https://awsdocs-neuron.readthedocs-hosted.com/en"
URL_PROGRAM_ID = f"{DOCS}/v2.33.0/nki/api/generated/nki.language.program_id.html"
URL_BARRIER = f"{DOCS}/v2.33.0/nki/api/generated/nki.isa.core_barrier.html"
URL_DYNAMIC = f"{DOCS}/latest/nki/deep-dives/nki-dynamic-loops.html"
URL_REGISTER = f"{DOCS}/v2.32.0/nki/api/generated/nki.isa.VirtualRegister.html"
URL_LNC = f"{DOCS}/v2.33.1/nki/get-started/about/lnc.html"
URL_FORI = f"{DOCS}/v2.33.0/nki/api/generated/nki.language.fori_loop.html"
URL_WHILE = f"{DOCS}/latest/nki/api/generated/nki.language.while_loop.html"
URL_MIGRATION = f"{DOCS}/v2.33.1/nki/migration/index.html"
INT32 = (-(2**31), 2**31)  # compiled-loop bounds are 32-bit: the compare-and-branch has no 64-bit form
DYNAMIC_RANGE_REMOVED = ("nl.dynamic_range was removed in NKI 0.7.0 (Neuron SDK 2.33; deprecated in 0.6.0): write "
                         "the loop as nl.fori_loop(lower, upper, body_fun, step=1), the body a function of the "
                         "iteration register")
WHILE_LOOP_LIMIT = 2**24  # emulator limit: a while_loop past this many iterations is taken to never end


_violation = violation


# -- counters ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HbmAllocation:
    """One HBM tensor a kernel call allocated (`nl.ndarray` in nl.hbm / nl.shared_hbm). output: its position among
    the kernel's outputs (it outlives the call), or None: scratch, freed when the call ends."""

    name: str
    shape: tuple
    dtype: torch.dtype
    buffer: str
    output: int | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Counters:
    """What the kernels launched inside `with counters() as c:` did (all launches summed).

    static: engine -> instructions in the traced program (one launch: max over its cores);
    executed: engine -> instructions executed by all cores, every dynamic-loop iteration counted;
    dma_sizes: one (bytes, bytes_per_partition, src_name, dst_name) per executed DMA;
    pe_flops: 2*K*M*N per executed nc_matmul plus 2*P*P*F per Tensor Engine transpose (a matmul against identity
    on the PE array; that part alone is pe_transpose_flops);
    loop_trips: "file:line" of a compiled loop -> iterations run (all cores);
    loop_trips_per_core: "file:line" of a compiled loop -> [iterations on core 0, core 1, ...] (entries that differ
    are a loop whose trip counts diverged between the cores: the `lnc-divergent-control` rule stops such a launch);
    sbuf_peak / psum_peak: the most on-chip bytes per partition live at once on any core (max over launches);
    gathered_rows: source tensor name -> rows read by indirect row gathers (`vector_offset` DMAs);
    hbm_allocations: every HBM tensor the launches allocated, in order (`HbmAllocation`; a shared_hbm tensor once,
    an nl.hbm one per core that allocates it);
    padding_rows: source name -> those of them that were entirely zero. "Padding slots computed" is
    padding_rows[x] for the gather that feeds a kernel's compute its input rows x: padding slots read a zero row
    (a real token whose row is exactly zero would count too; the MoE cost report cross-checks the host plan);
    work: (core, engine, op, work descriptor) -> instructions executed; the descriptor (timing.Matmul, Transpose,
    Elementwise, Dma; None where an instruction records none) is what `timing.model` turns into engine time;
    trace: with `counters(trace=True)`, one entry per launch: per core, the executed instructions in program order,
    each `(engine, op, work, site, accesses)`, accesses `(storage key, "r"|"w", row0, row1, col0, col1)` (the box
    it touched: see `Launch.touch`); a compiled loop's branch is `("control", loop, None, site, ())` per
    iteration. What `timing.schedule` replays on per-engine queues; None when not asked for.
    """

    static: dict = field(default_factory=dict)
    executed: dict = field(default_factory=dict)
    dma_count: int = 0
    dma_bytes: int = 0
    dma_sizes: list = field(default_factory=list)
    pe_flops: int = 0
    pe_transpose_flops: int = 0
    loop_trips: dict = field(default_factory=dict)
    loop_trips_per_core: dict = field(default_factory=dict)
    launches: int = 0
    sbuf_peak: int = 0
    psum_peak: int = 0
    gathered_rows: dict = field(default_factory=dict)
    padding_rows: dict = field(default_factory=dict)
    work: dict = field(default_factory=dict)
    hbm_allocations: list = field(default_factory=list)
    trace: list | None = None

    @property
    def static_total(self) -> int:
        return sum(self.static.values())

    @property
    def executed_total(self) -> int:
        return sum(self.executed.values())


_active_counters: list[Counters] = []


@contextlib.contextmanager
def counters(trace: bool = False):
    """Collect `Counters` over every kernel launch inside the block (nesting allowed: all active ones count);
    `trace`: also record each launch's instruction trace (`Counters.trace`, for `timing.schedule`)."""
    c = Counters(trace=[] if trace else None)
    _active_counters.append(c)
    try:
        yield c
    finally:
        _active_counters.remove(c)


def _bump(d: dict, key, n=1):
    d[key] = d.get(key, 0) + n


# -- registers -------------------------------------------------------------------------------------------------------
class VirtualRegister:
    """`nki.isa.VirtualRegister`: a 32-bit engine register whose value exists only when the program runs.

    Under tracing its value is unknown, so Python control flow, arithmetic, `int()` and indexing with it raise
    TypeError (the VirtualRegister doc's tracer note); it can bound `nl.fori_loop`, be the condition of
    `nl.while_loop`, be a `scalar_offset`, and go through `nisa.register_move/load/store`. A bare `while reg:` is
    the loop form NKI 0.7.0 removed (`api-removed`).
    """

    kind = "VirtualRegister"

    def __init__(self, name: str = "reg"):
        self.name = name
        self._value: int | None = None

    @property
    def value(self) -> int | None:
        return self._value

    @value.setter
    def value(self, v) -> None:
        self._value = v
        _touch_register(self, "w")

    def runtime_value(self) -> int:
        _touch_register(self, "r")
        if self.value is None:
            raise _violation("register-uninitialized", f"{self.name} is read before any register_alloc(x)/"
                             "register_move/register_load gave it a value", URL_REGISTER)
        return self.value

    def _no_python(self, *_a, **_k):
        raise TypeError(f"{self.name} is a {self.kind}: its value exists only on device, so it cannot be used in "
                        "Python control flow, arithmetic, int() or indexing; use it as an nl.fori_loop bound or as "
                        f"scalar_offset= (see {URL_REGISTER})")

    def __bool__(self):
        if _kernel_line().startswith("while "):
            _refuse_bare_while(self)
        return self._no_python()

    __int__ = __index__ = __float__ = __add__ = __radd__ = __sub__ = __rsub__ = _no_python
    __mul__ = __rmul__ = __floordiv__ = __mod__ = __lt__ = __le__ = __gt__ = __ge__ = _no_python
    __hash__ = object.__hash__

    def __eq__(self, other):
        return self._no_python() if other is not self else True

    def __repr__(self) -> str:
        return f"{self.kind}({self.name})"


class NkiScalar(VirtualRegister):
    """`nki.isa.NkiScalar` (new in NKI 0.7.0): the iteration value `nl.fori_loop` passes its body when no bound is a
    VirtualRegister (fori_loop API page, v2.33.0). Here it is what a register is (a runtime 32-bit int usable as
    `scalar_offset` and as a loop bound); its traced arithmetic (`i * 4 + 1`, `nisa.scalar_load`) is outside the
    emulated subset."""

    kind = "NkiScalar"

    def _not_emulated(self, *_a, **_k):
        raise NotImplementedError(f"{self.name}: NkiScalar arithmetic is outside the emulated subset; use the "
                                  "iteration value as scalar_offset= or a loop bound, or pass register bounds")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _not_emulated


def _touch_register(reg: VirtualRegister, kind: str) -> None:
    """While tracing, a register read or write is an access like a tile's (register_load -> scalar_offset)."""
    launch = _launch
    if launch is not None and launch.accesses is not None:
        launch.accesses.append((launch.key(reg), kind, 0, 0, 0, 0))


def _kernel_line() -> str:
    """The stripped source line of the kernel frame that is running now (first frame outside the emulator)."""
    frame = sys._getframe(1)
    while frame is not None and "nki_emulator" in frame.f_code.co_filename:
        frame = frame.f_back
    return "" if frame is None else linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()


def _refuse_bare_while(reg: VirtualRegister):
    """`while reg:` (a register-driven loop of the NKI <= 0.6 parser frontend): removed in NKI 0.7.0."""
    if version.at_least("0.7.0"):
        raise _violation("api-removed", f"`while <register>:` at {call_site()} was removed in NKI 0.7.0 (Neuron SDK "
                         "2.33; deprecated in 0.6.0): write it as nl.while_loop(init_register, body_fun), whose "
                         "body returns the next condition register", URL_MIGRATION)
    raise NotImplementedError(f"`while {reg.name}:` at {call_site()}: the NKI <= 0.6 parser frontend's register "
                              "while loop is outside the emulated subset; use nl.while_loop (NKI >= 0.6)")


# -- one launch ------------------------------------------------------------------------------------------------------
class _Abort(BaseException):
    """Unwinds a core's thread when another core failed."""


class Launch:
    """State of one kernel launch over `lnc` cores."""

    def __init__(self, lnc: int, budget):
        self.lnc = lnc
        self.core = 0
        self.budgets = [budget() for _ in range(lnc)]  # budget: _core.Budget, one core's on-chip memory
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
        self.pending = None  # a deferred uninitialized-read of shared HBM (see _core._uninitialized)
        self.taint: list[str] = []  # poison sources the running instruction has read (see _core._poison)
        self.moved: list = []  # (storage, init, selector) a data movement read, resolved only if it moved poison
        self.tracing = any(c.trace is not None for c in _active_counters)
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
        _bump(self.static[self.core], engine)
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
        _bump(self.stats.executed, engine)
        _bump(self.stats.work, (self.core, engine, op, work))
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
    """Swap the views a recorded instruction captured for claim-free copies (see _core._Claim)."""
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
    `budget()` makes one core's on-chip memory budget (`_core.Budget`)."""
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
            _bump(launch.stats.static, engine, max(s.get(engine, 0) for s in launch.static))
        launch.stats.launches = 1
        launch.stats.sbuf_peak = max(b.peak["sbuf"] for b in launch.budgets)
        launch.stats.psum_peak = max(b.peak["psum"] for b in launch.budgets)
        outs = results[0] if isinstance(results[0], tuple) else (results[0],)
        position = {id(getattr(o, "_storage", None)): i for i, o in enumerate(outs)}
        launch.stats.hbm_allocations = [HbmAllocation(s.name, tuple(s.data.shape), s.data.dtype, s.buffer.name,
                                                      position.get(id(s))) for s in launch.hbm]
        for c in _active_counters:
            _merge(c, launch.stats)
        return results
    finally:
        _launch = saved


def _merge(into: Counters, add: Counters) -> None:
    for d_into, d_add in ((into.static, add.static), (into.executed, add.executed), (into.loop_trips, add.loop_trips),
                          (into.gathered_rows, add.gathered_rows), (into.padding_rows, add.padding_rows),
                          (into.work, add.work)):
        for k, v in d_add.items():
            _bump(d_into, k, v)
    for site, trips in add.loop_trips_per_core.items():
        old = into.loop_trips_per_core.get(site, [])
        n = max(len(old), len(trips))
        old, trips = old + [0] * (n - len(old)), list(trips) + [0] * (n - len(trips))
        into.loop_trips_per_core[site] = [a + b for a, b in zip(old, trips, strict=True)]
    into.dma_count += add.dma_count
    into.dma_bytes += add.dma_bytes
    into.dma_sizes.extend(add.dma_sizes)
    into.hbm_allocations.extend(add.hbm_allocations)
    into.pe_flops += add.pe_flops
    into.pe_transpose_flops += add.pe_transpose_flops
    into.launches += add.launches
    into.sbuf_peak = max(into.sbuf_peak, add.sbuf_peak)
    if into.trace is not None and add.trace is not None:
        into.trace.append(add.trace)
    into.psum_peak = max(into.psum_peak, add.psum_peak)


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
def _since(api: str, first: str, url: str) -> None:
    if not version.at_least(first):
        raise _violation("api-version", f"{api} arrived in NKI {first}; the rules of NKI {version.active()} are "
                         "active (version.rules_of / WORKBENCH_NKI_VERSION)", url)


def _bound(v, what: str, api: str, url: str):
    """A compiled-loop bound: a Python int in int32 range, or a register/scalar (32-bit by construction)."""
    if isinstance(v, VirtualRegister):
        return v
    if isinstance(v, bool) or not isinstance(v, int):
        raise _violation("loop-bounds", f"{api} {what} must be a Python int, a VirtualRegister or an NkiScalar, got "
                         f"{type(v).__name__}", url)
    if not INT32[0] <= v < INT32[1]:
        raise _violation("loop-bounds", f"{api} {what} = {v} does not fit 32 bits: the loop compiles into a "
                         "compare-and-branch that has no 64-bit form", url)
    return v


def _step(step, api: str, url: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise _violation("loop-bounds", f"{api} step must be a compile-time positive int, got {step!r}", url)
    return step


def _value(v) -> int:
    return v.runtime_value() if isinstance(v, VirtualRegister) else v


def _trace_body(launch: Launch, body, value):
    """Call `body(value)` once, recording its instructions instead of running them; return (nodes, result)."""
    nodes: list = []
    launch.trace[launch.core].append(nodes)
    try:
        result = body(value)
    finally:
        launch.trace[launch.core].pop()
        launch.budgets[launch.core].close_loops(len(launch.trace[launch.core]))
    return nodes, result


def _emit_loop(launch: Launch, loop: str, site: str, value: VirtualRegister, nodes: list, values) -> None:
    """Record a compiled loop: per runtime iteration (each value `values()` yields) set the iteration register and
    run the traced body; one `control` instruction (the compare-and-branch) per iteration."""

    def run():
        trips = 0
        for v in values():
            value.value = v  # passed by value: the body's writes to it never reach the loop's own counter
            _bump(launch.stats.executed, "control")
            if launch.tracing:
                launch.stats.trace[launch.core].append(("control", loop, None, site, ()))
            for node in nodes:
                launch.execute(node)
            trips += 1
        _bump(launch.stats.loop_trips, site, trips)
        launch.stats.loop_trips_per_core.setdefault(site, [0] * launch.lnc)[launch.core] += trips
        launch.control[launch.core].append((loop, site, trips))

    launch.emit("control", loop, run, site)


def fori_loop(lower, upper, body_fun, step=1) -> None:
    """`nl.fori_loop(lower, upper, body_fun, step=1)` (NKI >= 0.6; URL_FORI): a compiled counted loop.

    `body_fun(i)` is traced once; the loop runs it for i in range(lower, upper, step) at run time. Bounds are
    Python ints (32-bit) or registers/scalars; `step` a compile-time positive int; `i` is a VirtualRegister when a
    bound is one, else an NkiScalar, passed by value. `body_fun` returns None: other loop state goes through
    SBUF/HBM.
    """
    launch = require("nl.fori_loop", URL_FORI)
    _since("nl.fori_loop", "0.6.0", URL_FORI)
    lower, upper = _bound(lower, "lower", "fori_loop", URL_FORI), _bound(upper, "upper", "fori_loop", URL_FORI)
    step = _step(step, "fori_loop", URL_FORI)
    if not callable(body_fun):
        raise TypeError(f"nl.fori_loop body_fun must be a function of the iteration value, got {body_fun!r}")
    site = call_site()
    registers = type(lower) is VirtualRegister or type(upper) is VirtualRegister  # NkiScalar bounds give a scalar
    value = (VirtualRegister if registers else NkiScalar)(f"fori_loop iteration value ({site})")
    nodes, result = _trace_body(launch, body_fun, value)
    if result is not None:
        raise _violation("loop-body", f"fori_loop body at {site} returned {result!r}: body_fun returns None; carry "
                         "loop state through SBUF/HBM (the iteration value is the loop's only state)", URL_FORI)
    _emit_loop(launch, "fori_loop", site, value, nodes, lambda: range(_value(lower), _value(upper), step))


def while_loop(init, body_fun) -> None:
    """`nl.while_loop(init, body_fun)` (NKI >= 0.6; URL_WHILE): a compiled loop that runs while its condition
    register is nonzero, checked before each iteration. `body_fun(r)` is traced once and returns the register that
    holds the next condition; r (the current condition) is passed by value."""
    launch = require("nl.while_loop", URL_WHILE)
    _since("nl.while_loop", "0.6.0", URL_WHILE)
    if not isinstance(init, VirtualRegister):
        raise _violation("loop-bounds", f"while_loop init must be a condition register (VirtualRegister), got "
                         f"{type(init).__name__}", URL_WHILE)
    site = call_site()
    value = VirtualRegister(f"while_loop condition ({site})")
    nodes, nxt = _trace_body(launch, body_fun, value)
    if not isinstance(nxt, VirtualRegister):
        raise _violation("loop-body", f"while_loop body at {site} returned {nxt!r}: it must return the register "
                         "holding the next condition (the loop stops when it is 0)", URL_WHILE)

    def conditions():
        cond, n = init.runtime_value(), 0
        while cond != 0:
            yield cond
            cond, n = nxt.runtime_value(), n + 1
            if n >= WHILE_LOOP_LIMIT:
                raise RuntimeError(f"while_loop at {site} ran {n} iterations without its condition reaching 0 "
                                   "(emulator limit): it likely never terminates")

    _emit_loop(launch, "while_loop", site, value, nodes, conditions)


def dynamic_range(start, stop=None, step=1):
    """`nl.dynamic_range` (NKI <= 0.6; URL_DYNAMIC): removed in NKI 0.7.0, deprecated in 0.6.0 (URL_MIGRATION).

    Under the rules of an older NKI (`version.rules_of`) it is a compiled loop like `fori_loop` whose Python body
    runs once between the generator's yield and its end.
    """
    launch = require("nl.dynamic_range", URL_DYNAMIC)
    site = call_site()
    if version.at_least("0.7.0"):
        raise _violation("api-removed", f"{site}: {DYNAMIC_RANGE_REMOVED}", URL_MIGRATION)
    if version.at_least("0.6.0"):
        warnings.warn(f"nl.dynamic_range at {site} is deprecated in NKI 0.6.0 (use nl.fori_loop)",
                      DeprecationWarning, stacklevel=2)
    if stop is None:
        start, stop = 0, start
    start = _bound(start, "start", "dynamic_range", URL_DYNAMIC)
    stop = _bound(stop, "stop", "dynamic_range", URL_DYNAMIC)
    step = _step(step, "dynamic_range", URL_DYNAMIC)
    return _dynamic_loop(launch, start, stop, step, site)


def _dynamic_loop(launch: Launch, start, stop, step, site):
    reg = VirtualRegister(f"dynamic_range loop variable ({site})")
    nodes: list = []
    launch.trace[launch.core].append(nodes)
    yield reg  # the Python body runs once here, recording its instructions into `nodes`
    launch.trace[launch.core].pop()
    launch.budgets[launch.core].close_loops(len(launch.trace[launch.core]))
    _emit_loop(launch, "dynamic_range", site, reg, nodes, lambda: range(_value(start), _value(stop), step))

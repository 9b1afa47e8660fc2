"""Registers and compiled loops of the NKI emulator: `nisa.VirtualRegister` / `NkiScalar`, `nl.fori_loop`,
`nl.while_loop` and (under the rules of NKI <= 0.6) `nl.dynamic_range`.

A compiled loop traces its body once into a list of instructions that the loop then runs once per runtime
iteration, which is how the compiled loops of the NKI loops deep dive behave
(https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/deep-dives/nki-loops.html).
"""

from __future__ import annotations

import linecache
import sys
import warnings

from . import version
from .counters import bump
from .errors import violation
from .launch import DOCS, Launch, call_site, current, require

URL_DYNAMIC = f"{DOCS}/latest/nki/deep-dives/nki-dynamic-loops.html"
URL_REGISTER = f"{DOCS}/v2.32.0/nki/api/generated/nki.isa.VirtualRegister.html"
URL_FORI = f"{DOCS}/v2.33.0/nki/api/generated/nki.language.fori_loop.html"
URL_WHILE = f"{DOCS}/latest/nki/api/generated/nki.language.while_loop.html"
URL_MIGRATION = f"{DOCS}/v2.33.1/nki/migration/index.html"
INT32 = (-(2**31), 2**31)  # compiled-loop bounds are 32-bit: the compare-and-branch has no 64-bit form
DYNAMIC_RANGE_REMOVED = ("nl.dynamic_range was removed in NKI 0.7.0 (Neuron SDK 2.33; deprecated in 0.6.0): write "
                         "the loop as nl.fori_loop(lower, upper, body_fun, step=1), the body a function of the "
                         "iteration register")
WHILE_LOOP_LIMIT = 2**24  # emulator limit: a while_loop past this many iterations is taken to never end

_violation = violation

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
        _touch_register(self, "o")
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
    """While tracing, a register read or write is an access like a tile's (register_load -> scalar_offset); a read
    is kind "o", a value read as an offset or loop bound (`timing`: a DMA reads it when its descriptors are made)."""
    launch = current()
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
            bump(launch.stats.executed, "control")
            if launch.tracing:
                launch.stats.trace[launch.core].append(("control", loop, None, site, ()))
            for node in nodes:
                launch.execute(node)
            trips += 1
        bump(launch.stats.loop_trips, site, trips)
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

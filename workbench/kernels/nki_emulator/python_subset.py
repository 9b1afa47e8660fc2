"""The NKI Python subset: an AST check of each `@nki.jit` function and of the module-level helpers it calls.

Which Python a kernel may use depends on the NKI version (`version.py`). From NKI 0.7.0 (Neuron SDK 2.33) NKI
specializes kernels by tracing them with Python, and "kernel developers can now use the full Python language during
specialization, including generators and class inheritance" ("Announcing changes to NKI specialization",
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/announcements/neuron2.x/announce-nki-specialization-change.html;
NKI 0.7.0 release notes). So under 0.7.0 rules only the removed loop APIs are refused here; the subset below is
the rule of NKI 0.6.0 and older (`version.rules_of("0.6.0")`), whose specialization ran as compiler lowering passes.

Before 0.7.0, the NKI language guide (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.31.0/nki/get-started/nki-language-guide.html)
documents the Python a kernel may use: functions, assignments (incl. tuple unpacking), arithmetic and comparisons,
`if`/`for`/`while` with specialization-time values, loops over ranges/lists/tuples, lists, dicts, classes,
`assert` and `print`. Anything else is rejected with `[nki-python-subset]` rather than trusted to the tracer:
comprehensions and generator expressions, lambda, try/with/yield/await, global/nonlocal, walrus, match, `for`
targets other than one name (AWS kernels never use `for a, b in ...`) and builtins outside a small documented set
(so no enumerate/zip/sorted/reversed/map/sum).

Loop rules, by NKI version (`version.py`): from NKI 0.7.0 any `nl.dynamic_range` in a kernel or its helpers is
refused here, before tracing, as `api-removed` (removed in 0.7.0, replaced by `nl.fori_loop`; NKI migration guide);
under the rules of an older NKI, `break`/`continue`/`return` inside an `nl.dynamic_range` body are rejected: the
body is one hardware-loop body traced once (nki-dynamic-loops deep dive). `nl.fori_loop` / `nl.while_loop` bodies
are functions, so a `return` there ends the trace of the one body like in any function.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
import types

from . import version
from .errors import violation
from .loops import DYNAMIC_RANGE_REMOVED, URL_MIGRATION

URL_GUIDE = ("https://awsdocs-neuron.readthedocs-hosted.com/en/v2.31.0/nki/get-started/nki-language-guide.html")
URL_DYNAMIC = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/deep-dives/nki-dynamic-loops.html"

ALLOWED_BUILTINS = {"range", "len", "min", "max", "abs", "int", "float", "bool", "isinstance", "print", "tuple",
                    "list", "dict", "str"} | {"divmod"}
# divmod: not in the guide's list, but nki-library's kernels call it from traced code (e.g. core/subkernels/
# norm_tkg_utils.py contiguous_load_transpose, 18 calls in 9 files) and compile on the real NKI, and no page says a
# kernel must not: the guide lists what it documents, it does not forbid the rest of Python's integer builtins.
REJECTED = {
    ast.ListComp: "a list comprehension", ast.SetComp: "a set comprehension", ast.DictComp: "a dict comprehension",
    ast.GeneratorExp: "a generator expression", ast.Lambda: "a lambda", ast.Try: "try/except",
    ast.With: "a with statement", ast.Yield: "yield", ast.YieldFrom: "yield from", ast.Await: "await",
    ast.Global: "global", ast.Nonlocal: "nonlocal", ast.NamedExpr: "an assignment expression (:=)",
    ast.Match: "match", ast.AsyncFor: "async for", ast.AsyncWith: "async with", ast.AsyncFunctionDef: "async def",
}
if hasattr(ast, "TryStar"):
    REJECTED[ast.TryStar] = "try/except*"

_checked: set = set()


def check_kernel(func) -> None:
    """Check `func` and every plain-Python helper it calls by name (transitively), once per code object and
    active NKI version (the loop rules depend on it)."""
    todo = [func]
    while todo:
        fn = todo.pop()
        key = (fn.__code__, version.active())
        if key in _checked:
            continue
        helpers = _check_function(fn)
        _checked.add(key)
        todo.extend(helpers)


def _violation(detail: str, url: str = URL_GUIDE, rule: str = "nki-python-subset"):
    return violation(rule, detail, url)


def _source(fn):
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None, 0
    tree = ast.parse(textwrap.dedent("".join(lines)))
    return tree, first - 1


def _is_dynamic_range(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Attribute) and node.func.attr == "dynamic_range")
        or (isinstance(node.func, ast.Name) and node.func.id == "dynamic_range"))


def _check_function(fn) -> list:
    tree, line0 = _source(fn)
    if tree is None:
        return []
    where = f"{fn.__code__.co_filename.rsplit('/', 1)[-1]}:{{}} in {fn.__qualname__}"
    fdef = tree.body[0]
    helpers = []
    subset = not version.at_least("0.7.0")  # NKI 0.7.0 specializes with full Python (module docstring)
    for node in ast.walk(fdef):
        line = line0 + getattr(node, "lineno", 1)
        if subset and type(node) in REJECTED:
            raise _violation(f"{where.format(line)} uses {REJECTED[type(node)]}, which the NKI language guide does "
                             "not document; write it as a plain for loop over range()/a list")
        if subset and isinstance(node, ast.For) and not isinstance(node.target, ast.Name):
            raise _violation(f"{where.format(line)}: for-loop target {ast.unparse(node.target)!r} is not a single "
                             "name; loop over range(len(...)) and index instead")
        if _is_dynamic_range(node) and version.at_least("0.7.0"):
            raise _violation(f"{where.format(line)}: {DYNAMIC_RANGE_REMOVED}", URL_MIGRATION, "api-removed")
        if isinstance(node, ast.For) and _is_dynamic_range(node.iter):
            for inner in _walk_body(node.body):
                if isinstance(inner, (ast.Break, ast.Continue, ast.Return)):
                    raise _violation(f"{where.format(line0 + inner.lineno)}: {type(inner).__name__.lower()} inside "
                                     "an nl.dynamic_range body: the body is one hardware-loop body traced once",
                                     URL_DYNAMIC)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            target = fn.__globals__.get(name, getattr(builtins, name, None))
            if fn.__closure__ and name in fn.__code__.co_freevars:
                cell = fn.__closure__[fn.__code__.co_freevars.index(name)]
                target = cell.cell_contents
            if subset and target is getattr(builtins, name, object()) and name not in ALLOWED_BUILTINS:
                raise _violation(f"{where.format(line)} calls the builtin {name}(), which the NKI language guide "
                                 f"does not document (allowed: {sorted(ALLOWED_BUILTINS)}); index with range() "
                                 "instead")
            if isinstance(target, types.FunctionType) and not _is_nki(target):
                helpers.append(target)
    return helpers


def _walk_body(stmts, nested: bool = False):
    """Break/continue/return nodes that leave a dynamic loop body (break/continue of nested loops are theirs)."""
    for stmt in stmts:
        if isinstance(stmt, ast.Return) or (not nested and isinstance(stmt, (ast.Break, ast.Continue))):
            yield stmt
        for fld in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, fld, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                yield from _walk_body(inner, nested or isinstance(stmt, (ast.For, ast.While)))


def _is_nki(fn) -> bool:
    mod = getattr(fn, "__module__", "") or ""
    return mod.startswith("workbench.kernels.nki_emulator") or mod == "nki" or mod.startswith("nki.")

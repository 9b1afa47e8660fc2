"""The import-layer contract of `workbench/` (README "How the code is laid out"): every module belongs to one layer,
a module imports only from its own layer or the layers below it, and no modules import each other in a cycle.

Imports are read with `ast` from the source, at every depth: a function-level import is an arrow too (it runs
later, but it is still a dependency a reader has to follow). Nothing is imported, so the test takes well under a
second. `python tests/test_layers.py` prints the graph's depth and cycles.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "workbench"

LAYERS: list[tuple[str, tuple[str, ...]]] = [  # bottom first; a module's layer: its longest matching prefix
    ("core", ("workbench.core",)),  # torch-free leaves: errors, config, flavors, neuron_env, moe_blocks
    ("platform", ("workbench.platform",)),  # device detection, pinning torchtitan, cpu/neuron adjustments, dist
    ("data", ("workbench.data",)),  # tokenizer, corpus, token shards, loader
    ("emulator", ("workbench.kernels.nki_emulator",)),  # the CPU NKI emulator
    ("kernels", ("workbench.kernels",)),  # NKI kernels, torch reference, autograd glue
    ("backends", ("workbench.backends",)),  # one module per training path, MoE experts, attention masks
    ("hf_weights", ("workbench.hf_weights",)),  # Hugging Face safetensors in and out
    ("run", ("workbench.run",)),  # trainer, checkpoint, run folder, profiling
    ("model", ("workbench.model",)),  # the Python API's model half: build_model, load_model, export_hf
    ("memory", ("workbench.memory",)),  # the memory plan: tracer, report, gate, in-run measurement
    ("commands", ("workbench", "workbench.train", "workbench.plan", "workbench.doctor", "workbench.bench",
                  "workbench.compare", "workbench.hf_export", "workbench.parity", "workbench.setup_neuron")),
    ("notebook", ("workbench.notebook",)),  # what the notebooks call (imports ipywidgets/papermill)
]
ONLY = {  # layers that may import from fewer layers than all those below them
    "kernels": {"core", "emulator", "kernels"},  # nothing of the application: the LNC reader is core.neuron_env
    "emulator": {"core", "emulator"},
}


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `package` (a package is its __init__)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> dict[str, int]:
    """The workbench modules `name` imports (at any depth of its source) -> the line of the first such import."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    out: dict[str, int] = {}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [resolve(a.name) for a in node.names if a.name.split(".")[0] == "workbench"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "workbench":
                continue
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else resolve(base) for a in node.names]
        for t in targets:
            if t and t != name:
                out.setdefault(t, node.lineno)
    return out


def graph(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    known = modules(package)
    return {name: imports(name, path, known) for name, path in known.items()}


def layer_of(name: str) -> str:
    best, layer = -1, ""
    for label, prefixes in LAYERS:
        for p in prefixes:
            if (name == p or (name.startswith(p + ".") and p != "workbench")) and len(p) > best:
                best, layer = len(p), label
    return layer


def cycles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in g:
        if v not in index:
            visit(v)
    return found


def depth(g: dict[str, dict[str, int]]) -> tuple[int, list[str]]:
    """The longest import chain (modules; a graph without cycles) and one chain of that length."""
    memo: dict[str, list[str]] = {}

    def chain(v: str) -> list[str]:
        if v not in memo:
            memo[v] = []  # a cycle stops here
            memo[v] = [v, *max((chain(w) for w in g[v]), key=len, default=[])]
        return memo[v]

    longest = max((chain(v) for v in g), key=len)
    return len(longest), longest


def violations(g: dict[str, dict[str, int]]) -> list[str]:
    order = [label for label, _ in LAYERS]
    problems = []
    for name, targets in sorted(g.items()):
        mine = layer_of(name)
        if not mine:
            problems.append(f"{name}: in no layer (add it to LAYERS in tests/test_layers.py)")
            continue
        allowed = ONLY.get(mine, set(order[: order.index(mine) + 1]))
        for target, line in sorted(targets.items()):
            theirs = layer_of(target)
            if theirs not in allowed:
                problems.append(f"{name} ({mine}) imports {target} ({theirs}) at line {line}: "
                                f"{'an upward import' if order.index(theirs) > order.index(mine) else 'not allowed'}")
    return problems


def test_every_import_points_down_the_layers():
    problems = violations(graph())
    assert not problems, "imports against the layer order (README 'How the code is laid out'):\n" + "\n".join(problems)


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_core_imports_no_torch():
    """core/ holds the torch-free leaves: `load_config` and the error report work before torch is imported."""
    heavy = []
    for name, path in modules().items():
        if layer_of(name) != "core":
            continue
        for node in ast.parse(path.read_text()).body:  # module level: what importing it costs
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            heavy += [f"{name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in ("torch", "torchtitan")]
    assert not heavy, "\n".join(heavy)


def test_the_contract_catches_an_upward_import(tmp_path):
    """The check itself: a planted upward import and a planted cycle are found."""
    for rel, text in {"core/__init__.py": "", "core/leaf.py": "from workbench.run import trainer\n",
                      "run/__init__.py": "", "run/trainer.py": "from workbench.core import leaf\n"}.items():
        (tmp_path / "workbench" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "workbench" / rel).write_text(text)
    g = graph(tmp_path / "workbench")
    assert any("workbench.core.leaf (core) imports workbench.run.trainer (run)" in p for p in violations(g))
    assert cycles(g) == [["workbench.core.leaf", "workbench.run.trainer"]]


if __name__ == "__main__":
    g = graph()
    n, chain = depth(g)
    found = cycles(g)
    print(f"{len(g)} modules, {sum(map(len, g.values()))} import edges, {len(LAYERS)} layers")
    print(f"depth (longest import chain): {n} modules: {' -> '.join(chain)}")
    print(f"cycles: {len(found)}", *(" <-> ".join(c) for c in found), sep="\n  ")
    print(f"layer violations: {len(violations(g))}", *violations(g), sep="\n  ")

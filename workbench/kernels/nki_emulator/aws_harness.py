"""The harness that runs AWS's nki-library kernels on the emulator (`conformance`): `nki` redirected to the emulator,
AWS's test helpers loaded from the checkout, the comparison nki-library's tests use, and the case registry."""

from __future__ import annotations

import ast
import contextlib
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from workbench.kernels import nki_emulator
from workbench.kernels.nki_emulator import collectives, constants

LIBRARY_NKI_VERSION = "0.3.0"  # nki-library tag 2.29 = Neuron SDK 2.29 = NKI 0.3.0
SRC = "src/nkilib_src/nkilib"


# -- redirecting `nki` to the emulator -------------------------------------------------------------------------------
@contextlib.contextmanager
def redirected(library: Path):
    """Import `nki.*` as the emulator and `nkilib_src.*` from `library` inside the block; restore afterwards."""
    aliases = {
        "nki": nki_emulator,
        "nki.language": nki_emulator.language,
        "nki.isa": nki_emulator.isa,
        "nki.isa.constants": constants,
        "nki.collectives": collectives,
    }
    saved = {name: sys.modules.get(name) for name in aliases}
    sys.modules.update(aliases)
    sys.path.insert(0, str(library / "src"))
    try:
        yield
    finally:
        sys.path.remove(str(library / "src"))
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        for name in [n for n in sys.modules if n == "nkilib_src" or n.startswith(("nkilib_src.", "test."))]:
            del sys.modules[name]


def aws_functions(path: Path, names: list[str], namespace: dict) -> dict:
    """Define the named top-level functions/classes of `path` (an nki-library test file) in `namespace`.

    Only those definitions run: the file's imports (AWS-internal packages such as neuron_dtypes) are skipped, so
    `namespace` supplies what the definitions use."""
    tree = ast.parse(path.read_text())
    wanted = [node for node in tree.body
              if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names]
    missing = set(names) - {node.name for node in wanted}
    if missing:
        raise LookupError(f"{path} no longer defines {sorted(missing)}: the conformance case needs updating")
    code = compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec")
    exec(code, namespace)  # noqa: S102 - AWS's test helper definitions, from the checkout the user supplied
    return namespace


def expit(x):
    """Logistic sigmoid for AWS's numpy goldens (they import scipy.special.expit)."""
    return 1.0 / (1.0 + np.exp(-x))


# -- comparing ----------------------------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    ran: bool = False
    max_abs: float = math.nan
    rel: float = math.nan
    tol: str = ""
    match: bool = False
    gap: str = ""
    races: list = field(default_factory=list)


def compare(outputs: dict, reference: dict, rtol: float, atol: float, result: Result) -> None:
    """nki-library's maxAllClose (mode "max"): every |out - ref| <= atol + rtol * max|ref|, per output."""
    worst_abs, worst_rel, ok = 0.0, 0.0, True
    for key, ref in reference.items():
        out = outputs[key]
        out = out.float().numpy() if isinstance(out, torch.Tensor) else np.asarray(out, dtype=np.float64)
        ref = ref.float().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref, dtype=np.float64)
        if out.shape != ref.shape:
            out = out.reshape(ref.shape) if out.size == ref.size else out
        if out.shape != ref.shape:
            result.gap = f"output {key}: shape {out.shape} != reference {ref.shape}"
            ok = False
            continue
        diff = np.abs(out.astype(np.float64) - ref.astype(np.float64))
        scale = float(np.max(np.abs(ref))) if ref.size else 0.0
        worst_abs = max(worst_abs, float(diff.max()))
        worst_rel = max(worst_rel, float(diff.max()) / scale if scale else float(diff.max()))
        ok &= bool(np.all(diff <= atol + rtol * scale)) and bool(np.isfinite(out).all() == np.isfinite(ref).all())
    result.max_abs, result.rel, result.match = worst_abs, worst_rel, ok
    result.tol = f"rtol {rtol:g}, atol {atol:g}"


def bf16(a) -> torch.Tensor:
    """A float array as a bfloat16 torch tensor (numpy has no bfloat16; AWS's tests use ml_dtypes' bf16)."""
    return torch.as_tensor(np.asarray(a, dtype=np.float32)).to(torch.bfloat16)


def as_reference_input(v):
    """What nki-library's torch_ref_wrapper hands the reference: bf16/fp16 -> fp32 torch tensors."""
    if isinstance(v, torch.Tensor):
        return v.float() if v.dtype in (torch.bfloat16, torch.float16) else v
    if isinstance(v, np.ndarray):
        return torch.from_numpy(v)
    return v


def launch(kernel, lnc: int, kwargs: dict):
    """Call an emulated kernel with keyword arguments (AWS's tests do), as positional HBM tensors."""
    bound = inspect.signature(kernel.func).bind(**kwargs)
    from workbench.core.neuron_env import compiled_for_lnc

    with compiled_for_lnc(lnc):  # compiled for the LNC it launches on, as AWS's tests compile it (NKI 0.7.0 checks)
        return kernel[lnc](*bound.args, **bound.kwargs)


# -- the cases ------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    kernel: str  # the @nki.jit function it runs (left out of the static scan)
    run: Callable  # (library: Path) -> (outputs: dict, reference: dict, rtol, atol)


CASES: list[Case] = []


def case(name: str, kernel: str | None = None):
    def register(fn):
        CASES.append(Case(name, kernel or name.rsplit("/", 1)[-1], fn))
        return fn

    return register


def run_pair(kernel, reference, inputs: dict, lnc: int, bf16_keys=(), preserve_lower_precision=False):
    """Run AWS's kernel and torch reference on one set of numpy inputs built by the test recipe.

    `bf16_keys` are float inputs the test builds in bfloat16 (numpy here has none: they are rounded to bf16 torch
    tensors); other arrays become torch tensors of their dtype. Each side gets the arguments its signature names
    (tests pass outputs-as-inputs as `name.must_alias_input`). Kernel outputs are matched to the reference's keys
    in order. `preserve_lower_precision` hands the reference bf16 tensors as they are (AWS's
    torch_ref_wrapper(..., preserve_lower_precision=True)), else as fp32."""
    def tensor(key, v):
        if not isinstance(v, np.ndarray):
            return v
        return bf16(v) if key in bf16_keys else torch.from_numpy(np.ascontiguousarray(v))

    args = {k.split(".")[0]: tensor(k.split(".")[0], v) for k, v in inputs.items()}
    if not isinstance(kernel, nki_emulator.Kernel):  # a subkernel the test launches as a kernel
        kernel = nki_emulator.jit(kernel)
    own = inspect.signature(kernel.func).parameters
    out = launch(kernel, lnc, {k: v for k, v in args.items() if k in own})
    ref_params = inspect.signature(reference).parameters
    convert = (lambda v: v) if preserve_lower_precision else as_reference_input
    ref = reference(**{k: convert(v) for k, v in args.items() if k in ref_params})
    ref = ref if isinstance(ref, dict) else {"out": ref}
    outs = out if isinstance(out, tuple) else (out,)
    return dict(zip(ref, outs, strict=False)), ref

"""Run AWS's nki-library kernels, unmodified, on the emulator and compare them with their torch references.

    python -m workbench.kernels.nki_emulator.conformance --nki-library DIR [--nki-version 0.3.0] [--only NAME]

DIR is a checkout of https://github.com/aws-neuron/nki-library that the user supplies (nothing of it is shipped
here). `nki`, `nki.language`, `nki.isa` and `nki.isa.constants` are redirected to the emulator while the kernels
import and run; AWS's files are read from DIR as they are. Inputs are built by nki-library's own test helpers
(their functions are loaded from DIR/test at run time with numpy as the only dependency) or, where a test helper
needs AWS-internal packages, by the same recipe written here; outputs are compared the way nki-library's tests
compare (`maxAllClose`, mode "max": |out - ref| <= atol + rtol * max|ref|) at the tolerances those tests use.

Each kernel runs under the NKI version it was written for: nki-library of April 2026 (tag 2.29) targets NKI 0.3.0
(Neuron SDK 2.29; "NKI Migration Guides", version table), so the default is `--nki-version 0.3.0`.

Prints one row per kernel: name, ran?, max abs error / max |ref| (rel), tolerance, match?, first gap (the first
missing name or rule the emulator raised).
"""

from __future__ import annotations

import argparse
import ast
import enum
import math
import sys
import textwrap
import traceback
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from workbench.kernels import nki_emulator
from workbench.kernels.nki_emulator import collectives, conformance_tiling, version  # noqa: F401 - its cases register
from workbench.kernels.nki_emulator.aws_harness import (
    CASES,
    LIBRARY_NKI_VERSION,
    SRC,
    Case,
    Result,
    as_reference_input,
    aws_functions,
    bf16,
    case,
    compare,
    expit,
    launch,
    redirected,
    run_pair,
)


# -- the cases ------------------------------------------------------------------------------------------------------
def _moe_cte(lib: Path, func: str):
    """nki-library test_moe_cte.py rows, scaled down to H 1024, T 256, E 4, K 4; LNC 2, rtol 2e-2 atol 1e-5:
    SHARD_ON_BLOCK (H 3072, T 1024, E 8, B 256, I 384, bf16, skip_token, bias, Swish, POST_SCALE, clamps
    7/None/8/-9) at B 256, I 384; SHARD_ON_INTERMEDIATE (H 3072, T 1024, E 8, B 512, I 2048, no skip, bias, Swish,
    POST_SCALE) at B 256, I 512."""
    from nkilib_src.nkilib.core.moe.moe_cte import bwmm_shard_on_I
    from nkilib_src.nkilib.core.moe.moe_cte.bwmm_shard_on_block import bwmm_shard_on_block
    from nkilib_src.nkilib.core.moe.moe_cte.moe_cte_torch import moe_cte_torch_ref
    from nkilib_src.nkilib.core.moe.moe_cte.moe_cte_utils import SkipMode
    from nkilib_src.nkilib.core.utils.common_types import ActFnType, ExpertAffinityScaleMode

    test_file = lib / "test/integration/nkilib/core/moe/moe_cte/test_moe_cte_common.py"
    ns = aws_functions(test_file, ["BWMMFunc", "get_n_blocks", "get_router_with_controlled_distribution",
                                   "generate_token_position_to_id_and_experts", "build_bwmm_inputs",
                                   "map_skip_mode"],
                       {"np": np, "math": math, "Enum": enum.Enum, "SkipMode": SkipMode, "nl": nki_emulator.language,
                        "Tuple": tuple, "Callable": Callable, "ExpertAffinityScaleMode": ExpertAffinityScaleMode,
                        "ActFnType": ActFnType, "bwmm_shard_on_block": bwmm_shard_on_block,
                        **{k: getattr(bwmm_shard_on_I, k) for k in ("blockwise_mm_baseline_shard_intermediate",
                                                                    "blockwise_mm_baseline_shard_intermediate_hybrid",
                                                                    "blockwise_mm_shard_intermediate_dropping")}})
    aws_functions(lib / "test/utils/mx_utils.py", ["is_mx_quantize"], ns)
    stub = types.ModuleType("test_moe_cte_common")
    stub.BWMMFunc = ns["BWMMFunc"]  # moe_cte_torch imports BWMMFunc from the test module at call time
    for name in ("test", "test.integration", "test.integration.nkilib", "test.integration.nkilib.core",
                 "test.integration.nkilib.core.moe", "test.integration.nkilib.core.moe.moe_cte"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["test.integration.nkilib.core.moe.moe_cte.test_moe_cte_common"] = stub

    on_block = func == "SHARD_ON_BLOCK"
    bwmm = getattr(ns["BWMMFunc"], func)
    kernel = bwmm_shard_on_block if on_block else bwmm.get_bwmm_func()[0]
    hidden, tokens, expert, block, top_k, inter, lnc = 1024, 256, 4, 256, 4, 384 if on_block else 512, 2
    clamps = dict(gate_clamp_lower_limit=None, gate_clamp_upper_limit=7, up_clamp_lower_limit=-9,
                  up_clamp_upper_limit=8) if on_block else {}
    raw = ns["build_bwmm_inputs"](
        bwmm_func_enum=bwmm, tokens=tokens, hidden=hidden, intermediate=inter, expert=expert, block_size=block,
        top_k=top_k, dtype=np.float32, dma_skip=ns["map_skip_mode"](1 if on_block else 0), bias=True,
        quantize=None, quantize_strategy=0, vnc_degree=lnc, n_block_per_iter=1, is_block_parallel=on_block,
        is_dynamic=False, expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE,
        activation_function=ActFnType.Swish, checkpoint_activation=False, **clamps)
    inputs = {k: (bf16(v) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else
                  torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in raw.items()}
    inputs["compute_dtype"] = nki_emulator.language.bfloat16
    if on_block:
        inputs = {k: v for k, v in inputs.items() if k not in ("checkpoint_activation",
                                                               "expert_affinity_multiply_on_I")}
    out = launch(kernel, lnc, inputs)
    ref = moe_cte_torch_ref(**{k: as_reference_input(v) for k, v in inputs.items()}, bwmm_func=bwmm,
                            lnc_degree=lnc, top_k=top_k)
    outs = out if isinstance(out, tuple) else (out,)
    return dict(zip(ref, outs, strict=False)), ref, 2e-2, 1e-5


case("moe_cte/bwmm_shard_on_block")(lambda lib: _moe_cte(lib, "SHARD_ON_BLOCK"))
case("moe_cte/bwmm_shard_on_I", "blockwise_mm_baseline_shard_intermediate")(
    lambda lib: _moe_cte(lib, "SHARD_ON_INTERMEDIATE"))


def _blockwise_mm_bwd(lib: Path, lnc: int, hidden=1024, tokens=512, expert=2, block=512, top_k=2, inter=384):
    """nki-library test_bwmm_bwd.py row (H 4096, T 4096, E 2, B 512, K 2, I 384, bf16, no skip, SiLU), scaled
    down to H 1024, T 512; rtol 2e-2 atol 1e-5. The reference is the test's own numpy golden.

    AWS's test runs LNC 2, where the emulator finds an unsynchronised overlap: each core zeroes a contiguous half
    of expert_affinities_masked_grad ((T+1)*E, token-major) at the start, and the other core later scatters
    affinity gradients into that half with no core_barrier in between (core_barrier: cores "write to disjoint
    portions ... then signal"). The table reports it; the outputs are compared all the same."""
    import hashlib

    from nkilib_src.nkilib.experimental.moe.bwd import moe_bwd_parameters as params
    from nkilib_src.nkilib.experimental.moe.bwd.blockwise_mm_backward import blockwise_mm_bwd

    ns = {"np": np, "math": math, "torch": torch, "hashlib": hashlib, "expit": expit}
    ns.update({k: getattr(params, k) for k in ("ActFnType", "AffinityOption", "ClampLimits", "KernelTypeOption",
                                              "ShardOption", "SkipMode")})
    aws_functions(lib / "test/integration/nkilib/utils/test_kernel_common.py",
                  ["silu", "gelu_apprx_sigmoid", "gelu_apprx_sigmoid_dx"], ns)
    aws_functions(lib / "test/integration/nkilib/experimental/moe/test_bwmm_bwd_common.py",
                  ["map_skip_mode", "get_n_blocks", "get_router_with_controlled_distribution",
                   "generate_token_position_to_id_and_experts", "_generate_fwd_golden", "_generate_bwd_golden",
                   "build_bwmm_bwd_inputs", "blockwise_mm_bwd_torch_ref"], ns)
    raw, _, _ = ns["build_bwmm_bwd_inputs"](
        tokens=tokens, hidden=hidden, intermediate=inter, expert=expert, block_size=block, top_k=top_k,
        dtype=np.float32, dma_skip=ns["map_skip_mode"](0), bias_flag=False, clamp_limits=params.ClampLimits(),
        activation_type=params.ActFnType.SiLU)
    inputs = {k: (bf16(v) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else
                  torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in raw.items()}
    inputs["compute_dtype"] = nki_emulator.language.bfloat16
    grads = launch(blockwise_mm_bwd, lnc, inputs)
    names = ("hidden_states_grad", "expert_affinities_masked_grad", "gate_up_proj_weight_grad",
             "down_proj_weight_grad")
    ref = ns["blockwise_mm_bwd_torch_ref"](**{k: as_reference_input(v) for k, v in inputs.items()})
    return dict(zip(names, grads, strict=True)), ref, 2e-2, 1e-5


case("moe_bwd/blockwise_mm_bwd")(lambda lib: _blockwise_mm_bwd(lib, 2))
case("moe_bwd/blockwise_mm_bwd T 8 B 128", "blockwise_mm_bwd")(
    lambda lib: _blockwise_mm_bwd(lib, 2, hidden=256, tokens=8, expert=2, block=128, top_k=2, inter=128))
case("moe_bwd/blockwise_mm_bwd T 8 B 256", "blockwise_mm_bwd")(
    lambda lib: _blockwise_mm_bwd(lib, 2, hidden=256, tokens=8, expert=2, block=256, top_k=2, inter=128))

@case("cumsum")
def _cumsum(lib: Path):
    """test_cumsum.py fast row (128, 2048, 2-d, fp32) at batch 64; atol 1e-3, rtol 1e-3 (fp32), LNC 1."""
    from nkilib_src.nkilib.core.cumsum import cumsum
    from nkilib_src.nkilib.core.cumsum.cumsum_torch import cumsum_torch_ref

    ns = aws_functions(lib / "test/integration/nkilib/core/cumsum/test_cumsum.py", ["_generate_inputs"], {"np": np})
    inputs = ns["_generate_inputs"](batch=64, hidden=2048, ndim=2, seq_len=1, dtype=np.float32)
    return (*run_pair(cumsum, cumsum_torch_ref, inputs, 1), 1e-3, 1e-3)


@case("rope_hf")
def _rope_hf(lib: Path):
    """test_rope_hf.py row (1, 32 q heads, 8 kv heads, 256, 128, bf16) at 8/2 heads; LNC 2, rtol = atol = 1e-6
    against the reference rounded to bf16 (preserve_lower_precision)."""
    from nkilib_src.nkilib.core.embeddings.rope_hf import rope_hf
    from nkilib_src.nkilib.core.embeddings.rope_hf_torch import rope_hf_torch_ref

    ns = aws_functions(lib / "test/integration/nkilib/core/embeddings/test_rope_hf.py", ["_generate_inputs"],
                       {"np": np})
    inputs = ns["_generate_inputs"](batch_size=1, num_q_heads=8, num_kv_heads=2, seq_len=256, head_dim=128,
                                    dtype=np.float32, backward=False, use_packed_format=False)
    keys = ("q", "k", "q_out", "k_out", "cos", "sin")
    return (*run_pair(rope_hf, rope_hf_torch_ref, inputs, 2, bf16_keys=keys, preserve_lower_precision=True), 1e-6,
            1e-6)


@case("cascaded_max")
def _cascaded_max(lib: Path):
    """test_cascaded_max.py row (LNC 2, batch 8, seqlen 5, vocab 4058, fp32): randn with seed 42; rtol = atol =
    1e-5."""
    from nkilib_src.nkilib.core.max.cascaded_max import cascaded_max
    from nkilib_src.nkilib.core.max.cascaded_max_torch import cascaded_max_torch_ref

    np.random.seed(42)
    inputs = {"input_tensor": np.random.randn(8, 5, 4058).astype(np.float32)}
    return (*run_pair(cascaded_max, cascaded_max_torch_ref, inputs, 2), 1e-5, 1e-5)


@case("find_nonzero_indices")
def _find_nonzero_indices(lib: Path):
    """test_find_nonzero_indices.py row (T 4096, E 128, top_k 8, chunk 4096, int32) at E 16; LNC 2, exact."""
    from nkilib_src.nkilib.core.subkernels.find_nonzero_indices import find_nonzero_indices
    from nkilib_src.nkilib.core.subkernels.find_nonzero_indices_torch import find_nonzero_indices_torch_ref

    ns = aws_functions(lib / "test/integration/nkilib/core/subkernels/test_find_nonzero_indices.py",
                       ["generate_sparse_input"], {"np": np})
    inputs = {"input_tensor": ns["generate_sparse_input"](4096, 16, top_k=8, dtype=np.int32), "chunk_size": 4096}
    return (*run_pair(find_nonzero_indices, find_nonzero_indices_torch_ref, inputs, 2), 0.0, 0.0)


@case("indexed_flatten")
def _indexed_flatten(lib: Path):
    """test_indexed_flatten.py fast row (T 4096, E 3, f_len 128); LNC 2, exact."""
    from nkilib_src.nkilib.core.subkernels.indexed_flatten import indexed_flatten
    from nkilib_src.nkilib.core.subkernels.indexed_flatten_torch import indexed_flatten_torch_ref

    ns = aws_functions(lib / "test/integration/nkilib/core/subkernels/test_indexed_flatten.py",
                       ["_generate_input_tensor"], {"np": np})
    t, e, f_len = 4096, 3, 128
    output_len = ((e * t + 1024 + 127) // 128) * 128
    inputs = {"input_tensor": ns["_generate_input_tensor"](t, e), "f_len": f_len, "output_len": output_len,
              "row_offsets": np.array([t // f_len * i for i in range(e)], dtype=np.int32),
              "row_offsets_start": None, "padding_val": -1}
    return (*run_pair(indexed_flatten, indexed_flatten_torch_ref, inputs, 2), 0.0, 0.0)


@case("rope", "RoPE")
def _rope(lib: Path):
    """test_rope.py (d_head 128, B 1, 4 heads, S 256, contiguous layout, lnc_shard): bf16 Gaussian inputs as the
    test's gaussian_tensor_generator draws them; LNC 1 (CompilerArgs()), rtol 2**-7, atol 1e-3."""
    from nkilib_src.nkilib.core.embeddings.rope import RoPE
    from nkilib_src.nkilib.core.embeddings.rope_torch import rope_torch_ref

    rng = np.random.default_rng(0)
    d_head, b, heads, seq = 128, 1, 4, 256
    inputs = {"x_in": rng.normal(size=(d_head, b, heads, seq)), "cos": rng.normal(size=(d_head // 2, b, seq)),
              "sin": rng.normal(size=(d_head // 2, b, seq)), "lnc_shard": True, "contiguous_layout": True,
              "relayout_in_sbuf": False}
    return (*run_pair(RoPE, rope_torch_ref, inputs, 1, bf16_keys=("x_in", "cos", "sin")), 2**-7, 1e-3)


@case("dynamic_elementwise_add")
def _dynamic_elementwise_add(lib: Path):
    """test_dynamic_elementwise_add.py (M 256, H 1024, bf16 Gaussian, tile count in an int32 HBM scalar): an
    nl.dynamic_range kernel, so it runs under NKI 0.3 rules only; LNC 1, rtol 1e-2, atol 1e-3 against the golden
    rounded to bf16."""
    from nkilib_src.nkilib.experimental.dynamic_shapes import dynamic_elementwise_add
    from nkilib_src.nkilib.experimental.dynamic_shapes.dynamic_elementwise_add_torch import (
        dynamic_elementwise_add_torch_ref,
    )

    rng = np.random.default_rng(0)
    inputs = {"input_a": rng.normal(size=(256, 1024)), "input_b": rng.normal(size=(256, 1024)),
              "num_m_tiles": np.array([[256 // 128]], dtype=np.int32)}
    outputs, ref = run_pair(dynamic_elementwise_add, dynamic_elementwise_add_torch_ref, inputs, 1,
                            bf16_keys=("input_a", "input_b"))
    return outputs, {k: v.to(torch.bfloat16).float() for k, v in ref.items()}, 1e-2, 1e-3


def _norm_tkg(lib: Path, which: str):
    """test_{rmsnorm,layernorm}_tkg.py row (LNC 2, batch 2, seqlen 8, hidden 8192, fp16): rtol 2e-2, atol 1e-5."""
    import importlib

    kernel = getattr(importlib.import_module(f"nkilib_src.nkilib.core.subkernels.{which}_tkg"), f"{which}_tkg")
    ref = getattr(importlib.import_module(f"nkilib_src.nkilib.core.subkernels.{which}_torch"), f"{which}_tkg_torch_ref")
    ns = aws_functions(lib / f"test/integration/nkilib/core/subkernels/test_{which}_tkg.py", ["generate_inputs"],
                       {"np": np})
    if which == "rmsnorm":
        inputs = ns["generate_inputs"](2, 8, 8192, None, False, False, np.float16)
    else:
        inputs = ns["generate_inputs"](2, 8, 8192, False, np.float16)
    return (*run_pair(kernel, ref, inputs, 2), 2e-2, 1e-5)


case("rmsnorm_tkg")(lambda lib: _norm_tkg(lib, "rmsnorm"))
case("layernorm_tkg")(lambda lib: _norm_tkg(lib, "layernorm"))


# -- side by side with our kernels (benchmarks/nki_moe_cost.py --compare-nki-library) -----------------------------
def aws_blockwise_forward_counters(library: Path, x, ids, weights, w_gate, w_up, w_down, block: int, lnc: int,
                                   nki_version: str = LIBRARY_NKI_VERSION, blocks: str = "tests",
                                   skip_weights: bool = False):
    """Run nki-library's bwmm_shard_on_block on one routing and return the emulator's Counters.

    Inputs in AWS's layout from our tensors, in the mode nki-library's SHARD_ON_BLOCK tests use (skip_token: padding
    slots hold token -1 and their DMAs are skipped): hidden_states [T, D], affinities [T*E, 1] (token-major, zero
    outside each token's top-k), gate_up [E, D, 2, F], down [E, F, D]; each expert's tokens in order, padded to
    whole blocks; N is the static block count AWS's tests allocate (ceil((T*K - (E-1)) / B) + E - 1, rounded to a
    multiple of the LNC), its padding blocks on the last expert, as nki-library's
    generate_token_position_to_id_and_experts lays them out (`blocks` "needed": the blocks this routing needs,
    rounded to a multiple of the LNC, instead). `skip_weights`: SkipMode(True, True), nki-library's "mode 3" (a block
    whose expert is the previous block's reuses the loaded weights), as its own E = 128 test rows run; else
    SkipMode(True, False). SiLU, POST_SCALE, no bias, bf16. (Without skip_token
    the kernel leaves output row T unzeroed when T + 1 leaves a 1-row tail tile, bwmm_output_initialization's
    `num_elements != 1`, and accumulates padding slots into it: the emulator stops at that uninitialized read.)"""
    from workbench.kernels.nki_emulator import counters

    t, k = ids.shape
    e, f, d = w_gate.shape
    per_expert = [torch.nonzero((ids == j).any(dim=1)).reshape(-1) for j in range(e)]
    blocks_e = [math.ceil(len(tok) / block) for tok in per_expert]
    n = sum(blocks_e) if blocks == "needed" else math.ceil((t * k - (e - 1)) / block) + e - 1
    n = lnc * math.ceil(n / lnc)
    blocks_e[-1] += n - sum(blocks_e)
    positions = torch.full((n * block,), -1, dtype=torch.int32)
    start = 0
    for j in range(e):
        positions[start:start + len(per_expert[j])] = per_expert[j].to(torch.int32)
        start += blocks_e[j] * block
    affinity = torch.zeros(t, e)
    affinity[torch.arange(t)[:, None], ids] = weights.float()
    with redirected(library), version.rules_of(nki_version):
        from nkilib_src.nkilib.core.moe.moe_cte.bwmm_shard_on_block import bwmm_shard_on_block
        from nkilib_src.nkilib.core.moe.moe_cte.moe_cte_utils import SkipMode
        from nkilib_src.nkilib.core.utils.common_types import ActFnType

        inputs = {
            "hidden_states": x.detach().to(torch.bfloat16), "skip_dma": SkipMode(True, skip_weights),
            "expert_affinities_masked": affinity.reshape(-1, 1).to(torch.bfloat16),
            "gate_up_proj_weight": torch.stack([w_gate.transpose(1, 2), w_up.transpose(1, 2)], dim=2)
            .detach().to(torch.bfloat16).contiguous(),
            "down_proj_weight": w_down.transpose(1, 2).detach().to(torch.bfloat16).contiguous(),
            "block_size": block, "token_position_to_id": positions,
            "block_to_expert": torch.repeat_interleave(torch.arange(e, dtype=torch.int32), torch.tensor(blocks_e)),
            "activation_function": ActFnType.SiLU, "compute_dtype": nki_emulator.language.bfloat16,
            "is_tensor_update_accumulating": k > 1,
        }
        with counters() as c, nki_emulator.capacity_lifted():
            launch(bwmm_shard_on_block, lnc, inputs)
    return c, {"blocks": n, "blocks_needed": sum(math.ceil(len(tok) / block) for tok in per_expert)}


# -- the rest: a static scan for the first unemulated name ---------------------------------------------------------
def library_kernels(library: Path) -> list[tuple[str, str]]:
    """(module, function) of every `@nki.jit` function in nki-library's src tree."""
    found = []
    for path in sorted((library / SRC).rglob("*.py")):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        module = ".".join(path.relative_to(library / "src").with_suffix("").parts)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                found.append((module, node.name))
    return found


def static_gap(module_name: str, function: str) -> str:
    """The first nl.* / nisa.* / nki.* name the kernel (or a module-level helper it calls, transitively) uses that
    the emulator lacks or refuses; "" when there is none. Static: branches and arguments are not evaluated."""
    import importlib
    import inspect

    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - an import failure is the gap
        return first_gap(exc)
    start = getattr(module, function)
    todo, seen = [getattr(start, "func", start)], set()
    while todo:
        fn = todo.pop(0)
        if fn.__code__ in seen:
            continue
        seen.add(fn.__code__)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner = fn.__globals__.get(node.value.id)
                if owner is collectives:
                    return f"unemulated nki.collectives.{node.attr} ({fn.__module__.rsplit('.', 1)[-1]}.py)"
                if owner in (nki_emulator, nki_emulator.language, nki_emulator.isa):
                    target = getattr(owner, node.attr, None)
                    name = f"{ {nki_emulator: 'nki', nki_emulator.language: 'nl'}.get(owner, 'nisa')}.{node.attr}"
                    if target is None:
                        return f"missing {name} ({fn.__module__.rsplit('.', 1)[-1]}.py:{fn.__code__.co_firstlineno})"
                    if getattr(target, "unemulated", False):
                        return f"unemulated {name} ({fn.__module__.rsplit('.', 1)[-1]}.py)"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                target = fn.__globals__.get(node.func.id)
                if isinstance(target, types.FunctionType) and (target.__module__ or "").startswith("nkilib_src"):
                    todo.append(target)
                elif isinstance(target, nki_emulator.Kernel):
                    todo.append(target.func)
    return ""


# -- running -------------------------------------------------------------------------------------------------------
def first_gap(exc: BaseException) -> str:
    """One line: the exception and where in AWS's or the emulator's code it was raised."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "nkilib" in f.filename), "?")
    msg = str(exc).split(" (see ")[0].splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {msg[:160]} [{where}]"


def run_case(c: Case, library: Path, nki_version: str, show_traceback: bool = False) -> Result:
    result = Result(c.name)
    races: list[str] = []
    with redirected(library), version.rules_of(nki_version), nki_emulator.races_reported(races):
        try:
            outputs, reference, rtol, atol = c.run(library)
            result.ran = True
            compare(outputs, reference, rtol, atol, result)
            if races:
                result.gap = f"{races[0]} ({len(races)} race(s) reported, run continued)"
                result.races = races
        except Exception as exc:  # noqa: BLE001 - every failure is a row of the table
            result.gap = first_gap(exc)
            if show_traceback:
                traceback.print_exc()
    return result


def table(results: list[Result]) -> str:
    lines = ["| kernel | ran? | max abs err | max err / max abs ref | tolerance | match? | first gap |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {'yes' if r.ran else 'no'} | {r.max_abs:.3g} | {r.rel:.3g} | {r.tol} | "
                     f"{'yes' if r.match else 'no'} | {r.gap} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nki-library", type=Path, required=True, help="a checkout of aws-neuron/nki-library")
    parser.add_argument("--nki-version", default=LIBRARY_NKI_VERSION, help="NKI version whose rules apply")
    parser.add_argument("--only", action="append", help="run only cases whose name contains this (repeatable)")
    parser.add_argument("--traceback", action="store_true", help="print the full traceback of each failure")
    args = parser.parse_args(argv)
    if not (args.nki_library / SRC).is_dir():
        print(f"--nki-library {args.nki_library}: no {SRC} there; pass a checkout of aws-neuron/nki-library",
              file=sys.stderr)
        return 2
    version.parse(args.nki_version)
    cases = [c for c in CASES if not args.only or any(o in c.name for o in args.only)]
    results = []
    for c in cases:
        results.append(run_case(c, args.nki_library, args.nki_version, args.traceback))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    print(f"\nnki-library {args.nki_library}, NKI {args.nki_version} rules\n")
    print(table(results))
    if not args.only:
        print("\nThe other @nki.jit kernels, not run (no input recipe here): first unemulated name they use\n")
        print(scan_table(args.nki_library, args.nki_version))
    return 0


def scan_table(library: Path, nki_version: str) -> str:
    """One row per @nki.jit kernel without a case: its static first gap (see static_gap)."""
    run_names = {c.kernel for c in CASES}
    lines = ["| kernel | module | first gap (static scan) |", "|---|---|---|"]
    with redirected(library), version.rules_of(nki_version):
        for module, function in library_kernels(library):
            if function in run_names:
                continue
            gap = static_gap(module, function) or "none found statically (needs a run to know)"
            lines.append(f"| {function} | {module.removeprefix('nkilib_src.nkilib.')} | {gap} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

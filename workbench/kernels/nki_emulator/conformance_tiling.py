"""Conformance cases of nki-library's kernels that use PE tiling (`nc_matmul(tile_position=, tile_size=)`): the MLP
token-generation kernel (its gate/up and down projections tile the PE columns), `qkv_tkg` and `router_topk`, each at
rows of its own tests, against AWS's references (`conformance`, `aws_harness`)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import torch

from workbench.kernels import nki_emulator
from workbench.kernels.nki_emulator.aws_harness import aws_functions, bf16, case, expit, launch


class _StaticCast:
    """The one function AWS's test helpers take from the AWS-internal `neuron_dtypes`: static_cast to a dtype. Float
    values stay float32 numpy (the harness rounds the bf16 inputs to bf16 torch tensors itself)."""

    @staticmethod
    def static_cast(x, dtype=None):
        x = np.asarray(x)
        return x.astype(np.float32) if x.dtype.kind == "f" else x


def _mlp_entry():
    """What nki-library's `mlp` entry (core/mlp/mlp.py) does for a token-generation row, as an emulated kernel:
    build `MLPParameters`, allocate the output through an `SbufManager` and call AWS's `mlp_tkg` (unmodified).
    mlp.py itself does not parse at commit d2ad3a5: its docstring's last paragraph is repeated after the closing
    quotes (IndentationError at mlp.py:203), so nothing can import `mlp`. Its argument check
    (`validate_mlp_arguments`) is left out: it names dtypes by `str(dtype)` (`kernel_helpers.resolve_dtype_to_nki`:
    "bfloat16"), and the emulator's dtypes are torch's ("torch.bfloat16")."""
    import nki.language as nl
    from nkilib_src.nkilib.core.mlp.mlp_parameters import MLPParameters, is_mlp_tkg
    from nkilib_src.nkilib.core.mlp.mlp_tkg.mlp_tkg import mlp_tkg
    from nkilib_src.nkilib.core.utils.allocator import SbufManager
    from nkilib_src.nkilib.core.utils.logging import Logger

    def mlp_tkg_entry(hidden_tensor, gate_proj_weights_tensor, up_proj_weights_tensor, down_proj_weights_tensor,
                      normalization_weights_tensor, normalization_type, use_tkg_gate_up_proj_column_tiling,
                      use_tkg_down_proj_column_tiling):
        params = MLPParameters(
            hidden_tensor=hidden_tensor, gate_proj_weights_tensor=gate_proj_weights_tensor,
            up_proj_weights_tensor=up_proj_weights_tensor, down_proj_weights_tensor=down_proj_weights_tensor,
            normalization_weights_tensor=normalization_weights_tensor, normalization_type=normalization_type,
            output_dtype=nl.bfloat16, use_tkg_gate_up_proj_column_tiling=use_tkg_gate_up_proj_column_tiling,
            use_tkg_down_proj_column_tiling=use_tkg_down_proj_column_tiling)
        assert is_mlp_tkg(params)
        sbm = SbufManager(0, 200 * 1024, Logger("mlp"))
        sbm.set_name_prefix("mlp_")
        out = sbm.alloc((params.batch_size, params.sequence_len, params.hidden_size), dtype=params.output_dtype,
                        buffer=nl.shared_hbm, name="output_tensor_hbm")
        mlp_tkg(params, out, None, sbm=sbm)
        return out

    return nki_emulator.jit(mlp_tkg_entry)


def _supply_remainder_i_fused():
    """Give `MLPTKGConstantsDimensionSizes` the field its constructor call leaves out (remainderIFused, declared at
    mlp_tkg_constants.py:66 and read nowhere; the call at :225 passes every other field) as 0: the one change to
    AWS's code in the "field supplied" rows, which run the projections past that bug."""
    import dataclasses

    from nkilib_src.nkilib.core.mlp.mlp_tkg import mlp_tkg_constants

    sizes = mlp_tkg_constants.MLPTKGConstantsDimensionSizes
    if "remainderIFused" in {f.name for f in dataclasses.fields(sizes) if f.default is dataclasses.MISSING}:
        init = sizes.__init__
        sizes.__init__ = lambda self, *a, remainderIFused=0, **k: init(self, *a, remainderIFused=remainderIFused, **k)


def _mlp_tkg(lib: Path, lnc: int, batch: int, seqlen: int, hidden: int, inter: int, norm: str, supply=False):
    """test_mlp_tkg.py rows (bf16, SiLU, no bias, no fused add, both projections column-tiled): AWS's numpy golden
    (`golden_mlp`, test_mlp_common.py) on the test's Gaussian recipe (hidden, gate, up, down from one seeded
    generator; RMSNorm's gamma uniform in +-0.1); rtol 2e-2, atol 1e-5."""
    from nkilib_src.nkilib.core.utils.common_types import ActFnType, NormType

    common = lib / "test/integration/nkilib/utils/test_kernel_common.py"
    ns = aws_functions(common, ["rms_norm", "layer_norm", "silu"], {"np": np, "expit": expit})
    ns.update({"dt": _StaticCast, "NormType": NormType, "ActFnType": ActFnType,
               "norm_name2func": {NormType.NO_NORM: lambda *x, **_: x[0], NormType.RMS_NORM: ns["rms_norm"],
                                  NormType.LAYER_NORM: ns["layer_norm"]},
               "act_fn_type2func": {ActFnType.SiLU: ns["silu"]}})
    aws_functions(lib / "test/integration/nkilib/core/mlp/test_mlp_common.py", ["norm_mlp_ref", "golden_mlp"], ns)
    if supply:
        _supply_remainder_i_fused()
    rng = np.random.default_rng(0)
    norm_type = getattr(NormType, norm)
    raw = {"hidden_tensor": rng.normal(size=(batch, seqlen, hidden)),
           "gate_proj_weights_tensor": rng.normal(size=(hidden, inter)),
           "up_proj_weights_tensor": rng.normal(size=(hidden, inter)),
           "down_proj_weights_tensor": rng.normal(size=(inter, hidden)),
           "normalization_weights_tensor": (np.random.default_rng(42).uniform(-0.1, 0.1, size=(1, hidden))
                                            if norm_type != NormType.NO_NORM else None)}
    inputs = {k: None if v is None else bf16(v) for k, v in raw.items()}
    golden = ns["golden_mlp"](inp_np={k: None if v is None else v.float().numpy() for k, v in inputs.items()},
                              norm_type=norm_type, fused_add=False, store_add=False, dtype=np.float32)
    out = launch(_mlp_entry(), lnc, {**inputs, "normalization_type": norm_type,
                                     "use_tkg_gate_up_proj_column_tiling": True,
                                     "use_tkg_down_proj_column_tiling": True})
    return {"out": out}, golden, 2e-2, 1e-5


# Llama3 1B fused speculation (T 1: 4 x 32-column tiles) and GPT-OSS draft (T 64: 2 x 64), LNC 2
case("mlp_tkg T 1 (H 2048, I 512)", "mlp_tkg")(lambda lib: _mlp_tkg(lib, 2, 1, 1, 2048, 512, "RMS_NORM"))
case("mlp_tkg T 64 (H 3072, I 135)", "mlp_tkg")(lambda lib: _mlp_tkg(lib, 2, 64, 1, 3072, 135, "RMS_NORM"))
case("mlp_tkg T 1, field supplied", "mlp_tkg")(lambda lib: _mlp_tkg(lib, 2, 1, 1, 2048, 512, "RMS_NORM", True))
case("mlp_tkg T 64, field supplied", "mlp_tkg")(lambda lib: _mlp_tkg(lib, 2, 64, 1, 3072, 135, "RMS_NORM", True))


def _norm_refs_module():
    """The test module qkv_tkg_torch.py imports its norm references from (test_kernel_common: AWS-internal imports
    at its top), as a module holding nki-library's own torch norm references."""
    from nkilib_src.nkilib.core.subkernels.layernorm_torch import layer_norm_torch_ref
    from nkilib_src.nkilib.core.subkernels.rmsnorm_torch import rms_norm_torch_ref
    from nkilib_src.nkilib.core.utils.common_types import NormType

    module = types.ModuleType("test_kernel_common")
    module.norm_name2func_torch = {NormType.NO_NORM: lambda *x, **_: x[0], NormType.RMS_NORM: rms_norm_torch_ref,
                                   NormType.LAYER_NORM: layer_norm_torch_ref,
                                   NormType.RMS_NORM_SKIP_GAMMA: rms_norm_torch_ref}
    for name in ("test", "test.integration", "test.integration.nkilib", "test.integration.nkilib.utils"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["test.integration.nkilib.utils.test_kernel_common"] = module


def _qkv_tkg(lib: Path, lnc: int, batch: int, seqlen: int, hidden: int, fused: int, q_heads: int, kv_heads: int,
             norm: str):
    """test_qkv_tkg.py rows through nki-library's `qkv` entry (token generation: B x S <= 32, 32-column tiles of the
    PE array): bf16 Gaussian input and weights, RMSNorm gamma uniform in +-0.1, BSD output; AWS's torch reference
    `qkv_tkg_torch_ref`; rtol 2e-2, atol 1e-5."""
    from nkilib_src.nkilib.core.qkv.qkv import qkv
    from nkilib_src.nkilib.core.utils.common_types import NormType, QKVOutputLayout

    _norm_refs_module()
    from nkilib_src.nkilib.core.qkv.qkv_tkg_torch import qkv_tkg_torch_ref

    rng = np.random.default_rng(0)
    norm_type = getattr(NormType, norm)
    inputs = {"input": rng.normal(size=(batch, seqlen, hidden)), "fused_qkv_weights": rng.normal(size=(hidden, fused)),
              "gamma_norm_weights": (np.random.default_rng(42).uniform(-0.1, 0.1, size=(1, hidden))
                                     if norm_type != NormType.NO_NORM else None)}
    tensors = {k: None if v is None else bf16(v) for k, v in inputs.items()}
    out = launch(qkv, lnc, {**tensors, "output_layout": QKVOutputLayout.BSD, "fused_norm_type": norm_type,
                            "d_head": 128, "num_q_heads": q_heads, "num_kv_heads": kv_heads})
    ref = qkv_tkg_torch_ref(hidden=tensors["input"].float(), qkv_w=tensors["fused_qkv_weights"].float(),
                            norm_w=None if tensors["gamma_norm_weights"] is None else
                            tensors["gamma_norm_weights"].float(), d_head=128, num_kv_heads=kv_heads,
                            num_q_heads=q_heads, output_layout=QKVOutputLayout.BSD, norm_type=norm_type)
    return {"out": out if not isinstance(out, (tuple, list)) else out[0]}, {"out": ref["out"]}, 2e-2, 1e-5


case("qkv_tkg B 4 S 1 (H 4096, I 896)", "qkv")(lambda lib: _qkv_tkg(lib, 1, 4, 1, 4096, 896, 5, 1, "RMS_NORM"))
case("qkv_tkg B 1 S 4 (H 4096, I 512), LNC 2", "qkv")(
    lambda lib: _qkv_tkg(lib, 2, 1, 4, 4096, 512, 2, 1, "NO_NORM"))


def _router_topk(lib: Path, lnc: int, tokens: int, hidden: int, experts: int, k: int, act: str, scatter: bool):
    """test_router_topk.py column-tiling rows through AWS's own test wrapper (`router_topk_kernel_wrapper`) and
    reference (`router_topk_torch_wrapper`), inputs by its recipe (`generate_router_topk_inputs`: uniform in +-0.1,
    bf16), x in HBM as [H, T]; rtol 2e-2, atol 1e-5. router_topk.py imports `neuronxcc.nki.typing` (the
    neuronx-cc compiler, not in the public repo) for one type annotation, `nt.mutable_tensor`; the harness gives
    it that one name."""
    compiler, nki, typing = (types.ModuleType(n) for n in ("neuronxcc", "neuronxcc.nki", "neuronxcc.nki.typing"))
    typing.mutable_tensor = object
    compiler.nki, nki.typing = nki, typing
    sys.modules.update({"neuronxcc": compiler, "neuronxcc.nki": nki, "neuronxcc.nki.typing": typing})
    import nki.isa as nisa
    import nki.language as nl
    from nkilib_src.nkilib.core.router_topk import router_topk as module
    from nkilib_src.nkilib.core.router_topk.router_topk_torch import router_topk_torch_ref
    from nkilib_src.nkilib.core.utils.common_types import RouterActFnType

    test_file = lib / "test/integration/nkilib/core/router_topk/test_router_topk_common.py"
    ns = {"np": np, "torch": torch, "nl": nl, "nisa": nisa, "router_topk": module.router_topk,
          "router_topk_input_x_load": module.router_topk_input_x_load, "XHBMLayout_T_H__1": module.XHBMLayout_T_H__1,
          "router_topk_torch_ref": router_topk_torch_ref}
    aws_functions(test_file, ["router_topk_kernel_wrapper", "router_topk_torch_wrapper"], ns)
    # the input recipe builds numpy arrays of nl dtypes (real NKI's are numpy dtypes; the emulator's are torch's):
    # it gets numpy stand-ins, float32 for bf16 (the harness rounds those inputs to bf16 itself)
    recipe = aws_functions(test_file, ["router_topk_tensor_gen", "generate_router_topk_inputs"],
                           {"np": np, "torch": torch, "dt": _StaticCast,
                            "nl": types.SimpleNamespace(bfloat16=np.float32, float32=np.float32, uint32=np.uint32)})
    inputs = recipe["generate_router_topk_inputs"](
        T=tokens, H=hidden, E=experts, k=k, act_fn=getattr(RouterActFnType, act), has_bias=True,
        router_pre_norm=False, norm_topk_prob=False, use_column_tiling=True, use_indirect_dma_scatter=scatter,
        use_PE_broadcast_w_bias=False, shard_on_tokens=False, output_in_sbuf=False, x_input_in_sb=False,
        x_hbm_layout=module.XHBMLayout_H_T__0, x_sb_layout=module.XSBLayout_tp102__0)
    args = {}
    for key, value in inputs.items():
        name = key.split(".")[0]  # outputs passed in as "name.must_alias_input"
        if isinstance(value, np.ndarray):
            value = bf16(value) if value.dtype.kind == "f" else torch.from_numpy(value.astype(np.int32))
        args[name] = value
    kernel = nki_emulator.jit(ns["router_topk_kernel_wrapper"])
    out = launch(kernel, lnc, args)
    ref = ns["router_topk_torch_wrapper"](**{k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point()
                                             else v for k, v in args.items()})
    names = ("router_logits", "expert_index", "expert_affinities")
    return dict(zip(names, out, strict=True)), {name: ref[name] for name in names}, 2e-2, 1e-5


case("router_topk T 16 (H 3072, E 128, k 4, softmax)", "router_topk")(
    lambda lib: _router_topk(lib, 2, 16, 3072, 128, 4, "SOFTMAX", False))
case("router_topk T 32 (H 256, E 128, k 4, sigmoid, scatter)", "router_topk")(
    lambda lib: _router_topk(lib, 2, 32, 256, 128, 4, "SIGMOID", True))

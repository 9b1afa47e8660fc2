"""Guards on the torchtitan (and private torch) internals the workbench leans on, so an upgrade announces itself.

1. Every official flavor, built from our shape table through torchtitan's layer builders, has exactly the
   state-dict (names and shapes, on the meta device) of torchtitan's own `qwen3_configs` entry.
2. The torchtitan functions we override, wrap, copy or call by a private name, and the private torch classes we
   subclass, still have the source they had in the version we adapted them to (a hash of their installed source,
   read from the file with `ast`, so our own monkeypatches cannot hide a change). A mismatch is not a bug by
   itself: it names what to re-read.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from pathlib import Path

import pytest
import torch

from workbench.core import flavors
from workbench.platform import titan_device

titan_device.pin("cpu")

TORCHTITAN_VERSION = "0.3.0"
TORCH_VERSION = "2.14.0"
OFFICIAL = ["0.6B", "1.7B", "4B", "8B", "14B", "32B", "30B-A3B", "235B-A22B"]


def meta_state_dict_shapes(model_config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = model_config.build()
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("flavor", OFFICIAL)
def test_flavor_state_dict_equals_torchtitans_own(flavor):
    from torchtitan.models.qwen3 import qwen3_configs

    # torchtitan's MoE flavors balance experts with a bias (coefficient 1e-3), whose buffers are in the state dict;
    # the workbench default (0: Hugging Face routing) drops them, so compare at torchtitan's setting.
    ours = meta_state_dict_shapes(flavors.titan_model_config(flavors.get_shape(flavor), moe_load_balance_coeff=1e-3))
    theirs = meta_state_dict_shapes(qwen3_configs[flavor](attn_backend="flex"))
    assert ours.keys() == theirs.keys(), (f"{flavor}: only ours {sorted(ours.keys() - theirs.keys())[:5]}, "
                                          f"only torchtitan's {sorted(theirs.keys() - ours.keys())[:5]}")
    diff = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    assert not diff, f"{flavor}: shapes differ (ours, torchtitan's): {dict(list(diff.items())[:5])}"


# (module, qualified name) -> (sha256[:16] of the installed source, what depends on it / what to re-check).
UPSTREAM: dict[tuple[str, str], tuple[str, str]] = {
    ("torchtitan.trainer", "Trainer._forward_backward_body"): (
        "713182f4f13a628a",
        "copied verbatim (plus record_function labels) into WorkbenchTrainer._forward_backward_body"),
    ("torchtitan.trainer", "Trainer.train_step"): (
        "ab44cd6384aa6071", "wrapped by WorkbenchTrainer.train_step (step counter before the call, profiler window)"),
    ("torchtitan.trainer", "Trainer.train"): (
        "64fec79828ddfaf7", "wrapped by WorkbenchTrainer.train (HF load before, export and summary after); on CPU "
        "its closing time.sleep(2) on rank 0 is a no-op and a barrier follows it "
        "(cpu_adjustments.end_of_training_without_sleep; the only sleep in torchtitan/trainer.py)"),
    ("torchtitan.trainer", "Trainer.__init__"): (
        "2d0b1a810a03eabe",
        "WorkbenchTrainer reads self.metrics_processor, self.model_parts, self.optimizers, self.step after it"),
    ("torchtitan.trainer", "Trainer.state_dict"): (
        "3c94925f8c1fc6cb", "overridden by WorkbenchTrainer.state_dict (the token count over all ranks)"),
    ("torchtitan.trainer", "Trainer.load_state_dict"): (
        "41a45bdeb51c2a16", "overridden by WorkbenchTrainer.load_state_dict (the total count split over the ranks)"),
    ("torchtitan.components.metrics", "MetricsProcessor.log"): (
        "fe2e88a0f9ff3817", "overridden by WorkbenchMetrics.log (same arguments; metrics.jsonl and the progress line)"),
    ("torchtitan.components.metrics", "MetricsProcessor.__init__"): (
        "a1c29626cd6a3b01", "WorkbenchMetrics relies on time_last_log / num_flops_per_token set here"),
    ("torchtitan.models.common.moe", "GroupedExperts.forward"): (
        "e48dfd8129d95c13", "replaced by cpu_adjustments._grouped_experts_in_activation_dtype (no bf16 cast on CPU)"),
    ("torchtitan.distributed.fsdp", "disable_fsdp_gradient_division"): (
        "74f226fab0a93a86", "wrapped by cpu_adjustments._force_sum_fsdp_reduction (gloo has no PreMulSum)"),
    ("torchtitan.tools.utils", "get_device_info"): (
        "87aa7a5a0ddc2683",
        "sets the module globals device_type/device_module that cpu_adjustments._pin_device_to_cpu rebinds"),
    ("torchtitan.models.qwen3", "_build_qwen3_layers"): (
        "abb595f921c9cc1f", "private builder called by flavors.titan_model_config (dense)"),
    ("torchtitan.models.qwen3", "_build_qwen3_moe_layers"): (
        "99338c24f9dc1947", "private builder called by flavors.titan_model_config (MoE)"),
    ("torchtitan.models.qwen3", "_qwen3_norm"): (
        "ee1c24f12a9940ce", "private helper called by flavors.titan_model_config"),
    # workbench/backends/attention.py and WorkbenchTrainer.post_dataloading_process: packed documents' masks
    ("torchtitan.trainer", "Trainer.post_dataloading_process"): (
        "7f74090f0ca04a79", "wrapped: builds flex/varlen masks only from positions, so WorkbenchTrainer hands it the "
        "batch without them and adds positions and the fixed-capacity masks after (and takes the mixture member off "
        "first)"),
    ("torchtitan.models.common.attention", "ScaledDotProductAttention.forward"): (
        "0cdfd7cf379d5551", "BlockCausalSDPA calls it without a mask, mirrors it (transposes, sdpa_kernel) with one"),
    ("torchtitan.models.common.attention", "VarlenMetadata"): (
        "8055791428996524", "built by attention.varlen_metadata (fixed-capacity cu_seqlens, max_q = max_k = S)"),
    ("torchtitan.models.common.attention", "create_attention_mask"): (
        "2ec2eb485f593c89", "called by attention.flex_block_mask off CPU (torchtitan's compiled create_block_mask)"),
    ("transformers.masking_utils", "_preprocess_mask_arguments"): (
        "e63dcd220bb4b1d0", "returns a 4-D attention_mask as given (huggingface_v5's block-causal mask); without one "
        "it infers packing from position_ids, which the workbench never relies on"),
    # workbench/run/checkpoint.py: WorkbenchCheckpointManager overrides these and calls each through super()
    ("torchtitan.components.checkpointer.dcp", "CheckpointManager._find_load_step"): (
        "58210d23f832ed61", "overridden: resume from the newest *verified* step (fallback on a corrupt one)"),
    ("torchtitan.components.checkpointer.dcp", "CheckpointManager._save"): (
        "15f1039cac3f08b9",
        "wrapped: a stale step folder removed first, a failed save removed and named, a purge after the last step"),
    ("torchtitan.components.checkpointer.dcp", "CheckpointManager._purge_stale_checkpoints"): (
        "d4b32d53eed3a26f", "replaced: keep_latest_k over verified checkpoints (uses _should_purge, purge_queue)"),
    ("torchtitan.components.checkpointer.dcp", "CheckpointManager.dcp_load"): (
        "cd70ea52b87a2a5b", "wrapped: global shapes checked against the metadata first; its dcp.load replaced by "
        "checkpoint.load_dcp (allowlisted reader and planner); DCP's error cut to one line"),
    # workbench/run/checkpoint.py: what nothing unpickled outside an allowlist replaces or relies on (torch 2.14.0)
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader.read_metadata"): (
        "e7da7abb9870b33d", "overridden by _AllowlistReader.read_metadata (hashed, allowlisted; storage_meta as here)"),
    ("torch.distributed.checkpoint.default_planner", "DefaultLoadPlanner.load_bytes"): (
        "c0b0a182137d4345", "overridden by _AllowlistPlanner.load_bytes (weights_only=True; the value placed as here)"),
    ("torchtitan.components.dataloader", "ParallelAwareDataloader.load_state_dict"): (
        "ba0a9bbb681e1fe4", "unpickles the dataloader bytes itself: _AllowlistPlanner checks them first"),
    ("torchtitan.components.checkpointer.dcp", "CheckpointManager.dcp_save"): (
        "2abaf8f4b17a09d7", "replaced (unless to_hf): dcp.save through the checksumming writer, then checksums.json"),
    ("torchtitan.components.checkpointer.base", "BaseCheckpointManager.load"): (
        "e3be770adff126d6", "wrapped: an explicit load_step verified first, the disk check after"),
    # workbench/memory/tracer.py: tracker_class subclasses torch's private FSDP memory tracker (torch 2.14.0)
    ("torch.distributed._tools.fsdp2_mem_tracker", "_FSDPRefType"): (
        "b9563c2a05a76020", "its values are tracer.categories_at_peak' keys; PlanRefType copies its members"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker.__init__"): (
        "5ae8d4324dc4fdd5", "subclassed by plan's Tracker, which sets _ref_class after it"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker._fsdp_state_pre_forward"): (
        "a5c9d3c3dda2d5b1", "wrapped by plan's Tracker (a module's second forward restarts its stats)"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker.__torch_dispatch__"): (
        "afad18a8a26e4a35", "wrapped by plan's Tracker (records the SDPA kernels dispatched)"),
    ("torch.distributed._tools.mem_tracker", "MemTracker.__init__"): (
        "adf771509a652f22", "plan's Tracker reads _ref_class, memory_tracking and _mod_tracker.is_bw set here"),
    ("torch.distributed._tools.mem_tracker", "MemTracker._track"): (
        "8f568b403f5b5944", "overridden by plan's Tracker (files tensors as logits, attention scores, NKI buffers)"),
}
# Private module-level names we read: they must still exist (their values are checked by the shape test above).
PRIVATE_NAMES = {"torchtitan.models.qwen3": ["_EMBEDDING_INIT", "_EMBEDDING_SKIP_INIT", "_LINEAR_INIT"],
                 "torchtitan.tools.utils": ["device_type", "device_module", "get_local_device"],
                 "torchtitan.models.common.moe": ["GroupedExperts._grouped_mm"]}


def installed_source(module: str, qualname: str) -> str:
    """The source text of `module.qualname` as installed (parsed from the file, not the live object)."""
    spec = importlib.util.find_spec(module)
    path = Path(spec.origin)
    text = path.read_text()
    nodes: list[ast.AST] = ast.parse(text).body
    for part in qualname.split("."):
        found = [n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part]
        assert found, f"{module}.{qualname} is gone (no {part!r} in {path})"
        node = found[0]
        nodes = node.body
    return ast.get_source_segment(text, node)


def source_hash(module: str, qualname: str) -> str:
    return hashlib.sha256(installed_source(module, qualname).encode()).hexdigest()[:16]


@pytest.mark.parametrize("target", list(UPSTREAM), ids=[f"{m}.{q}" for m, q in UPSTREAM])
def test_overridden_upstream_code_is_unchanged(target):
    import torchtitan

    module, qualname = target
    recorded, depends = UPSTREAM[target]
    now = source_hash(module, qualname)
    assert now == recorded, (
        f"{module}.{qualname} changed (source hash {now}, recorded {recorded} for torchtitan {TORCHTITAN_VERSION}, "
        f"torch {TORCH_VERSION}; installed {getattr(torchtitan, '__version__', '?')}, {torch.__version__}). "
        f"Depends on it: {depends}. "
        f"Re-read the new source, adapt the workbench, then record the new hash in tests/test_titan_guards.py.")


@pytest.mark.parametrize("module", list(PRIVATE_NAMES))
def test_private_torchtitan_names_exist(module):
    mod = importlib.import_module(module)
    for name in PRIVATE_NAMES[module]:
        obj = mod
        for part in name.split("."):
            assert hasattr(obj, part), f"torchtitan {module}.{name} is gone: the workbench reads it (grep for it)"
            obj = getattr(obj, part)


"""Reading a Hugging Face checkpoint folder: its safetensors files and the table of contents of their tensors.

Only headers are read here (no tensor data); pickle weights are refused, never unpickled. MoE experts on disk are
per expert (`mlp.experts.E.{gate,up,down}_proj.weight`); transformers 5.x can also write its in-memory fused layout
(`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]), which the table of
contents splits into the per-expert keys ("virtual" keys, read as slices).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.core.errors import HFCheckpointError
from workbench.core.files import check_regular, inside, read_json
from workbench.core.schema import DictOf, Obj, Str, check

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX = Obj({"weight_map": DictOf(Str(r"[^/\\\0]+\.safetensors", what="a .safetensors file name in the folder"),
                                  key=Str(max_len=1000))})
"""What the loader reads of `model.safetensors.index.json`: tensor key -> a file name in the same folder."""

# transformers v5's fused expert tensors; split into the per-expert keys on reading.
_FUSED_EXPERTS = re.compile(r"(?P<prefix>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)")
SHOW = 5  # offending keys listed per category in error messages


@dataclass(frozen=True)
class Source:
    """Where one (per-expert) HF tensor lives: a whole stored tensor, or a slice of a fused one."""

    file: Path
    key: str  # the key stored in the file
    shape: tuple[int, ...]  # the shape of the tensor this source yields
    dtype: str = ""  # as stored (safetensors' spelling: F32, BF16, I8, BOOL, ...)
    expert: int | None = None  # fused layout: index along dim 0
    rows: slice | None = None  # fused gate_up_proj: the gate or the up half

    def read(self, handle) -> torch.Tensor:
        """Reads the tensor from an open `safe_open` handle (slices read only their own bytes)."""
        if self.expert is None:
            return handle.get_tensor(self.key)
        part = handle.get_slice(self.key)
        return part[self.expert] if self.rows is None else part[self.expert, self.rows]


def weight_files(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory (all shards named by the index, which must exist).

    Raises:
        HFCheckpointError: no safetensors (pickle weights are refused, never unpickled), an unreadable
            index, or shards the index names that are missing.
    """
    d = Path(checkpoint_dir)
    index = d / INDEX_FILE
    if index.is_file():
        files = [d / name for name in sorted(set(read_index(d).values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise HFCheckpointError(
                f"{index} names {len(missing)} shard(s) missing from {d}: {', '.join(missing[:SHOW])}. "
                "The download or copy is incomplete: fetch the missing shard file(s) again."
            )
        return _regular(files)
    if (d / SINGLE_FILE).is_file():
        return [d / SINGLE_FILE]
    files = sorted(d.glob("*.safetensors"))
    if files:
        return _regular(files)
    pickles = sorted(p.name for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise HFCheckpointError(
            f"{d} holds PyTorch pickle weights ({', '.join(pickles[:SHOW])}) and no *.safetensors. The workbench "
            "never unpickles weights (unpickling runs arbitrary code). Convert them to safetensors first, in an "
            "environment you trust: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT) writes "
            "model.safetensors."
        )
    raise HFCheckpointError(f"{d} has no model.safetensors (or shards + {INDEX_FILE}); nothing to load.")


def read_index(checkpoint_dir: Path) -> dict[str, str]:
    """The `weight_map` of a checkpoint's index (tensor key -> file name), checked: an object of plain
    `.safetensors` names in the same folder, refused (the file and the key named) before any file is opened.

    Raises:
        HFCheckpointError: not JSON, not an index, or a name that leaves the folder.
    """
    index = checkpoint_dir / INDEX_FILE
    try:
        weight_map = check(read_json(index), INDEX, str(index))["weight_map"]
        for name in set(weight_map.values()):
            inside(checkpoint_dir, name)
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"{e}: not a valid safetensors index (a 'weight_map' of key -> a .safetensors file "
                                "in the same folder). Re-download or re-export the checkpoint.") from None
    return weight_map


def _regular(files: list[Path]) -> list[Path]:
    """`files`, each checked to be a regular file (a FIFO or device would block the reader forever)."""
    for f in files:
        try:
            check_regular(f)
        except OSError as e:
            raise HFCheckpointError(f"{e}; a checkpoint holds regular files only. Fetch or export it again."
                                    ) from None
    return files


def _file_keys(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """key -> (shape, stored dtype) from one file's header (no tensor data read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise HFCheckpointError(
            f"{file} is not a readable safetensors file ({e}). It is probably truncated or corrupt (an "
            "interrupted download or copy): fetch or export it again."
        ) from None


def _expand(file: Path, key: str, shape: tuple[int, ...], dtype: str = "") -> dict[str, Source]:
    """One stored tensor -> the per-expert HF keys it provides (itself, unless it is a fused expert tensor)."""
    m = _FUSED_EXPERTS.fullmatch(key)
    if m is None or len(shape) != 3:
        return {key: Source(file, key, shape, dtype=dtype)}
    n_experts, rows, cols = shape
    prefix = m["prefix"]
    out = {}
    for e in range(n_experts):
        if m["kind"] == "down_proj":  # [E, H, I] -> per expert [H, I]
            out[f"{prefix}.{e}.down_proj.weight"] = Source(file, key, (rows, cols), dtype, e)
        else:  # [E, 2I, H], gate rows first -> gate [I, H], up [I, H]
            half = rows // 2
            out[f"{prefix}.{e}.gate_proj.weight"] = Source(file, key, (half, cols), dtype, e, slice(0, half))
            out[f"{prefix}.{e}.up_proj.weight"] = Source(file, key, (half, cols), dtype, e, slice(half, rows))
    return out


def table_of_contents(checkpoint_dir: str | os.PathLike) -> dict[str, Source]:
    """Per-expert HF key -> where its data lives, for every tensor of the checkpoint (headers only).

    Raises:
        HFCheckpointError: see `weight_files`; also a corrupt or truncated file, or an index that names a
            tensor its file does not hold.
    """
    d = Path(checkpoint_dir)
    toc: dict[str, Source] = {}
    stored: dict[str, Path] = {}  # keys as stored, to check the index against
    for file in weight_files(d):
        for key, (shape, dtype) in _file_keys(file).items():
            stored[key] = file
            toc.update(_expand(file, key, shape, dtype))
    index = d / INDEX_FILE
    if index.is_file():
        weight_map = read_index(d)
        wrong = [k for k, name in weight_map.items() if k not in stored or stored[k].name != name]
        if wrong:
            raise HFCheckpointError(
                f"{index} lists {len(wrong)} tensor(s) that are not in the file it names, e.g. "
                + ", ".join(f"{k} (in {weight_map[k]}?)" for k in wrong[:SHOW])
                + ". The index and the shards come from different exports: fetch the checkpoint again."
            )
    return toc

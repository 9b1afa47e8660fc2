"""Checkpoints that survive crashes, flipped bytes, truncated files and full disks.

`WorkbenchCheckpointManager` is torchtitan's DCP `CheckpointManager` (subclassed through its Config, methods
overridden, nothing copied) with:
  * checksums: every save hashes each file as DCP writes it (xxh3-64, per rank for its own files), reads the files
    back and compares, then rank 0 writes `checksums.json` last: a step folder without it is incomplete, and only
    a verified checkpoint counts for `keep_latest_k` (the older ones are purged only after that);
  * resume from the newest *verified* checkpoint: rank 0 checks each `step-N/` cheaply (the files listed, their
    sizes, the DCP `.metadata`), then every rank hashes a share of its files, all before DCP reads anything; a
    mismatch names the step and the file, and the next older one is tried (`checkpoint.on_corrupt = "error"`
    stops instead); a folder whose checkpoints are all unusable is refused (never a silent restart from step 1);
  * a checkpoint that reads but does not fit the model (other flavor/shapes) -> exit 2 naming the keys;
  * saves that cannot hurt older checkpoints: a stale folder of the step being saved is removed first (a relaunch
    after a fallback re-saves a step), a failed save (full disk) removes its partial folder and stops with one
    line, and `keep_latest_k` means what it says (also after the last step's save);
  * a free-space check before the first save (warn, or refuse with `checkpoint.refuse_low_disk`);
  * nothing unpickled outside an allowlist (`load_dcp`, `read_metadata`): `.metadata` hashed before it is parsed and
    unpickled with only the classes DCP metadata is made of, BYTE_IO entries with `weights_only=True`; a checkpoint
    that asks for anything else is refused unrun (`UnsafeCheckpointError`, exit 4), never fallen back from.

The failures are `workbench.core.errors` classes: `workbench.train.main` prints them as one line and exits with their
code instead of a traceback per rank.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torchtitan.components.checkpoint import MODEL, CheckpointManager

from workbench.core.errors import (
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    RunError,
    UnsafeCheckpointError,
    WorkbenchError,
)
from workbench.core.files import inside, plain_name, read_bytes, read_json, write_atomic
from workbench.core.schema import Choice, DictOf, Int, Obj, Str, check
from workbench.platform.dist_utils import all_gather, barrier, broadcast, rank, say
from workbench.run.run_folder import CHECKSUMS, checkpoint_space, dir_bytes, is_complete, step_dirs

HASH = "xxh3_64"
_CHUNK = 8 << 20
CHECKSUMS_SPEC = Obj({"files": DictOf(Obj({"bytes": Int(0), HASH: Str(r"[0-9a-f]{16}", what="16 hex digits")}),
                                      key=Str(r"[^/\\\0]{1,255}", what="a file name in the step folder"))},
                     {"hash": Choice((HASH,))})
"""What `checksums.json` must hold: file name (in its step folder) -> its size and xxh3-64."""
TRAIN_STATE = "train_state.json"
"""What a resume keeps of the run that saved a step (its global batch and how it was made), beside DCP's files."""


# ---- cheap checks of a DCP checkpoint folder --------------------------------------------------------------------

def newest_complete(folder: str | os.PathLike) -> int | None:
    return max(step_dirs(folder, complete=True), default=None)


# ---- untrusted bytes: DCP's pickles read through an allowlist ---------------------------------------------------

_DCP_MD = "torch.distributed.checkpoint.metadata"
METADATA_CLASSES = frozenset({
    *((_DCP_MD, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                             "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                             "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout pickles as _get_layout("torch.strided"): a table lookup
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
})
"""(module, name) of every class a DCP `.metadata` of torch 2.14 is made of (with the `torch` dtypes): the only
globals `read_metadata` lets a pickle name. Anything else (os.system, builtins.eval, ...) is refused unrun."""


class _AllowlistUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the allowlisted globals; any other is refused before it is even imported."""

    def __init__(self, file, source: str, allowed: frozenset[tuple[str, str]]):
        super().__init__(file)
        self.source, self.allowed = source, allowed

    def find_class(self, module: str, name: str):
        # dtypes pickle as torch.<name>: looked up in torch's namespace as it is (no getattr: torch's module
        # __getattr__ would import submodules), exact names only (a dotted name would walk attributes)
        dtype = module == "torch" and isinstance(vars(torch).get(name), torch.dtype)
        if (module, name) in self.allowed or dtype:
            return super().find_class(module, name)
        raise unsafe(self.source, f"{module}.{name}")

    def persistent_load(self, pid):
        raise unsafe(self.source, f"a persistent id ({str(pid)[:40]})")


def unsafe(source: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{source} tries to load {what}, which no checkpoint the workbench writes contains; nothing in it was run.",
        "use checkpoints only from sources you trust; delete this one (it was crafted or damaged).")


def allowlist_loads(data: bytes, source: str, allowed: frozenset[tuple[str, str]] = METADATA_CLASSES):
    """`pickle.loads` that admits only the globals in `allowed` (none: builtins containers and scalars only).

    Raises:
        UnsafeCheckpointError: the pickle names another global (the message names `source` and the class).
    """
    return _AllowlistUnpickler(io.BytesIO(data), source, allowed).load()


def read_metadata(path: Path):
    """The DCP metadata of step folder `path`: its bytes hashed against `checksums.json` (where the folder has one)
    before they are parsed, then unpickled through the allowlist (`METADATA_CLASSES`).

    Raises:
        CheckpointError: the file does not match its checksum (it was not parsed).
        UnsafeCheckpointError: the pickle names a class outside the allowlist.
    """
    f = path / ".metadata"
    data = read_bytes(f)
    if is_complete(path):
        entry = read_checksums(path).get(".metadata")
        if entry is None:
            raise CheckpointError(f"{f} has no checksum; it was not read")
        if xxhash.xxh3_64_hexdigest(data) != entry.get(HASH):
            raise CheckpointError(f"{f} does not match its checksum (bytes changed after the save); it was not read")
    return allowlist_loads(data, str(f))


def load_dcp(state_dict: dict[str, Any], checkpoint_id: str | os.PathLike) -> None:
    """`dcp.load` of a step folder with nothing unpickled outside an allowlist: `.metadata` through
    `read_metadata`, BYTE_IO entries (train state, optimizer param groups, dataloader state) with
    `torch.load(weights_only=True)`, and bytes among them that are pickles (torchtitan's dataloader state, which it
    unpickles itself) checked to hold builtins only.

    Raises:
        UnsafeCheckpointError: a file names a class outside the allowlist (DCP's wrapping of it removed).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state_dict, storage_reader=_AllowlistReader(checkpoint_id),
                 planner=_AllowlistPlanner(str(checkpoint_id)))
    except CheckpointException as e:  # DCP wraps each rank's failure: a workbench error is the one line to show
        for failure in e.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, WorkbenchError):
                raise inner from None
        raise


class _AllowlistReader(FileSystemReader):
    """torch's FileSystemReader whose `read_metadata` is the workbench's (hashed, then allowlisted)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # rank-local metadata (saves without coordination): never written here
            raise CheckpointError(f"{self.path}: rank-local DCP metadata is not supported.")
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:  # as torch's read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _AllowlistPlanner(DefaultLoadPlanner):
    """torch's DefaultLoadPlanner whose `load_bytes` unpickles with `weights_only=True` (torch's uses False)."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        where = f"{self.source} (entry {fqn})"
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            name = found[1] if found else "an object outside torch's weights-only set"
            raise unsafe(where, name if "." in name or not found else f"builtins.{name}") from None  # torch: "exec"
        if isinstance(obj, bytes):  # torchtitan's dataloader state: a pickle that it unpickles itself
            try:
                allowlist_loads(obj, where, frozenset())
            except UnsafeCheckpointError:
                raise
            except Exception:  # noqa: BLE001, S110 - bytes that are no pickle: nothing for pickle to run either
                pass
        if self.flatten_state_dict:  # where torch's load_bytes puts the value
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def read_train_state(path: Path) -> dict[str, int] | None:
    """A step folder's `train_state.json` (`TRAIN_STATE`), hashed against `checksums.json` before it is parsed; None
    for a step without one (or one that does not match: the resume's verification then names the step)."""
    try:
        data = read_bytes(path / TRAIN_STATE)
        if xxhash.xxh3_64_hexdigest(data) != read_checksums(path)[TRAIN_STATE][HASH]:
            return None
        record = json.loads(data)
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):
        return None
    keys = ("global_batch_size", "local_batch_size", "data_parallel_ranks", "gradient_accumulation_steps")
    ok = isinstance(record, dict) and all(type(record.get(k)) is int and 0 < record[k] < 2**31 for k in keys)
    return {k: record[k] for k in keys} if ok else None


def read_checksums(path: Path) -> dict[str, dict[str, Any]]:
    """file name -> {"bytes": n, "xxh3_64": hex} of a step folder's `checksums.json`, checked against
    `CHECKSUMS_SPEC` (every name a file of the step folder itself) before any file it names is opened.

    Raises:
        CheckpointError: unreadable, not JSON, or a wrong key (the file and the key named).
    """
    f = path / CHECKSUMS
    try:
        files = check(read_json(f), CHECKSUMS_SPEC, str(f))["files"]
        for name in files:
            inside(path, name)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{e}".removesuffix(".")) from None
    return files


def file_checksum(path: Path) -> str:
    """xxh3-64 of a file's bytes (hex), read in 8 MiB chunks."""
    h = xxhash.xxh3_64()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def check_checkpoint(path: str | os.PathLike) -> str | None:
    """None if a step folder's files match its `checksums.json` and DCP metadata in name and size, else why not.

    Cheap (sizes, and the small `.metadata` hashed before it is parsed): catches unfinished saves, truncated or
    missing files (an interrupted copy, a full disk) and unreadable or altered metadata. Flipped bytes in another
    file of the right size need `verify_files`.

    Raises:
        UnsafeCheckpointError: the metadata pickle names a class outside the allowlist.
    """
    path = Path(path)
    if not is_complete(path):
        return f"{path / CHECKSUMS} is missing (the save did not finish)"
    try:
        sums = read_checksums(path)
    except CheckpointError as e:
        return e.message
    for name, entry in sorted(sums.items()):
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        have = f.stat().st_size
        if have != entry["bytes"]:
            return f"{f} is truncated ({have:,} of {entry['bytes']:,} bytes)" if have < entry["bytes"] else \
                f"{f} has {have:,} bytes, {entry['bytes']:,} were written"
    try:
        storage = dict(read_metadata(path).storage_data or {})
    except UnsafeCheckpointError:
        raise  # not damage: a refusal, never a fallback to an older checkpoint of the same folder
    except CheckpointError as e:
        return e.message
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing here
        return f"{path / '.metadata'} is unreadable ({type(e).__name__})"
    names = [getattr(info, "relative_path", None) for info in storage.values()]  # DCP opens <step>/<each>
    for name in (n for n in names if not plain_name(n)):
        return f"{path / '.metadata'} names a file outside its step folder ({str(name)[:80]!r}); nothing was read"
    unlisted = sorted({info.relative_path for info in storage.values()} - set(sums))
    if unlisted:
        f = path / unlisted[0]
        return f"{f} is missing" if not f.is_file() else f"{f} has no checksum"
    return None


def verify_files(path: Path, sums: dict[str, dict[str, Any]], names: list[str]) -> str | None:
    """None if each of `names` hashes to its recorded checksum, else which file does not (the first)."""
    for name in names:
        f = path / name
        try:
            ok = file_checksum(f) == sums[name][HASH]
        except OSError as e:
            return f"{f} is unreadable ({e.strerror})"
        if not ok:
            return f"{f} does not match its checksum (bytes changed after the save)"
    return None


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """`check_checkpoint`, then every file's checksum, in this process (tools, tests; training splits the hashing
    over its ranks)."""
    path = Path(path)
    problem = check_checkpoint(path)
    if problem is None:
        sums = read_checksums(path)
        problem = verify_files(path, sums, sorted(sums))
    return problem


def stale_checkpoints(folder: str | os.PathLike, keep_latest_k: int) -> list[Path]:
    """The step folders to delete: complete ones beyond the newest `keep_latest_k`, and partial ones older than
    the newest complete one (leftovers of killed or failed saves). Newer partial ones may be a save in flight."""
    dirs = step_dirs(folder)
    complete = sorted(s for s, p in dirs.items() if is_complete(p))
    doomed = complete[:-keep_latest_k] if keep_latest_k > 0 else []
    newest = complete[-1] if complete else -1
    doomed += [s for s, p in dirs.items() if not is_complete(p) and s < newest]
    return [dirs[s] for s in sorted(doomed)]


def checkpoint_bytes(model_parts, optimizers=None) -> int:
    """Bytes of one DCP checkpoint, from global shapes and stored dtypes (a DTensor's numel is its global size).

    The model state dict (a tied embedding twice, as DCP writes it) plus the optimizer state; where the optimizer
    has none yet (AdamW creates it in its first step), its two moments per trainable parameter.

    Args:
        model_parts: the model's parts (torchtitan's `model_parts`).
        optimizers: a torch optimizer or torchtitan's container of them; None = not built yet.
    """
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    total = sum(nbytes(t) for m in model_parts for t in m.state_dict().values() if isinstance(t, torch.Tensor))
    opts = getattr(optimizers, "optimizers", [optimizers] if optimizers is not None else [])
    states = [state for opt in opts for state in opt.state.values()]
    if states:
        return total + sum(nbytes(t) for state in states for t in state.values() if isinstance(t, torch.Tensor))
    return total + 2 * sum(nbytes(p) for m in model_parts for p in m.parameters() if p.requires_grad)


def shape_mismatches(state_dict: dict[str, Any], metadata, limit: int = 3) -> list[str]:
    """'key: expected (a, b), found (c, d)' for the model tensors whose checkpoint entry is absent or differs."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    found_md = metadata.state_dict_metadata
    out = []
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue  # optimizer / dataloader / lr states: their shapes follow the model's
        entry = found_md.get(key)
        found = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        if found != tuple(value.shape):
            out.append(f"{key}: expected {tuple(value.shape)}, found {found if found is not None else 'no such key'}")
            if len(out) >= limit:
                break
    return out


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class WorkbenchCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpointer, hardened against unreadable checkpoints, crashes and full disks."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        on_corrupt: Literal["fallback", "error"] = "fallback"
        """Unreadable newest checkpoint on resume: warn and use the newest readable one, or stop."""
        refuse_low_disk: bool = False
        """Stop before the first save when the folder lacks room for keep_latest_k checkpoints."""
        total_steps: int = 0
        """training.steps (to count the saves still to come for the disk-space check)."""

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.wb_config = config
        self.train_state: dict[str, int] | None = None
        """Written as `TRAIN_STATE` into every step folder (the trainer sets it)."""

    # ---- resume -----------------------------------------------------------------------------------------------

    def _find_load_step(self, folder: str = "") -> int:
        """The newest verified checkpoint, decided together (every rank loads the same step).

        Newest first: rank 0's cheap check, then every rank hashes its share of the files; a failure is named in a
        warning and the next older step is tried. A folder with step folders but none usable is refused.
        """
        if folder and folder != self.folder:
            return super()._find_load_step(folder)
        steps = broadcast(sorted(step_dirs(self.folder), reverse=True) if rank() == 0 else None)
        bad: list[str] = []
        for step in steps:
            problem = self._verify(step)
            if problem is None:
                if bad:
                    say(f"workbench: resuming from step {step} (the newest verified checkpoint).")
                return step
            bad.append(f"step {step}: {problem}")
            if self.wb_config.on_corrupt == "error" and "did not finish" not in problem:
                raise CheckpointError(f"checkpoint step {step} is unusable: {problem}.",
                                      f"move {self._create_checkpoint_id(step)} away to resume from an older "
                                      "checkpoint, or set --checkpoint.on_corrupt fallback.")
            say(f"workbench: warning: checkpoint step {step} is unusable: {problem}; trying an older one.")
        if bad and all("did not finish" in b for b in bad):  # e.g. a double Ctrl-C during the first save
            unfinished = " ".join(str(self._create_checkpoint_id(s)) for s in steps)
            raise CheckpointError(
                f"no usable checkpoint in {self.folder} ({'; '.join(bad)}): no save there finished, so there is "
                "nothing to resume; nothing was deleted.",
                f"to start from step 1, delete the unfinished saves (rm -r {unfinished}) and relaunch the same "
                "command; or restore a finished checkpoint there.")
        if bad:
            raise CheckpointError(
                f"no usable checkpoint in {self.folder} ({'; '.join(bad)}); nothing was deleted.",
                f"restore a checkpoint there, or move {Path(self.folder).parent} away to start from scratch.")
        return -1

    def _verify(self, step: int) -> str | None:
        """None if checkpoint `step` is whole (sizes on rank 0, checksums split over the ranks), else why not."""
        path = Path(self._create_checkpoint_id(step))
        problem, sums, refused = None, None, None
        if rank() == 0:
            try:
                problem = check_checkpoint(path)
            except UnsafeCheckpointError as e:
                refused = (e.message, e.fix)
            sums = read_checksums(path) if problem is None and refused is None else None
        problem, sums, refused = broadcast((problem, sums, refused))
        if refused is not None:  # every rank raises it: a crafted checkpoint stops the launch, whatever on_corrupt
            raise UnsafeCheckpointError(*refused)
        if problem is not None:
            return problem
        r, world = _world()
        found = [p for p in all_gather(verify_files(path, sums, sorted(sums)[r::world])) if p]
        return found[0] if found else None

    def load(self, step: int = -1) -> bool:
        if self.enable and step != -1:  # an explicit --checkpoint.load_step: no fallback, just a clear error
            problem = self._verify(step)
            if problem:
                raise CheckpointError(f"checkpoint.load_step={step} is unusable: {problem}.",
                                      "pick another step (--checkpoint.load_step -1 = newest verified).")
        loaded = super().load(step)
        if self.enable and not self.load_only:
            self._check_disk_space()
        return loaded

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if not from_hf:
            # Every rank reads the (small) metadata and compares global shapes: the same answer everywhere.
            wrong = shape_mismatches(state_dict, read_metadata(Path(checkpoint_id)))
            if wrong:
                raise CheckpointMismatchError(
                    f"checkpoint {checkpoint_id} was written for another model: {'; '.join(wrong)}.",
                    "resume with the flavor/config it was trained with (see config.toml in the run folder), or "
                    "use another --job.experiment_name for the new model.")
        try:
            if from_hf:  # safetensors, through torchtitan's HF reader
                super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            else:  # torchtitan's DCP branch with the allowlisted reader and planner
                load_dcp(state_dict, checkpoint_id)
                if MODEL in self.states:  # DCP filled the flattened model entries; the model takes them as torchtitan
                    self.states[MODEL].load_state_dict(state_dict)  # does after its own dcp.load
        except (RunError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException (a BaseException) is multi-screen: first line only
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"loading {checkpoint_id} failed: {first[:300]}",
                                  f"move {checkpoint_id} away to resume from an older checkpoint.") from e

    # ---- save ---------------------------------------------------------------------------------------------------

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        path = Path(self._create_checkpoint_id(curr_step))
        # A folder of this step can only be left over from an abandoned timeline (a relaunch that fell back past
        # it, or a killed save): its stale files must not survive next to new ones.
        if rank() == 0 and path.exists():
            shutil.rmtree(path)
        barrier()
        try:
            saved = super()._save(curr_step, last_step)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException (a BaseException), raised on every rank
            raise self._save_failed(curr_step, path, e) from e
        if last_step:
            self._purge_stale_checkpoints()  # torchtitan purges after interval saves only: keep_latest_k + 1 left
        return saved

    def _save_failed(self, curr_step: int, path: Path, e: BaseException) -> CheckpointError:
        """Removes the partial save (its space freed, never resumed from) and says what is kept."""
        # ENOSPC often surfaces as a zip-writer "unexpected pos" error: look at the disk too.
        usage = shutil.disk_usage(self.folder)
        full = any(s in str(e) for s in ("No space left", "Errno 28")) or usage.free < max(64 << 20, usage.total // 100)
        if rank() == 0 and path.exists():
            shutil.rmtree(path, ignore_errors=True)
        kept = newest_complete(self.folder)
        kept_s = f"checkpoint step {kept} is intact" if kept is not None else "no earlier checkpoint exists"
        reason = "the disk is full" if full else (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        return CheckpointError(
            f"saving step {curr_step} to {path} failed: {reason}; the partial save was removed, {kept_s}.",
            f"free space in {self.folder} (or lower checkpoint.keep_latest_k / move checkpoint.folder), then "
            "relaunch the same command to resume." if full else "check the checkpoint folder, then relaunch.")

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        """DCP's save through a writer that hashes every file it writes, then the read-back check and
        `checksums.json` (the commit point; synchronous saves only: the workbench never saves asynchronously)."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        import torch.distributed.checkpoint as dcp

        sums: dict[str, dict[str, Any]] = {}
        # Tests only: hold every save between its shard files and its .metadata, so a kill -9 lands inside a save.
        delay = float(os.environ.get("WORKBENCH_TEST_SAVE_DELAY_S", "0") or 0)
        metadata = dcp.save(state_dict, storage_writer=checksumming_writer(checkpoint_id, sums, delay))
        extra = {TRAIN_STATE: json.dumps(self.train_state).encode()} if self.train_state else {}
        commit_checksums(Path(checkpoint_id), sums, metadata, extra)
        return None

    def _purge_stale_checkpoints(self):
        """keep_latest_k over *verified* checkpoints; partial folders older than the newest verified one go too.

        torchtitan's version counts every step folder, so a partial save could push the last good checkpoint out.
        """
        if self._should_purge():
            for path in stale_checkpoints(self.folder, self.keep_latest_k):
                self.purge_queue.put(str(path))

    # ---- disk space -------------------------------------------------------------------------------------------

    def _check_disk_space(self) -> None:
        """Before the first save: room for the checkpoints this run will hold at its peak? Warn or refuse."""
        estimate = checkpoint_bytes(self.states[MODEL].model)  # before the first step: no optimizer state yet
        message = self._disk_space_message(estimate) if dist.get_rank() == 0 else None
        message = broadcast(message)
        if not message:
            return
        if self.wb_config.refuse_low_disk:
            raise CheckpointError(message, f"free space in {self.folder}, lower checkpoint.keep_latest_k, or set "
                                           "--checkpoint.refuse_low_disk false to only warn.")
        say(f"workbench: warning: {message}")

    def _disk_space_message(self, estimate: int) -> str | None:
        # Creates nothing: torchtitan's `_load` asks each rank on its own whether the folder exists, so a folder rank 0
        # made here could send a slower rank searching it alone into rank 0's next collective (seen in CI).
        folder = Path(self.folder)
        newest = newest_complete(folder)
        # A checkpoint on disk is the best measure; else the estimate (the optimizer's own state is not asked for:
        # materialising it before the first step would advance Adam's step count and change the run).
        size = dir_bytes(step_dirs(folder)[newest]) if newest is not None else estimate
        k = self.keep_latest_k
        space = checkpoint_space(folder, size, k, self.wb_config.total_steps, self.interval, self._current_step())
        if space.fits:
            return None
        gib = 1024**3
        return (f"{folder} has {space.free_bytes / gib:.2f} GiB free; {space.copies} checkpoint(s) of "
                f"{size / gib:.2f} GiB (keep_latest_k={k}) need {space.need_bytes / gib:.2f} GiB more; a save will "
                "fail with a full disk.")

    def _current_step(self) -> int:
        train_state = self.states.get("train_state")
        return int(getattr(train_state, "step", 0) or 0)


def commit_checksums(path: Path, sums: dict[str, dict[str, Any]], metadata, files: dict[str, bytes] | None = None
                     ) -> None:
    """After DCP's save (on every rank): rank 0 writes `files` (name -> bytes: the train state) beside DCP's; each
    rank reads its own files back against the checksums taken while they were written; if all match, rank 0 writes
    `checksums.json` (temp file + fsync + rename), the commit point.

    Raises:
        CheckpointError: on every rank, naming the first file that read back differently or was not hashed
            (`_save` turns it into the one-line save failure).
    """
    failed = None
    for name, data in (files or {}).items() if rank() == 0 else ():
        try:
            (path / name).write_bytes(data)
        except OSError as e:
            failed = f"writing {path / name} failed: {e.strerror}"
        sums[name] = {"bytes": len(data), HASH: xxhash.xxh3_64_hexdigest(data)}
    problems = [p for p in all_gather(failed or verify_files(path, sums, sorted(sums))) if p]
    every = {k: v for part in all_gather(sums) for k, v in part.items()}
    written = {info.relative_path for info in (metadata.storage_data or {}).values()} | {".metadata"}
    problems += [f"{path / name} was written without a checksum" for name in sorted(written - set(every))]
    if rank() == 0 and not problems:
        try:
            write_atomic(path / CHECKSUMS, json.dumps({"hash": HASH, "files": dict(sorted(every.items()))}, indent=1))
        except OSError as e:  # a full disk can strike here too: every rank must hear of it
            problems.append(f"writing {path / CHECKSUMS} failed: {e.strerror}")
    problems = broadcast(problems)
    if problems:
        raise CheckpointError(problems[0])


class _HashingStream:
    """A binary output stream that hashes what passes through it (DCP writes with write/tell/flush/fileno)."""

    def __init__(self, raw):
        self.raw, self.h, self.n = raw, xxhash.xxh3_64(), 0

    def write(self, b) -> int:
        self.h.update(b)
        n = self.raw.write(b)
        self.n += n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()


def checksumming_writer(path: str, sums: dict[str, dict[str, Any]], delay: float = 0.0):
    """DCP's FileSystemWriter whose streams record `{file: {bytes, xxh3_64}}` into `sums` as they are written.

    `delay` (tests): wait that many seconds before `.metadata` is written.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, file, mode):
            with super().create_stream(file, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                hashing = _HashingStream(stream)
                yield hashing
            name = Path(file).name.removesuffix(".tmp")  # DCP writes .metadata.tmp, then renames it
            sums[name] = {"bytes": hashing.n, HASH: hashing.h.hexdigest()}

    class Writer(FileSystemWriter):
        def finish(self, metadata, results):
            if delay > 0:
                time.sleep(delay)
            return super().finish(metadata, results)

    writer = Writer(path)
    writer.fs = HashingFileSystem()
    return writer


__all__ = ["WorkbenchCheckpointManager", "check_checkpoint", "verify_checkpoint", "verify_files", "file_checksum",
           "read_checksums", "read_train_state", "commit_checksums", "newest_complete", "stale_checkpoints", "HASH",
           "TRAIN_STATE"]


def load_dcp_model_state(model: torch.nn.Module, step_dir: Path) -> None:
    """Fills `model` with the model weights of a workbench DCP checkpoint (stored at top-level keys).

    Every file is hashed against `checksums.json` before any is parsed, and nothing is unpickled outside the
    allowlist (`workbench.run.checkpoint.load_dcp`): a checkpoint from elsewhere is as safe to open as safetensors.

    Raises:
        CheckpointError: a file is missing, truncated or altered (exit 4).
        UnsafeCheckpointError: a file asks to load a class outside the allowlist (nothing of it ran).
        ConfigError: the checkpoint is not of this model.
    """
    problem = verify_checkpoint(step_dir)
    if problem:
        raise CheckpointError(f"{step_dir} is unusable: {problem}.",
                              "export another step (--step N), or restore this checkpoint from its source.")
    state = model.state_dict()  # the keys torchtitan saved (e.g. wq/wk/wv, not the fused wqkv)
    stored = read_metadata(step_dir).state_dict_metadata
    absent = [k for k in state if k not in stored]
    if absent:
        raise ConfigError(f"{step_dir} holds no weights for {absent[:5]} ({len(absent)} keys): it is not a checkpoint "
                          "of this run's model (config.toml and checkpoint disagree).")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        load_dcp(state, step_dir)
    model.load_state_dict(state)

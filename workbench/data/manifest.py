"""What a prepared folder declares, and the checks that hold it to it: the manifest's schema (`MANIFEST`, read by
`read_manifest`), each shard record's (`RECORD`), and the digests of a shard's files (`digest`: a crc32 per 64 KiB
block, written beside the file as `<file>.crc` and checked as blocks are first read, and a sha256 in the manifest).

Every file of a shard (`SHARD_FILES`, and any a shard's record lists) is covered the same way, so a side file added
later is checked by construction.
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

import numpy as np

from workbench.core.errors import DatasetError
from workbench.core.files import open_regular, read_json
from workbench.core.schema import NULL, AnyOf, Choice, DictOf, Int, ListOf, Obj, SchemaError, Str, check

FORMAT = 3  # bumped whenever the folder's layout or manifest changes
SHARD_FILES = ("tokens", "docs")  # a shard's files: each gets a crc per block and a sha256 in the manifest
BLOCK_TOKENS = 16384  # 64 KiB of uint32: the unit of the read-time crc check
BLOCK_BYTES = BLOCK_TOKENS * 4  # the crc block of every shard file

_COUNT = Int(0, 2**63 - 1)  # what an int64 holds
_HEX64 = Str(r"[0-9a-f]{64}", what="a sha256 (64 hex digits)")
_FILES = DictOf(Obj({"bytes": _COUNT, "sha256": _HEX64}), key=Str(r"[a-z]{1,16}", what="a file kind ('tokens')"))
_NAME = Str(r"\d{5}", what="a shard name of 5 digits (a file in shards/)")
_CHAT = {"assistant_turns": _COUNT, "trained_ends": _COUNT, "bad_kinds": DictOf(_COUNT, key=Str(max_len=64))}
"""Conversations (`workbench.data.chat`): the stop audit's counts and the bad rows per kind."""
MANIFEST = Obj({
    "format": Choice((FORMAT,)), "source": Str(), "fingerprint": _HEX64, "tokenizer_sha256": _HEX64,
    "text_field": Str(), "documents": _COUNT, "tokens": _COUNT, "first_text_document": Int(-1),
    "bad_rows": _COUNT, "bad_examples": ListOf(Str()), "vocab_size": Int(1, 2**32),
    "shards": ListOf(Obj({"name": _NAME, "documents": _COUNT, "tokens": _COUNT, "files": _FILES}))},
    {"text_documents": _COUNT, "dtype": Choice(("uint32",)), "separator": AnyOf((Str(), NULL)),
     "mode": Choice(("text", "chat")), **_CHAT})
"""The manifest a reader trusts: every key it uses, with its type and range."""
RECORD = Obj({"name": _NAME, "documents": _COUNT, "tokens": _COUNT, "text_documents": _COUNT, "first_text": Int(-1),
              "bad_rows": _COUNT, "bad_examples": ListOf(Str()), "vocab_size": Int(1, 2**32), "files": _FILES}, _CHAT)


def read_manifest(folder: str | Path) -> dict:
    """The manifest of a complete prepared folder, checked against `MANIFEST` and for counts that add up.

    Raises:
        DatasetError: unreadable, another format, or a wrong key (the file and the key named).
    """
    m = Path(folder) / "manifest.json"
    fix = f"prepare again into a new folder: python -m workbench.data prepare SRC {folder}."
    try:
        manifest = read_json(m)
    except (OSError, ValueError) as e:
        raise DatasetError(f"{m}: {e}." if isinstance(e, OSError) else f"{e}.", fix) from None
    if isinstance(manifest, dict) and manifest.get("format") != FORMAT:
        raise DatasetError(f"{folder} has prepared-data format {manifest.get('format')!r}; this workbench reads "
                           f"format {FORMAT}.", f"delete {folder} and prepare again.")
    try:
        check(manifest, MANIFEST, str(m))
        shards = manifest["shards"]
        for key, total in (("documents", manifest["documents"]), ("tokens", manifest["tokens"])):
            if sum(sh[key] for sh in shards) != total:
                raise SchemaError(f"{m}: {key} is {total:,}, but its shards hold {sum(sh[key] for sh in shards):,}")
        if manifest["first_text_document"] >= max(manifest["documents"], 1):
            raise SchemaError(f"{m}: first_text_document is past the last document")
        chat = manifest.get("mode") == "chat"  # conversations: one owner byte per token in the shard's .mask
        for i, sh in enumerate(shards):
            for kind, size in (("tokens", 4 * sh["tokens"]), ("docs", 8 * sh["documents"])) + \
                    (("mask", sh["tokens"]),) * chat:
                if sh["files"].get(kind, {}).get("bytes") != size:
                    raise SchemaError(f"{m}: shards[{i}].files.{kind}.bytes is not {size:,} (its {kind} count)")
        if len({sh["name"] for sh in shards}) != len(shards):
            raise SchemaError(f"{m}: a shard is listed twice")
    except SchemaError as e:
        raise DatasetError(f"{e}.", fix) from None
    return manifest


def digest(path: Path) -> tuple[bytes, dict]:
    """(the uint32 crc32 of every 64 KiB block, {"bytes": size, "sha256": hex}) of one shard file."""
    h, crcs, n = hashlib.sha256(), [], 0
    with open_regular(path) as f:
        while block := f.read(BLOCK_BYTES):
            crcs.append(zlib.crc32(block))
            h.update(block)
            n += len(block)
    return np.asarray(crcs, dtype=np.uint32).tobytes(), {"bytes": n, "sha256": h.hexdigest()}


__all__ = ["FORMAT", "SHARD_FILES", "BLOCK_TOKENS", "BLOCK_BYTES", "MANIFEST", "RECORD", "read_manifest", "digest"]

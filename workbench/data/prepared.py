"""A prepared folder read back: `PreparedDataset` (memory-mapped shards, every block checked as it is first read) and
the identity of a preparation (`fingerprint`, `is_prepared`). `workbench.data.prepare` writes such folders; its module
docstring has the layout."""

from __future__ import annotations

import hashlib
import mmap
import os
import zlib
from pathlib import Path

import numpy as np

from workbench.core import files
from workbench.core.errors import DatasetError
from workbench.core.files import read_bytes
from workbench.data import BUNDLED, TRAINING_ARGS, document_sources, source_root, tokenizer_hash
from workbench.data.manifest import BLOCK_BYTES, BLOCK_TOKENS, digest, read_manifest

UNMAP_ALIGN = 1 << 20  # what a read unmaps is widened to these boundaries (> Linux's 64 KiB fault-around window)


def fingerprint(dataset: str, arg: str = TRAINING_ARGS[0]) -> str:
    """sha256 over the source files' relative paths, sizes and modification times (no content read)."""
    root = source_root(dataset, arg)
    h = hashlib.sha256()
    for _, f in document_sources(dataset, arg):
        st = f.stat()
        h.update(f"{f.relative_to(root) if root.is_dir() else f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def is_prepared(path: str | Path) -> bool:
    """A folder made by `prepare` (complete or not): it has a recipe or a manifest."""
    p = Path(path)
    return p.is_dir() and ((p / "manifest.json").is_file() or (p / "recipe.json").is_file())


def _map_tokens(path: Path) -> mmap.mmap:
    """A shard's tokens mapped read-only, advised random access: rows are read in a shuffled order, so the kernel
    reads ahead nothing into this process."""
    with files.open_regular(path) as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mm.madvise(mmap.MADV_RANDOM)
    return mm


class PreparedDataset:
    """A complete prepared folder, memory-mapped: documents by global index, in the source's fixed order.

    Opening reads the manifest (checked against `MANIFEST`) and the document index (8 bytes per document, its crc
    checked and its ends required to rise to the shard's token count), never the tokens; token blocks are
    crc-checked, and their ids checked against the vocabulary, the first time this process reads them.

    Raises:
        DatasetError: not a prepared folder, an unfinished one, a manifest that is not what prepare writes (the key
            named), another tokenizer (both hashes named), a source changed since prepare (the fingerprints named),
            a truncated, corrupt or linked shard file (the file named).
    """

    def __init__(self, folder: str | Path, tokenizer_path: str | None = "", check_source: bool = True):
        self.folder = Path(folder)
        m = self.folder / "manifest.json"
        if not m.is_file():
            state = "was never finished (the prepare was interrupted)" if (self.folder / "recipe.json").is_file() \
                else "is not a prepared dataset"
            raise DatasetError(f"{self.folder} {state}.", "run python -m workbench.data prepare SRC "
                               f"{self.folder} (it resumes where it stopped).")
        self.manifest = read_manifest(self.folder)
        if tokenizer_path is not None and (want := tokenizer_hash(tokenizer_path)) != self.manifest["tokenizer_sha256"]:
            raise DatasetError(
                f"{self.folder} was prepared with tokenizer sha256 {self.manifest['tokenizer_sha256'][:16]}, but "
                f"model.tokenizer_path={tokenizer_path or '(bundled Qwen3)'!r} has sha256 {want[:16]}.",
                "prepare the dataset again with this tokenizer (--tokenizer), or train with the one that made it.")
        src = self.manifest["source"]
        if check_source and (src in BUNDLED or Path(src).exists()):
            now = fingerprint(src)
            if now != self.manifest["fingerprint"]:
                raise DatasetError(
                    f"{src} changed since it was prepared into {self.folder} (source fingerprint "
                    f"{self.manifest['fingerprint'][:16]} then, {now[:16]} now).",
                    f"prepare it again into a new folder (or delete {self.folder} first).")
        link = files.find_link(self.folder)
        if link is not None:  # a shard is read from this folder only, never through a link to elsewhere
            raise DatasetError(f"{link} is a symbolic link; a prepared folder is read from its own files only.",
                               f"prepare again into a new folder: python -m workbench.data prepare SRC {self.folder}.")
        self.chat = self.manifest.get("mode") == "chat"  # conversations: owner bytes beside the tokens (`owners`)
        self.tokens, ends, self._crc, self._checked, self._maps = [], [], [], [], []
        sdir = self.folder / "shards"
        for i, s in enumerate(self.manifest["shards"]):
            crcs = {}
            for kind, meta in s["files"].items():  # every file of the shard, with its crc file
                f = sdir / f"{s['name']}.{kind}"
                self._sized(f, meta["bytes"])
                self._sized(Path(f"{f}.crc"), -(-meta["bytes"] // BLOCK_BYTES) * 4)
                crcs[kind] = np.frombuffer(read_bytes(f"{f}.crc"), dtype=np.uint32)
            self._crc.append(crcs)
            self._checked.append({kind: np.zeros(len(c), dtype=bool) for kind, c in crcs.items()})
            t, d = sdir / f"{s['name']}.tokens", sdir / f"{s['name']}.docs"
            self._maps.append(_map_tokens(t) if s["tokens"] else None)
            self.tokens.append(np.frombuffer(self._maps[-1], dtype=np.uint32) if s["tokens"] else
                               np.zeros(0, dtype=np.uint32))
            raw = read_bytes(d)
            self.check_blocks(i, "docs", 0, len(raw), raw)  # the whole document index, now
            e = np.frombuffer(raw, dtype=np.int64)
            if len(e) and (e[0] < 1 or e[-1] != s["tokens"] or bool(np.any(e[1:] <= e[:-1]))):
                raise DatasetError(f"shard {d} is corrupt: its document ends must rise from 1 to the shard's "
                                   f"{s['tokens']:,} tokens (first {int(e[0]):,}, last {int(e[-1]):,}).",
                                   f"prepare again: python -m workbench.data prepare SRC {self.folder}.")
            ends.append(e)
        self.shard_docs = np.cumsum([0] + [len(e) for e in ends])  # global index of each shard's first document
        self._starts = [np.concatenate([[0], e[:-1]]) for e in ends]
        self.lengths = np.concatenate([np.diff(e, prepend=0) for e in ends]) if ends else np.zeros(0, np.int64)

    def _sized(self, f: Path, want: int) -> None:
        """Refuses a shard file that is missing, not a regular file, or not of the size the manifest says."""
        have = f.stat().st_size if f.is_file() else 0
        if not f.is_file() or have != want:
            raise DatasetError(f"shard {f} is truncated or missing ({have:,} bytes, the manifest says {want:,}).",
                               f"prepare again: python -m workbench.data prepare SRC {self.folder}.")

    def __len__(self) -> int:
        return len(self.lengths)

    def _locate(self, i: int) -> tuple[int, int]:
        """(shard, offset in its tokens) of document i."""
        s = int(np.searchsorted(self.shard_docs, i, side="right")) - 1
        return s, int(self._starts[s][i - self.shard_docs[s]])

    def document(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Tokens [start, stop) of document i (its <|endoftext|> included at the end), as a read-only view."""
        s, base = self._locate(i)
        stop = int(self.lengths[i]) if stop is None else stop
        self._verify(s, base + start, base + stop)
        return self.tokens[s][base + start:base + stop]

    def copy_into(self, out: np.ndarray, i: int, start: int, stop: int) -> None:
        """Copies tokens [start, stop) of document i into `out` through the memory map, then unmaps the pages it
        touched from this process (MADV_DONTNEED; the kernel's page cache keeps them): what a rank has read never
        counts in its RSS, however long the run and however large the dataset. The unmapped span is widened to
        `UNMAP_ALIGN` boundaries: a read fault also maps the cached pages around it (the kernel's fault-around)."""
        s, base = self._locate(i)
        self._verify(s, base + start, base + stop)
        out[:] = self.tokens[s][base + start:base + stop]
        first = (base + start) * 4 // UNMAP_ALIGN * UNMAP_ALIGN
        end = min(-(-(base + stop) * 4 // UNMAP_ALIGN) * UNMAP_ALIGN, len(self._maps[s]))
        self._maps[s].madvise(mmap.MADV_DONTNEED, first, end - first)

    def owners(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Owner bytes [start, stop) of conversation i (one per token; `workbench.data.chat`), crc-checked."""
        s, base = self._locate(i)
        stop = int(self.lengths[i]) if stop is None else stop
        self.check_blocks(s, "mask", base + start, base + stop)
        with files.open_regular(self.folder / "shards" / f"{self.manifest['shards'][s]['name']}.mask") as f:
            return np.frombuffer(os.pread(f.fileno(), stop - start, base + start), dtype=np.uint8)

    def _verify(self, s: int, a: int, b: int) -> None:
        """The blocks of shard s's tokens that tokens [a, b) touch (`check_blocks`)."""
        self.check_blocks(s, "tokens", 4 * a, 4 * b)

    def check_blocks(self, s: int, kind: str, a: int, b: int, data: bytes | None = None) -> None:
        """The crc of every 64 KiB block of shard s's `kind` file ("tokens", "docs", ...) that bytes [a, b) touch,
        once per block (and for tokens, their ids below the vocabulary): read with pread, not through the map, so a
        check maps nothing into this process; `data` = the file's bytes, where they were read already.

        Raises:
            DatasetError: naming the file and the block.
        """
        name = self.manifest["shards"][s]["name"]
        path = self.folder / "shards" / f"{name}.{kind}"
        checked, crcs = self._checked[s][kind], self._crc[s][kind]
        for blk in range(a // BLOCK_BYTES, (b - 1) // BLOCK_BYTES + 1 if b > a else 0):
            if checked[blk]:
                continue
            if data is None:
                with files.open_regular(path) as f:
                    chunk = os.pread(f.fileno(), BLOCK_BYTES, blk * BLOCK_BYTES)
            else:
                chunk = data[blk * BLOCK_BYTES:(blk + 1) * BLOCK_BYTES]
            fix = f"prepare again: delete {self.folder} and run python -m workbench.data prepare SRC {self.folder}."
            if zlib.crc32(chunk) != int(crcs[blk]):
                tokens = f", tokens {blk * BLOCK_TOKENS:,}+" if kind == "tokens" else ""
                raise DatasetError(f"shard {path} is corrupt: checksum mismatch in block {blk} (bytes "
                                   f"{blk * BLOCK_BYTES:,}+{tokens}).", fix)
            ids = np.frombuffer(chunk, dtype=np.uint32) if kind == "tokens" else None
            if ids is not None and ids.size and int(ids.max()) >= self.manifest["vocab_size"]:
                at = blk * BLOCK_TOKENS + int(np.argmax(ids >= self.manifest["vocab_size"]))
                raise DatasetError(f"shard {path} holds token id {int(ids.max()):,} (token {at:,}), outside the "
                                   f"tokenizer's vocabulary of {self.manifest['vocab_size']:,} ids.", fix)
            checked[blk] = True

    def verify(self) -> None:
        """Checks every file of every shard against the manifest (sha256), its crc file, and the token ids against
        the vocabulary (the whole dataset is read).

        Raises:
            DatasetError: naming the first file that does not match.
        """
        fix = f"delete {self.folder} and prepare again."
        for i, s in enumerate(self.manifest["shards"]):
            for kind, meta in s["files"].items():
                f = self.folder / "shards" / f"{s['name']}.{kind}"
                crcs, got = digest(f)
                if got != meta:
                    raise DatasetError(f"shard {f} is corrupt: its sha256 does not match the manifest.", fix)
                if read_bytes(f"{f}.crc") != crcs:
                    raise DatasetError(f"{f}.crc is corrupt: its block checksums do not match {f.name}.", fix)
                self.check_blocks(i, kind, 0, meta["bytes"])


__all__ = ["PreparedDataset", "fingerprint", "is_prepared"]

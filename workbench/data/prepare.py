"""Tokenize a dataset once into memory-mapped shards; read it back with `Prepared`.

    python -m workbench.data prepare SRC OUT [--workers N] [--strict] [--text-field text] [--tokenizer DIR] [--chat]

A prepared folder::

    OUT/plan.json                 what is being prepared (source fingerprint, tokenizer hash, text field, shards)
    OUT/shards/00000.tokens       uint32 token ids: every document's tokens followed by <|endoftext|>
    OUT/shards/00000.docs         int64 end offset of each document in the shard's tokens
    OUT/shards/00000.crc          uint32 crc32 of each 64 KiB block of the tokens (checked on first read)
    OUT/shards/00000.mask         conversations only: one owner byte per token (`workbench.data.chat`)
    OUT/shards/00000.mask.crc     uint32 crc32 of the mask's block of each 64 KiB block of tokens
    OUT/shards/00000.json         the shard's record (counts, bad rows, sha256 of .tokens and .docs): it is done
    OUT/manifest.json             the commit point, written last (atomic rename): the folder is complete

Only a folder with a manifest is ever read. A re-run on the same input does nothing; a run killed at any moment
(kill -9 included) resumes: finished shards are verified against their sha256 and kept, the rest redone. One
prepare at a time holds `OUT/.lock` (an flock the kernel drops when the process dies); a second one is refused,
or, for the training cache (`wait=True`), waits for the first and then finds the folder done.

Shards are prepared in parallel by `--workers` processes (default: every core), each reading its own part of the
source. Documents longer than `CHUNK_CHARS` characters are tokenized in pieces cut at whitespace, so memory stays
near the size of the text (a 50 MB single-line document would need ~8 GiB tokenized whole); documents over
`MAX_DOCUMENT_BYTES` are refused.

Conversations (`--chat`, or auto-detected when the first row has `messages` or `prompt` and `completion` and no text
field): each row is rendered whole by the tokenizer's chat template (`workbench.data.chat`), stored without a
separator, with its owner bytes in the `.mask` file beside the tokens. The stop audit: every assistant turn has its
closing `<|im_end|>` owned as trained, counted per shard and checked again in the manifest, else prepare refuses.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import json
import mmap
import multiprocessing as mp
import os
import queue
import shutil
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from workbench.core.errors import DatasetError
from workbench.data import BUNDLED, DOC_SEPARATOR, document_sources, source_root, tokenizer_dir, tokenizer_hash
from workbench.data.sources import plan_units, read_unit

FORMAT = 2  # bumped whenever the folder's layout or manifest changes
SHARD_BYTES = 16 << 20  # source bytes per shard: small enough to spread over workers, large enough to be cheap
BLOCK_TOKENS = 16384  # 64 KiB of uint32: the unit of the read-time crc check
UNMAP_ALIGN = 1 << 20  # what a read unmaps is widened to these boundaries (> Linux's 64 KiB fault-around window)
CHUNK_CHARS = 1_000_000  # longer documents are tokenized in pieces of about this many characters
MAX_DOCUMENT_BYTES = 512 << 20  # a longer document is refused (its text alone would have to sit in memory)
BATCH_CHARS = 1 << 20  # characters per encode_batch call
BAD_EXAMPLES = 5  # bad-row locations kept per shard (and in the manifest)
CHAT_BATCH = 256  # conversations rendered, then tokenized together


# ------------------------------------------------------------------------------------------------
# Identity of a preparation
# ------------------------------------------------------------------------------------------------


def fingerprint(dataset: str) -> str:
    """sha256 over the source files' relative paths, sizes and modification times (no content read)."""
    root = source_root(dataset)
    h = hashlib.sha256()
    for _, f in document_sources(dataset):
        st = f.stat()
        h.update(f"{f.relative_to(root) if root.is_dir() else f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def is_prepared(path: str | Path) -> bool:
    """A folder made by `prepare` (complete or not): it has a plan or a manifest."""
    p = Path(path)
    return p.is_dir() and ((p / "manifest.json").is_file() or (p / "plan.json").is_file())


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Lock:
    """An exclusive flock on OUT/.lock (released by the kernel if the holder dies)."""

    def __init__(self, out: Path, wait: bool, say):
        out.mkdir(parents=True, exist_ok=True)
        self.f = (out / ".lock").open("a+")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.f.seek(0)
            holder = self.f.read().strip() or "another process"
            if not wait:
                self.f.close()
                raise DatasetError(f"{out} is being prepared by {holder} right now; a second prepare into the same "
                                   "folder is refused.", "wait for it to finish, or prepare into another folder."
                                   ) from None
            say(f"waiting for {holder}, which is preparing {out}")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        self.f.seek(0)
        self.f.truncate()
        self.f.write(f"pid {os.getpid()}")
        self.f.flush()

    def release(self) -> None:
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


# ------------------------------------------------------------------------------------------------
# Preparing
# ------------------------------------------------------------------------------------------------


def prepare(src: str, out: str | Path, *, workers: int = 0, strict: bool = False, text_field: str = "text",
            tokenizer_path: str = "", shard_bytes: int = SHARD_BYTES, wait: bool = False, progress: bool = True,
            say=None, chat: bool | None = None) -> dict:
    """Tokenizes `src` into the prepared folder `out` (see the module docstring) and returns its manifest.

    Args:
        src: "shakespeare", or a path to .txt/.md files or folders, .jsonl, .parquet, or .arrow files (a Hugging
            Face `datasets` save_to_disk folder).
        out: the prepared folder.
        workers: processes (0 = every core).
        strict: refuse a bad row instead of skipping it.
        text_field: key / column of the text in jsonl, parquet and arrow rows.
        tokenizer_path: tokenizer directory ("" = bundled Qwen3).
        shard_bytes: source bytes per shard.
        wait: if another process is preparing `out`, wait for it (the training cache) instead of refusing.
        progress: show a progress bar (tokens/s, ETA) on stderr.
        say: where one-line notes go (default: stderr).
        chat: rows are conversations (True), documents (False), or whichever the first row is (None).

    Raises:
        DatasetError: a missing or empty source, a bad row with `strict`, an over-long document, a dataset without
            text, a folder being prepared by another process, or a folder prepared from another source.
    """
    say = say or (lambda m: print(f"workbench data: {m}", file=sys.stderr, flush=True))
    out = Path(out)
    src_root = source_root(src)
    if chat is None:
        from workbench.data.chat import detect

        chat = detect(src, text_field)
    identity = {"format": FORMAT, "source": src if src in BUNDLED else os.path.abspath(src_root),
                "fingerprint": fingerprint(src), "tokenizer_sha256": tokenizer_hash(tokenizer_path),
                "text_field": text_field, "mode": "chat" if chat else "text"}
    done = _complete(out, identity)
    if done:
        return done
    lock = _Lock(out, wait, say)
    try:
        done = _complete(out, identity)  # the process we waited for may have finished it
        if done:
            return done
        return _prepare_locked(src, out, identity, workers, strict, text_field, tokenizer_path, shard_bytes,
                               progress, say)
    finally:
        lock.release()


def _complete(out: Path, identity: dict) -> dict | None:
    """The manifest of `out` if it is complete for `identity`; refuses one complete for another input."""
    m = out / "manifest.json"
    if not m.is_file():
        return None
    manifest = json.loads(m.read_text())
    for key, what in (("format", "format version"), ("text_field", "text field"), ("tokenizer_sha256", "tokenizer"),
                      ("fingerprint", "source fingerprint"), ("source", "source"), ("mode", "mode (text or chat)")):
        if manifest.get(key, "text" if key == "mode" else None) != identity[key]:
            raise DatasetError(
                f"{out} was prepared with another {what} ({manifest.get(key)!r}, now {identity[key]!r}): "
                + ("the source changed since prepare." if key == "fingerprint" else "it is another dataset."),
                f"delete {out} and prepare again, or prepare into a new folder.")
    return manifest


def _prepare_locked(src, out, identity, workers, strict, text_field, tokenizer_path, shard_bytes, progress, say):
    chat = identity["mode"] == "chat"
    units = plan_units(src, None if chat else text_field, shard_bytes)
    shards, acc = [], []
    for u in units:  # consecutive units up to shard_bytes: a shard is a run of documents in the fixed order
        acc.append(u)
        if sum(a["bytes"] for a in acc) >= shard_bytes:
            shards.append(acc)
            acc = []
    if acc:
        shards.append(acc)
    plan = {**identity, "shard_bytes": shard_bytes, "shards": shards}
    sdir = out / "shards"
    plan_file = out / "plan.json"
    if plan_file.is_file() and json.loads(plan_file.read_text()) != plan:
        shutil.rmtree(sdir, ignore_errors=True)  # an unfinished preparation of another input: start over
    sdir.mkdir(parents=True, exist_ok=True)
    _atomic_write(plan_file, json.dumps(plan, indent=1))

    records: dict[int, dict] = {}
    for i in range(len(shards)):
        rec = _verified_record(sdir, i)
        if rec is not None:
            records[i] = rec
    pending = [i for i in range(len(shards)) if i not in records]
    total = sum(u["bytes"] for s in shards for u in s)
    if records:
        say(f"resuming {out}: {len(records)} of {len(shards)} shards done and verified")
    workers = min(workers or os.cpu_count() or 1, max(len(pending), 1))
    job = {"tokenizer": str(tokenizer_dir(tokenizer_path) / "tokenizer.json"), "text_field": text_field,
           "strict": strict, "dir": str(sdir), "chat": chat}
    bar = _Progress(total, sum(u["bytes"] for i in records for u in shards[i]), progress)
    try:
        if workers <= 1:
            _init_worker(job, None)  # in this process (tokenizers may use every core for a batch here)
            for i in pending:
                records[i] = _check(_prepare_shard((i, shards[i]), bar.add))
        else:
            ctx = mp.get_context("fork")  # no re-import of the parent's modules (spawn would import torch)
            q = ctx.Queue()
            with ctx.Pool(workers, initializer=_init_worker, initargs=({**job, "one_thread": True}, q)) as pool:
                results = [pool.apply_async(_prepare_shard, ((i, shards[i]),)) for i in pending]
                while not all(r.ready() for r in results):
                    try:
                        bar.add(*q.get(timeout=0.2))
                    except queue.Empty:
                        pass
                for i, r in zip(pending, results, strict=True):
                    records[i] = _check(r.get())
    finally:
        bar.close()
    return _commit(out, plan, [records[i] for i in range(len(shards))], say)


def _check(record: dict) -> dict:
    if "error" in record:
        raise DatasetError(record["error"], record["fix"])
    return record


def _commit(out: Path, plan: dict, records: list[dict], say) -> dict:
    counts = {k: sum(r[k] for r in records) for k in ("documents", "tokens", "text_documents", "bad_rows")}
    chat = plan["mode"] == "chat"
    if chat:
        from workbench.data.chat import audit

        counts |= audit(records, plan["source"])
    bad = [b for r in records for b in r["bad_examples"]][:BAD_EXAMPLES]
    if counts["documents"] == 0:
        where = f" (first: {'; '.join(bad)})" if bad else ""
        raise DatasetError(f"{plan['source']}: no documents: {counts['bad_rows']} bad row(s){where}.",
                           "point training.dataset at documents with text.")
    first_text, before = -1, 0  # global index of the first document with text (-1: none)
    for r in records:
        if first_text < 0 and r["first_text"] >= 0:
            first_text = before + r["first_text"]
        before += r["documents"]
    counts["first_text_document"] = first_text
    manifest = {k: plan[k] for k in ("format", "source", "fingerprint", "tokenizer_sha256", "text_field", "mode")}
    manifest |= {**counts, "bad_examples": bad, "separator": None if chat else DOC_SEPARATOR, "dtype": "uint32",
                 "shards": [{k: r[k] for k in ("name", "documents", "tokens", "sha256")} for r in records]}
    _atomic_write(out / "manifest.json", json.dumps(manifest, indent=1))
    line = f"prepared {out}: {counts['documents']:,} {'conversations' if chat else 'documents'}, " \
           f"{counts['tokens']:,} tokens, {len(records)} shards"
    if chat:
        line += f"; stop audit: {counts['trained_ends']:,} trained <|im_end|> = {counts['assistant_turns']:,} " \
                "assistant turns"
    if counts["bad_rows"]:
        kinds = counts.get("bad_kinds")
        line += f"; skipped {counts['bad_rows']:,} bad row(s)" + (
            f" ({', '.join(f'{n:,} {k}' for k, n in kinds.items())})" if kinds else "") + f", first: {'; '.join(bad)}"
    say(line)
    return manifest


class _Progress:
    """tqdm over source bytes, with tokens/s in the postfix (ETA from the bytes)."""

    def __init__(self, total: int, done: int, show: bool):
        self.bar = None
        self.t0, self.tokens = time.perf_counter(), 0
        if show:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc="prepare", file=sys.stderr,
                            mininterval=0.5)

    def add(self, nbytes: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(nbytes)
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_WORKER: dict = {}


def _init_worker(job: dict, q) -> None:
    if job.get("one_thread"):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: `--workers` is the parallelism
    st = Path(job["tokenizer"]).stat()
    tok = _tokenizer(job["tokenizer"], st.st_size, st.st_mtime_ns)
    _WORKER.update(job, tok=tok, sep=tok.token_to_id(DOC_SEPARATOR), queue=q)
    if job.get("chat"):
        from workbench.data.chat import hf_tokenizer

        _WORKER["hf"] = hf_tokenizer(Path(job["tokenizer"]).parent)
    if _WORKER["sep"] is None:
        raise ValueError(f"The tokenizer has no {DOC_SEPARATOR!r} token to separate documents.")


@functools.cache
def _tokenizer(path: str, size: int, mtime_ns: int):
    """The tokenizer of a tokenizer.json, loaded once per process (size and mtime in the key)."""
    from tokenizers import Tokenizer

    del size, mtime_ns
    return Tokenizer.from_file(path)


def _split(text: str) -> list[str]:
    """Pieces of about CHUNK_CHARS characters, each cut before a space that follows a non-space (where the
    tokenizer's pre-tokenizer starts a new word anyway), or hard if there is none."""
    pieces, start = [], 0
    while len(text) - start > CHUNK_CHARS:
        cut = start + CHUNK_CHARS
        while cut < min(len(text), start + 2 * CHUNK_CHARS) and not (text[cut] == " " and not text[cut - 1].isspace()):
            cut += 1
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _prepare_shard(task: tuple[int, list], report=None) -> dict:
    """Tokenizes one shard into its files and writes its record last; returns the record (or an error).

    `report(source_chars, tokens)` is called as it goes (in a pool: through the progress queue)."""
    i, units = task
    w = _WORKER
    send = report or (lambda b, t: w["queue"].put((b, t)))
    reported = 0

    def report(chars: int, tokens: int) -> None:  # characters as they go; the bar counts source bytes
        nonlocal reported
        reported += chars
        send(chars, tokens)
    sdir = Path(w["dir"])
    name = f"{i:05d}"
    tok, sep, field = w["tok"], w["sep"], w["text_field"]
    ends: list[int] = []
    n_tokens = text_docs = bad = 0
    first_text = -1  # the shard's first document with text
    bad_examples: list[str] = []
    batch: list = []
    batch_chars = 0
    chat = w.get("chat")
    talk = {"assistant_turns": 0, "trained_ends": 0, "bad_kinds": {}}  # conversations: the stop audit's counts
    tmp = sdir / f"{name}.tokens.tmp"
    with tmp.open("wb") as f, (sdir / f"{name}.mask.tmp").open("wb") if chat else open(os.devnull, "wb") as mask:

        def skip(where: str, reason: str, kind: str = "") -> dict | None:
            """Counts a bad row, or (strict) returns the error that refuses it."""
            nonlocal bad
            if w["strict"]:
                return {"error": f"bad row {where}: {reason} (prepare --strict).",
                        "fix": "fix or remove that row, or prepare without --strict to skip bad rows."}
            bad += 1
            if kind:
                talk["bad_kinds"][kind] = talk["bad_kinds"].get(kind, 0) + 1
            if len(bad_examples) < BAD_EXAMPLES:
                bad_examples.append(f"{where} ({reason})")
            return None

        def flush_chat() -> dict | None:
            """Renders the batch of conversations and writes their tokens and owner bytes."""
            nonlocal n_tokens, first_text, text_docs
            from workbench.data.chat import BadConversation, render

            try:
                rendered = render(w["hf"], [row for _, row in batch])
            except ValueError as e:  # the stop audit: a template this reader does not understand
                return {"error": f"{batch[0][0]}..: {e}.", "fix": "train with a Qwen3-style chat template "
                        "(tokenizer_config.json chat_template), or report the template."}
            chars = tokens = 0
            for (where, _), r in zip(batch, rendered, strict=True):
                if isinstance(r, BadConversation):
                    if err := skip(where, str(r), r.kind):
                        return err
                    continue
                r.ids.tofile(f)
                r.owners.tofile(mask)
                n_tokens += len(r.ids)
                tokens += len(r.ids)
                chars += r.chars
                first_text = len(ends) if first_text < 0 else first_text
                text_docs += 1
                ends.append(n_tokens)
                talk["assistant_turns"] += r.assistant_turns
                talk["trained_ends"] += r.trained_ends
            report(chars, tokens)
            batch.clear()
            return None

        def flush() -> None:
            nonlocal n_tokens, batch_chars
            if not batch:
                return
            tokens = 0
            for enc in tok.encode_batch(batch, add_special_tokens=False):
                ids = np.asarray(enc.ids + [sep], dtype=np.uint32)
                ids.tofile(f)
                tokens += len(ids)
                n_tokens += len(ids)
                ends.append(n_tokens)
            report(batch_chars, tokens)
            batch.clear()
            batch_chars = 0

        for unit in units:
            for where, text, reason in read_unit(unit, None if chat else field):
                if text is None:
                    if err := skip(where, reason, "unreadable" if chat else ""):
                        return err
                    continue
                if chat:
                    batch.append((where, text))
                    if len(batch) >= CHAT_BATCH and (err := flush_chat()):
                        return err
                    continue
                if len(text) > MAX_DOCUMENT_BYTES:
                    return {"error": f"{where}: a document of {len(text):,} characters is over the limit of "
                                     f"{MAX_DOCUMENT_BYTES:,}.", "fix": "split it into smaller documents."}
                if text.replace(DOC_SEPARATOR, "").strip():
                    first_text = len(ends) if first_text < 0 else first_text
                    text_docs += 1
                if len(text) > CHUNK_CHARS:  # bounded memory: pieces, written as they are tokenized
                    flush()
                    for piece in _split(text):
                        ids = np.asarray(tok.encode(piece, add_special_tokens=False).ids, dtype=np.uint32)
                        ids.tofile(f)
                        n_tokens += len(ids)
                        report(len(piece), len(ids))
                    np.asarray([sep], dtype=np.uint32).tofile(f)
                    n_tokens += 1
                    ends.append(n_tokens)
                    continue
                batch.append(text)
                batch_chars += len(text)
                if batch_chars >= BATCH_CHARS:
                    flush()
        if chat and batch and (err := flush_chat()):
            return err
        flush()
        for g in (f, mask) if chat else (f,):
            g.flush()
            os.fsync(g.fileno())
    if chat:
        os.replace(sdir / f"{name}.mask.tmp", sdir / f"{name}.mask")
    np.asarray(ends, dtype=np.int64).tofile(sdir / f"{name}.docs.tmp")
    os.replace(sdir / f"{name}.docs.tmp", sdir / f"{name}.docs")
    os.replace(tmp, sdir / f"{name}.tokens")
    send(max(sum(u["bytes"] for u in units) - reported, 0), 0)  # the rest of the shard's bytes (JSON, escapes)
    crc, sha = _scan(sdir, name)
    crc.tofile(sdir / f"{name}.crc")
    if chat:
        _block_crcs(sdir / f"{name}.mask", BLOCK_TOKENS).tofile(sdir / f"{name}.mask.crc")
    record = {"name": name, "documents": len(ends), "tokens": n_tokens, "text_documents": text_docs,
              "first_text": first_text, "bad_rows": bad, "bad_examples": bad_examples, "sha256": sha}
    if chat:
        record |= talk
    _atomic_write(sdir / f"{name}.json", json.dumps(record))  # the shard is done only now
    return record


def _scan(sdir: Path, name: str) -> tuple[np.ndarray, str]:
    """crc32 of every 64 KiB block of the tokens, and one sha256 over the tokens, the document index, then the
    owner bytes of a conversation shard."""
    h, crcs = hashlib.sha256(), []
    with (sdir / f"{name}.tokens").open("rb") as f:
        while block := f.read(BLOCK_TOKENS * 4):
            crcs.append(zlib.crc32(block))
            h.update(block)
    h.update((sdir / f"{name}.docs").read_bytes())
    if (mask := sdir / f"{name}.mask").is_file():
        h.update(mask.read_bytes())
    return np.asarray(crcs, dtype=np.uint32), h.hexdigest()


def _block_crcs(path: Path, block_bytes: int) -> np.ndarray:
    """crc32 of every `block_bytes` block of a file."""
    crcs = []
    with path.open("rb") as f:
        while block := f.read(block_bytes):
            crcs.append(zlib.crc32(block))
    return np.asarray(crcs, dtype=np.uint32)


def _map_tokens(path: Path) -> mmap.mmap:
    """A shard's tokens mapped read-only, advised random access: rows are read in a shuffled order, so the kernel
    reads ahead nothing into this process."""
    with path.open("rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mm.madvise(mmap.MADV_RANDOM)
    return mm


def _verified_record(sdir: Path, i: int) -> dict | None:
    """The record of a finished shard whose files still match its sha256; None (redo it) otherwise."""
    name = f"{i:05d}"
    rec_file = sdir / f"{name}.json"
    if not rec_file.is_file() or not (sdir / f"{name}.tokens").is_file() or not (sdir / f"{name}.docs").is_file():
        return None
    rec = json.loads(rec_file.read_text())
    return rec if _scan(sdir, name)[1] == rec["sha256"] else None


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------


class Prepared:
    """A complete prepared folder, memory-mapped: documents by global index, in the source's fixed order.

    Opening reads the manifest and the document index (8 bytes per document), never the tokens; token blocks are
    crc-checked the first time this process reads them.

    Raises:
        DatasetError: not a prepared folder, an unfinished one, another tokenizer (both hashes named), a source
            changed since prepare (the fingerprints named), a truncated shard or a corrupt one (the shard named).
    """

    def __init__(self, folder: str | Path, tokenizer_path: str | None = "", check_source: bool = True):
        self.folder = Path(folder)
        m = self.folder / "manifest.json"
        if not m.is_file():
            state = "was never finished (the prepare was interrupted)" if (self.folder / "plan.json").is_file() \
                else "is not a prepared dataset"
            raise DatasetError(f"{self.folder} {state}.", "run python -m workbench.data prepare SRC "
                               f"{self.folder} (it resumes where it stopped).")
        self.manifest = json.loads(m.read_text())
        if self.manifest.get("format") != FORMAT:
            raise DatasetError(f"{self.folder} has prepared-data format {self.manifest.get('format')}; this "
                               f"workbench reads format {FORMAT}.", f"delete {self.folder} and prepare again.")
        if tokenizer_path is not None and (want := tokenizer_hash(tokenizer_path)) != self.manifest["tokenizer_sha256"]:
            raise DatasetError(
                f"{self.folder} was prepared with tokenizer sha256 {self.manifest['tokenizer_sha256'][:16]}, but "
                f"model.tokenizer_path={tokenizer_path or '(bundled Qwen3)'!r} has sha256 {want[:16]}.",
                "prepare the dataset again with this tokenizer (--tokenizer), or train with the one that made it.")
        src = self.manifest["source"]
        if check_source and (src == "shakespeare" or Path(src).exists()):
            now = fingerprint(src)
            if now != self.manifest["fingerprint"]:
                raise DatasetError(
                    f"{src} changed since it was prepared into {self.folder} (source fingerprint "
                    f"{self.manifest['fingerprint'][:16]} then, {now[:16]} now).",
                    f"prepare it again into a new folder (or delete {self.folder} first).")
        self.chat = self.manifest.get("mode") == "chat"  # conversations: owner bytes beside the tokens
        self.tokens, ends, self._maps = [], [], []
        self._crc: dict[str, list] = {"tokens": [], "mask": []}
        self._checked: dict[str, list] = {"tokens": [], "mask": []}
        sdir = self.folder / "shards"
        for s in self.manifest["shards"]:
            t, d = sdir / f"{s['name']}.tokens", sdir / f"{s['name']}.docs"
            sizes = ((t, s["tokens"] * 4), (d, s["documents"] * 8)) + ((sdir / f"{s['name']}.mask", s["tokens"]),) * \
                self.chat
            for f, want in sizes:
                if not f.is_file() or f.stat().st_size != want:
                    raise DatasetError(f"shard {f} is truncated or missing ({f.stat().st_size if f.is_file() else 0:,} "
                                       f"bytes, the manifest says {want:,}).",
                                       f"prepare again: python -m workbench.data prepare SRC {self.folder}.")
            self._maps.append(_map_tokens(t) if s["tokens"] else None)
            self.tokens.append(np.frombuffer(self._maps[-1], dtype=np.uint32) if s["tokens"] else
                               np.zeros(0, dtype=np.uint32))
            ends.append(np.fromfile(d, dtype=np.int64))
            for what, crc_file in (("tokens", f"{s['name']}.crc"), ("mask", f"{s['name']}.mask.crc"))[:1 + self.chat]:
                self._crc[what].append(np.fromfile(sdir / crc_file, dtype=np.uint32))
                self._checked[what].append(np.zeros(len(self._crc[what][-1]), dtype=bool))
        self.shard_docs = np.cumsum([0] + [len(e) for e in ends])  # global index of each shard's first document
        self._starts = [np.concatenate([[0], e[:-1]]) for e in ends]
        self.lengths = np.concatenate([np.diff(e, prepend=0) for e in ends]) if ends else np.zeros(0, np.int64)

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
        self._verify(s, base + start, base + stop, "mask")
        with (self.folder / "shards" / f"{self.manifest['shards'][s]['name']}.mask").open("rb") as f:
            return np.frombuffer(os.pread(f.fileno(), stop - start, base + start), dtype=np.uint8)

    def _verify(self, s: int, a: int, b: int, what: str = "tokens") -> None:
        """The crc of every block of shard s (64 KiB of tokens, or their owner bytes: `what` = "mask") that tokens
        [a, b) touch, once per block: read with pread, not through the map, so a check maps nothing into this
        process."""
        width = 4 if what == "tokens" else 1
        for blk in range(a // BLOCK_TOKENS, (b - 1) // BLOCK_TOKENS + 1 if b > a else 0):
            if not self._checked[what][s][blk]:
                name = self.manifest["shards"][s]["name"]
                with (self.folder / "shards" / f"{name}.{what}").open("rb") as f:
                    data = os.pread(f.fileno(), BLOCK_TOKENS * width, blk * BLOCK_TOKENS * width)
                if zlib.crc32(data) != int(self._crc[what][s][blk]):
                    raise DatasetError(
                        f"shard {self.folder / 'shards' / name}.{what} is corrupt: checksum mismatch in block {blk} "
                        f"(tokens {blk * BLOCK_TOKENS:,}+).",
                        f"prepare again: delete {self.folder} and run python -m workbench.data prepare SRC "
                        f"{self.folder}.")
                self._checked[what][s][blk] = True

    def verify(self) -> None:
        """Checks every shard's sha256 against the manifest (the whole dataset is read).

        Raises:
            DatasetError: naming the first shard that does not match.
        """
        for s in self.manifest["shards"]:
            if _scan(self.folder / "shards", s["name"])[1] != s["sha256"]:
                raise DatasetError(f"shard {self.folder / 'shards' / s['name']}.tokens is corrupt: its sha256 "
                                   "does not match the manifest.", f"delete {self.folder} and prepare again.")


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from workbench.core.errors import WorkbenchError

    parser = argparse.ArgumentParser(prog="python -m workbench.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize SRC once into the prepared folder OUT")
    p.add_argument("src", help="'shakespeare', or .txt/.md files or folders, .jsonl, .parquet, a save_to_disk folder")
    p.add_argument("out", help="the prepared folder (training.dataset = OUT)")
    p.add_argument("--workers", type=int, default=0, help="processes (default: every core)")
    p.add_argument("--strict", action="store_true", help="refuse bad rows instead of skipping them")
    p.add_argument("--text-field", default="text", help="key / column of the text (default: text)")
    p.add_argument("--tokenizer", default="", help="tokenizer directory (default: the bundled Qwen3)")
    p.add_argument("--shard-mb", type=float, default=SHARD_BYTES / 2**20, help="source MiB per shard (default 16)")
    p.add_argument("--chat", action="store_true", default=None,
                   help="rows are conversations (default: when the first row has 'messages' or prompt/completion)")
    v = sub.add_parser("verify", help="check every shard of OUT against its sha256")
    v.add_argument("out")
    sub.add_parser("inspect", help="print training rows of OUT with the trained tokens highlighted (see python -m "
                   "workbench.data inspect --help)")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.src, args.out, workers=args.workers, strict=args.strict, text_field=args.text_field,
                    tokenizer_path=args.tokenizer, shard_bytes=max(int(args.shard_mb * 2**20), 1), chat=args.chat)
        else:
            Prepared(args.out, tokenizer_path=None, check_source=False).verify()
            print(f"workbench data: {args.out}: every shard matches its sha256")
    except (WorkbenchError, FileNotFoundError) as e:
        print(e.one_line() if isinstance(e, WorkbenchError) else f"workbench: data error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    return 0

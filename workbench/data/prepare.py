"""Tokenize a dataset once into memory-mapped shards; read it back with `workbench.data.prepared.PreparedDataset`.

    python -m workbench.data prepare SRC OUT [--workers N] [--strict] [--text-field text] [--tokenizer DIR] [--chat]

A prepared folder::

    OUT/recipe.json               what is being prepared (source fingerprint, tokenizer hash, text field, shards)
    OUT/shards/00000.tokens       uint32 token ids: every document's tokens followed by <|endoftext|>
    OUT/shards/00000.docs         int64 end offset of each document in the shard's tokens
    OUT/shards/00000.tokens.crc   uint32 crc32 of each 64 KiB block of .tokens (checked on first read), and the
    OUT/shards/00000.docs.crc     same for every other side file of a shard (`SHARD_FILES`): .docs at open
    OUT/shards/00000.mask         conversations only: one owner byte per token (`workbench.data.chat`), with its .crc
    OUT/shards/00000.json         the shard's record (counts, bad rows, bytes and sha256 of each file): it is done
    OUT/manifest.json             the commit point, written last (atomic rename): the folder is complete

Only a folder with a manifest is ever read, and what it says is checked before it is used: the manifest against
`manifest.MANIFEST` (types, ranges, shard names that stay in the folder), each file's size, the crc of every block
as it is first read, document ends that rise to the shard's token count, token ids below the vocabulary.

A re-run on the same input does nothing; a run killed at any moment (kill -9 included) resumes: finished shards are
verified against their sha256 and kept, the rest redone. One prepare at a time holds `OUT/.lock` (an flock the kernel
drops when the process dies); a second one is refused, or, for the training cache (`wait=True`), waits for the first
and then finds the folder done. `--strict` on a folder prepared without it prepares again (or refuses its bad row).

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
import contextlib
import errno
import functools
import json
import multiprocessing as mp
import os
import queue
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from workbench.core import files
from workbench.core.errors import EXIT_CHECKPOINT, DatasetError
from workbench.core.files import read_bytes, write_atomic
from workbench.core.schema import check
from workbench.data import (
    BUNDLED,
    DOC_SEPARATOR,
    TRAINING_ARGS,
    flag,
    source_root,
    tokenizer_dir,
    tokenizer_hash,
)
from workbench.data.manifest import FORMAT, RECORD, SHARD_FILES, digest, read_manifest
from workbench.data.prepared import PreparedDataset, fingerprint
from workbench.data.sources import read_unit, split_units

SHARD_BYTES = 16 << 20  # source bytes per shard: small enough to spread over workers, large enough to be cheap
CHUNK_CHARS = 1_000_000  # longer documents are tokenized in pieces of about this many characters
MAX_DOCUMENT_BYTES = 512 << 20  # a longer document is refused (its text alone would have to sit in memory)
BATCH_CHARS = 1 << 20  # characters per encode_batch call
BAD_EXAMPLES = 5  # bad-row locations kept per shard (and in the manifest)
CHAT_BATCH = 256  # conversations rendered, then tokenized together


def _lock(out: Path, wait: bool, say) -> files.FileLock:
    """The exclusive flock on OUT/.lock (released by the kernel if the holder dies); a folder holding a symbolic
    link is refused first (prepare writes there, and a link would carry a write outside it)."""
    out.mkdir(parents=True, exist_ok=True)
    link = files.find_link(out)
    if link is not None:
        raise files.LinkError(link)
    lock = files.FileLock(out / ".lock")
    if not lock.acquire():
        holder = lock.holder().decode(errors="replace").strip() or "another process"
        if not wait:
            raise DatasetError(f"{out} is being prepared by {holder} right now; a second prepare into the same "
                               "folder is refused.", "wait for it to finish, or prepare into another folder.")
        say(f"waiting for {holder}, which is preparing {out}")
        lock.acquire(wait=True)
    lock.record(f"pid {os.getpid()}")
    return lock


DISK_ERRNOS = (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EFBIG)


def _write_failed(e: OSError, out: Path) -> DatasetError:
    """One line for a folder prepare cannot write: a link or special file planted in it (exit 2), or a read-only or
    full file system (exit 4, like every disk failure)."""
    if isinstance(e, (files.LinkError, files.NotRegularError)):
        return DatasetError(f"{e}.", f"remove it, or prepare into a new folder instead of {out}.")
    error = DatasetError(f"writing {e.filename or out} failed: {e.strerror}; nothing half-written was kept.",
                         f"prepare into a writable folder with free space instead of {out}.")
    error.exit_code, error.kind = EXIT_CHECKPOINT, "disk error"
    return error


# ------------------------------------------------------------------------------------------------
# Preparing
# ------------------------------------------------------------------------------------------------


def prepare(src: str, out: str | Path, *, workers: int = 0, strict: bool = False, text_field: str = "text",
            tokenizer_path: str = "", shard_bytes: int = SHARD_BYTES, wait: bool = False, progress: bool = True,
            say=None, args: tuple[str, str] = TRAINING_ARGS, chat: bool | None = None) -> dict:
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
        args: how the user named the source and the text field, for messages (`prepare`'s command line: SRC,
            --text-field).
        chat: rows are conversations (True), documents (False), or whichever the first row is (None).

    Raises:
        DatasetError: a missing or empty source, a bad row with `strict` (also in a folder prepared before without
            it), an over-long document, a dataset without text, an unusable tokenizer, a folder being prepared by
            another process, one prepared from another source, or one that cannot be written (read-only, full, a
            link in it: exit 4 for the disk).
    """
    say = say or (lambda m: print(f"workbench data: {m}", file=sys.stderr, flush=True))
    out = Path(out)
    src_root = source_root(src, args[0])
    if chat is None:
        from workbench.data.chat import detect

        chat = detect(src, text_field)
    identity = {"format": FORMAT, "source": src if src in BUNDLED else os.path.abspath(src_root),
                "fingerprint": fingerprint(src, args[0]), "tokenizer_sha256": tokenizer_hash(tokenizer_path),
                "text_field": text_field, "mode": "chat" if chat else "text"}
    try:
        done = _complete(out, identity, strict)
        if done:
            return done
        lock = _lock(out, wait, say)
        try:
            done = _complete(out, identity, strict)  # the process we waited for may have finished it
            if done:
                return done
            return _prepare_locked(src, out, identity, workers, strict, text_field, tokenizer_path, shard_bytes,
                                   progress, say, args)
        finally:
            lock.release()
    except OSError as e:
        if isinstance(e, (files.LinkError, files.NotRegularError)) or e.errno in DISK_ERRNOS:
            raise _write_failed(e, out) from None
        raise


def _complete(out: Path, identity: dict, strict: bool = False) -> dict | None:
    """The manifest of `out` if it is complete for `identity`; refuses one complete for another input, and, with
    `strict`, one that skipped bad rows (a prepare without --strict made it)."""
    m = out / "manifest.json"
    if not m.is_file():
        return None
    manifest = read_manifest(out)
    if strict and manifest["bad_rows"]:
        raise DatasetError(f"bad row {(manifest['bad_examples'] or ['?'])[0]} (prepare --strict; {out} was prepared "
                           f"without --strict and skipped {manifest['bad_rows']:,} bad row(s)).",
                           "fix or remove that row and prepare into a new folder, or prepare without --strict.")
    for key, what in (("format", "format version"), ("text_field", "text field"), ("tokenizer_sha256", "tokenizer"),
                      ("fingerprint", "source fingerprint"), ("source", "source"), ("mode", "mode (text or chat)")):
        if manifest.get(key, "text" if key == "mode" else None) != identity[key]:
            raise DatasetError(
                f"{out} was prepared with another {what} ({manifest.get(key)!r}, now {identity[key]!r}): "
                + ("the source changed since prepare." if key == "fingerprint" else "it is another dataset."),
                f"delete {out} and prepare again, or prepare into a new folder.")
    return manifest


def _prepare_locked(src, out, identity, workers, strict, text_field, tokenizer_path, shard_bytes, progress, say,
                    args):
    chat = identity["mode"] == "chat"
    units = split_units(src, None if chat else text_field, shard_bytes, args)
    shards, acc = [], []
    for u in units:  # consecutive units up to shard_bytes: a shard is a run of documents in the fixed order
        acc.append(u)
        if sum(a["bytes"] for a in acc) >= shard_bytes:
            shards.append(acc)
            acc = []
    if acc:
        shards.append(acc)
    recipe = {**identity, "strict": strict, "shard_bytes": shard_bytes, "shards": shards}
    sdir = out / "shards"
    recipe_file = out / "recipe.json"
    if recipe_file.is_file() and _json_or_none(recipe_file) != recipe:
        shutil.rmtree(sdir, ignore_errors=True)  # an unfinished preparation of another input (or --strict): over
    sdir.mkdir(parents=True, exist_ok=True)
    write_atomic(recipe_file, json.dumps(recipe, indent=1))

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
           "strict": strict, "dir": str(sdir), "args": args, "chat": chat}
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
                results = {i: pool.apply_async(_prepare_shard, ((i, shards[i]),)) for i in pending}
                while results:  # the first failure (a bad tokenizer fails every shard) stops the pool: one line
                    for i in [i for i, r in results.items() if r.ready()]:
                        records[i] = _check(results.pop(i).get())
                    try:
                        bar.add(*q.get(timeout=0.2))
                    except queue.Empty:
                        pass
    finally:
        bar.close()
    return _commit(out, recipe, [records[i] for i in range(len(shards))], say, args)


def _check(record: dict) -> dict:
    if "error" in record:
        error = DatasetError(record["error"], record["fix"])
        error.exit_code, error.kind = record.get("exit_code", error.exit_code), record.get("kind", error.kind)
        raise error
    return record


def _json_or_none(path: Path):
    """The JSON in a file the workbench wrote earlier, or None where it is unreadable (then it is redone)."""
    try:
        return files.read_json(path)
    except (OSError, ValueError):
        return None


def _commit(out: Path, recipe: dict, records: list[dict], say, args: tuple[str, str]) -> dict:
    counts = {k: sum(r[k] for r in records) for k in ("documents", "tokens", "text_documents", "bad_rows")}
    chat = recipe["mode"] == "chat"
    if chat:
        from workbench.data.chat import audit

        counts |= audit(records, recipe["source"])
    bad = [b for r in records for b in r["bad_examples"]][:BAD_EXAMPLES]
    if counts["documents"] == 0:
        where = f" (first: {'; '.join(bad)})" if bad else ""
        conversations = any(f"{recipe['text_field']!r} is a list, not a string" in b for b in bad)
        raise DatasetError(f"{recipe['source']}: no documents: {counts['bad_rows']} bad row(s){where}.",
                           f"{recipe['text_field']!r} holds lists: conversations are prepared with --chat (python -m "
                           "workbench.data prepare SRC OUT --chat), or pick a text field with "
                           f"{flag(args[1])}." if conversations else f"point {flag(args[0])} at documents with text.")
    first_text, before = -1, 0  # global index of the first document with text (-1: none)
    for r in records:
        if first_text < 0 and r["first_text"] >= 0:
            first_text = before + r["first_text"]
        before += r["documents"]
    counts["first_text_document"] = first_text
    manifest = {k: recipe[k] for k in ("format", "source", "fingerprint", "tokenizer_sha256", "text_field", "mode")}
    manifest |= {**counts, "vocab_size": max(r["vocab_size"] for r in records), "bad_examples": bad,
                 "separator": None if chat else DOC_SEPARATOR, "dtype": "uint32",
                 "shards": [{k: r[k] for k in ("name", "documents", "tokens", "files")} for r in records]}
    write_atomic(out / "manifest.json", json.dumps(manifest, indent=1))
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
    """Loads the tokenizer once per worker. A failure is kept, not raised: a pool whose initializer raises starts
    new workers forever; this way every shard returns the cause and the first one stops the pool."""
    if job.get("one_thread"):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: `--workers` is the parallelism
    _WORKER.clear()
    _WORKER.update(job, queue=q)
    try:
        st = Path(job["tokenizer"]).stat()
        tok = _tokenizer(job["tokenizer"], st.st_size, st.st_mtime_ns)
        sep = tok.token_to_id(DOC_SEPARATOR)
        if sep is None:
            raise ValueError(f"it has no {DOC_SEPARATOR!r} token to separate documents")
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception for a malformed file
        _WORKER["init_error"] = f"the tokenizer {job['tokenizer']} cannot be used: {str(e).strip()[:300]}."
        return
    _WORKER.update(tok=tok, sep=sep, vocab=tok.get_vocab_size(with_added_tokens=True))
    if job.get("chat"):  # conversations: rendered by transformers' tokenizer (its chat_template)
        from workbench.data.chat import hf_tokenizer

        _WORKER["hf"] = hf_tokenizer(Path(job["tokenizer"]).parent)


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
    """Tokenizes one shard into its files and writes its record last; returns the record, or an error (a bad row
    with --strict, an unusable tokenizer, a folder that cannot be written) with no temp file left.

    `report(source_chars, tokens)` is called as it goes (in a pool: through the progress queue)."""
    sdir, name = Path(_WORKER["dir"]), f"{task[0]:05d}"
    if "init_error" in _WORKER:
        return {"error": _WORKER["init_error"], "fix": "point --tokenizer (model.tokenizer_path) at a folder with a "
                "valid Hugging Face tokenizer.json, or leave it empty for the bundled Qwen3 one."}
    try:
        return _write_shard(task, report)
    except OSError as e:
        error = _write_failed(e, sdir.parent)
        return {"error": error.message, "fix": error.fix, "exit_code": error.exit_code, "kind": error.kind}
    finally:
        for suffix in (*SHARD_FILES, "mask"):
            (sdir / f"{name}.{suffix}.tmp").unlink(missing_ok=True)


def _write_shard(task: tuple[int, list], report) -> dict:
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
    with files.create_new(tmp) as f, \
            files.create_new(sdir / f"{name}.mask.tmp") if chat else contextlib.nullcontext() as mask:

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
            """Renders the batch of conversations into the tokens and owner files (`chat.append`)."""
            nonlocal n_tokens, first_text, text_docs
            from workbench.data.chat import append

            try:
                lengths, bad_rows, counts = append(w["hf"], batch, f, mask)
            except ValueError as e:  # the stop audit: a template this reader does not understand
                return {"error": f"{batch[0][0]}..: {e}.", "fix": "use a Qwen3-style chat template "
                        "(tokenizer_config.json chat_template), or report the template."}
            for where, e in bad_rows:
                if err := skip(where, str(e), e.kind):
                    return err
            first_text = len(ends) if first_text < 0 and lengths else first_text
            text_docs += len(lengths)
            for n in lengths:
                n_tokens += n
                ends.append(n_tokens)
            talk["assistant_turns"] += counts["assistant_turns"]
            talk["trained_ends"] += counts["trained_ends"]
            report(counts["chars"], sum(lengths))
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
            for where, text, reason in read_unit(unit, None if chat else field, w["args"][1]):
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
    write_atomic(sdir / f"{name}.docs", np.asarray(ends, dtype=np.int64).tobytes())
    os.replace(tmp, sdir / f"{name}.tokens")
    if chat:
        os.replace(sdir / f"{name}.mask.tmp", sdir / f"{name}.mask")
    send(max(sum(u["bytes"] for u in units) - reported, 0), 0)  # the rest of the shard's bytes (JSON, escapes)
    digests = {}
    for suffix in (*SHARD_FILES, "mask") if chat else SHARD_FILES:  # every file of the shard: a crc per block
        crcs, digests[suffix] = digest(sdir / f"{name}.{suffix}")  # beside it; bytes and sha256 in the record
        write_atomic(sdir / f"{name}.{suffix}.crc", crcs)
    record = {"name": name, "documents": len(ends), "tokens": n_tokens, "text_documents": text_docs,
              "first_text": first_text, "bad_rows": bad, "bad_examples": bad_examples, "vocab_size": w["vocab"],
              "files": digests, **(talk if chat else {})}
    write_atomic(sdir / f"{name}.json", json.dumps(record))  # the shard is done only now
    return record


def _verified_record(sdir: Path, i: int) -> dict | None:
    """The record of a finished shard whose files (and their crc files) still match it; None (redo it) otherwise."""
    name = f"{i:05d}"
    rec = _json_or_none(sdir / f"{name}.json")
    try:
        check(rec, RECORD, "record")
        for suffix, want in rec["files"].items():
            crcs, got = digest(files.inside(sdir, f"{name}.{suffix}"))
            if got != want or read_bytes(sdir / f"{name}.{suffix}.crc") != crcs:
                return None
    except (OSError, ValueError):
        return None
    return rec if rec["name"] == name and set(rec["files"]) >= set(SHARD_FILES) else None


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from workbench.core.errors import WorkbenchError

    parser = argparse.ArgumentParser(prog="python -m workbench.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize SRC once into the prepared folder OUT")
    p.add_argument("src", help="'shakespeare', or .txt/.md files or folders, .jsonl, .json (an array or object of "
                   "records), .parquet, a save_to_disk folder")
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
                    tokenizer_path=args.tokenizer, shard_bytes=max(int(args.shard_mb * 2**20), 1),
                    args=("SRC", "--text-field"), chat=args.chat)
        else:
            PreparedDataset(args.out, tokenizer_path=None, check_source=False).verify()
            print(f"workbench data: {args.out}: every shard matches its sha256")
    except (WorkbenchError, OSError) as e:  # OSError: a file that is no regular one, or unreadable
        print(e.one_line() if isinstance(e, WorkbenchError) else f"workbench: data error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    return 0

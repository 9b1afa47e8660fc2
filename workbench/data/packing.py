"""Conversations packed into training rows, with positions per document and labels only where the loss is.

    pieces    each training conversation as one piece (its L tokens fill L - 1 positions: the last token is only a
              target); one longer is cut before a turn start (`overlong`: truncate keeps the first piece, split
              keeps them all, drop keeps none); a piece with no trained target is dropped
    packing   per epoch, the conversations in a seeded order (`np.random.default_rng([seed, epoch])`), cut into
              windows of `window` conversations (0 = the whole set), each packed best-fit-decreasing (largest piece
              first into the fullest row it fits; ties in the seeded order), the rows of a window shuffled
    rows      seq_len positions: the pieces one after the other, each piece's tokens but its last as inputs and
              its tokens but its first as targets (labels[i] = the next token of the same piece where it is trained,
              `chat.trained_lut`, else -100: no target crosses a piece's end), then `<|endoftext|>` padding (labels
              -100); positions restart at 0 at each piece and at the padding

An epoch's packing is a function of the prepared set, the `PackSpec` and the epoch only; it is cached in the data
cache (`WORKBENCH_DATA_CACHE/packing/<key>/`, never inside the prepared folder, which may be read-only), so the ranks
and later launches read it instead of packing again. Global row g is read by whoever asks for it (the loader gives
it to data-parallel rank g % W), so a run resumes on any number of ranks from the global row alone.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from workbench.core.config import MIN_PACK_WINDOW
from workbench.core.errors import DatasetError
from workbench.data import DOC_SEPARATOR, cache_root, tokenizer_dir
from workbench.data.chat import IM_START, LOSS_ON, trained_lut
from workbench.data.prepared import PreparedDataset

OVERLONG = ("truncate", "split", "drop")
IGNORE = -100  # the label of a position that is not trained (torchtitan's IGNORE_INDEX)


@dataclass(frozen=True)
class PackSpec:
    """What decides the rows (the cache key with the prepared set's identity and the epoch).

    Attributes:
        seq_len: tokens per row.
        loss_on: "assistant" (every assistant turn), "last_assistant", or "all" (every token).
        train_thinking: train `<think>` blocks of trained assistant turns.
        train_tool_calls: train `<tool_call>` blocks of trained assistant turns.
        overlong: a conversation over seq_len: "truncate" (the first piece), "split" (every piece), "drop".
        window: conversations per best-fit window (0 = the whole set; else at least MIN_PACK_WINDOW).
        seed: seeds each epoch's order.
        holdout: conversations at the end of the fixed order kept out (training.holdout_docs).
    """

    seq_len: int
    loss_on: str = "assistant"
    train_thinking: bool = True
    train_tool_calls: bool = True
    overlong: str = "truncate"
    window: int = 0
    seed: int = 0
    holdout: int = 0

    def lut(self) -> np.ndarray:
        return trained_lut(self.loss_on, self.train_thinking, self.train_tool_calls)


# ------------------------------------------------------------------------------------------------
# Pieces
# ------------------------------------------------------------------------------------------------


def cut(ids: np.ndarray, trained: np.ndarray, seq_len: int, start_id: int) -> list[tuple[int, int]]:
    """The pieces [start, stop) of an over-long conversation, each of at most seq_len + 1 tokens (a piece of n tokens
    fills n - 1 positions: its last token is only a target). Each piece ends before the furthest turn start
    (`<|im_start|>`) that keeps it within that, the next starting at that turn; or, when no turn starts in between
    or the piece up to it would hold no trained target (`trained`: per token), it takes seq_len + 1 tokens and the
    next starts at its last token (which then is an input too)."""
    turns = np.flatnonzero(ids == start_id)
    out, a, n = [], 0, len(ids)
    while n - a > seq_len + 1:
        k = int(np.searchsorted(turns, a + seq_len + 1, side="right")) - 1
        t = int(turns[k]) if k >= 0 and turns[k] > a + 1 else 0
        if t and trained[a + 1:t].any():
            out.append((a, t))
            a = t
        else:
            out.append((a, a + seq_len + 1))
            a += seq_len
    return out + [(a, n)]


def pieces(p: PreparedDataset, spec: PackSpec, start_id: int) -> tuple[np.ndarray, dict]:
    """Every training conversation's pieces as rows (conversation, start, stop, trained targets), and the counts
    (conversations; overlong: longer than a row, each truncated or split; dropped and their tokens; cut_tokens:
    tokens of kept conversations left out) with the first dropped ones named. A piece of n tokens fills n - 1
    positions of a row (its first n - 1 tokens are inputs, its last n - 1 targets)."""
    lut = spec.lut()
    n = len(p) - spec.holdout
    out: list[tuple[int, int, int, int]] = []
    counts = {"conversations": n, "overlong": 0, "dropped": 0, "dropped_tokens": 0, "cut_tokens": 0, "examples": []}

    def drop(i: int, tokens: int, why: str) -> None:
        counts["dropped"] += 1
        counts["dropped_tokens"] += tokens
        if len(counts["examples"]) < 5:
            counts["examples"].append(f"conversation {i} ({why})")

    for i in range(n):
        length = int(p.lengths[i])
        trained = lut[p.owners(i)]
        if length - 1 <= spec.seq_len:
            if t := int(trained[1:].sum()):
                out.append((i, 0, length, t))
            else:
                drop(i, length, "no trained token")
            continue
        if spec.overlong == "drop":
            drop(i, length, f"{length:,} tokens > seq_len {spec.seq_len:,} + 1")
            continue
        parts = cut(p.document(i), trained, spec.seq_len, start_id)
        covered = np.zeros(length, dtype=bool)
        for a, b in parts if spec.overlong == "split" else parts[:1]:
            if t := int(trained[a + 1:b].sum()):
                out.append((i, a, b, t))
                covered[a:b] = True
        if not covered.any():
            drop(i, length, f"no trained token in its first {parts[0][1]:,} tokens")
        else:
            counts["overlong"] += 1
            counts["cut_tokens"] += length - int(covered.sum())
    return np.asarray(out, dtype=np.int64).reshape(-1, 4), counts


# ------------------------------------------------------------------------------------------------
# Best-fit-decreasing
# ------------------------------------------------------------------------------------------------


def best_fit_decreasing(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """The bin of each item, items taken largest first (ties in the given order), each into the bin with the least
    room that still holds it, a new bin when none does. Bins are numbered in the order they open."""
    order = np.argsort(-sizes, kind="stable")
    room: list[int] = []  # the distinct room values that open bins have, sorted
    with_room: dict[int, list[int]] = {}  # room -> the bins with that much room (the last opened first)
    opened = 0
    bins = np.empty(len(sizes), dtype=np.int64)
    for k in order:
        s = int(sizes[k])
        j = bisect.bisect_left(room, s)
        if j == len(room):
            b, r = opened, capacity
            opened += 1
        else:
            r = room[j]
            b = with_room[r].pop()
            if not with_room[r]:
                del room[j]
        bins[k] = b
        r -= s
        if r:
            if not with_room.setdefault(r, []):
                bisect.insort(room, r)
            with_room[r].append(b)
    return bins


def pack_epoch(items: np.ndarray, spec: PackSpec, epoch: int, n_conversations: int) -> tuple[np.ndarray, np.ndarray]:
    """One epoch's rows: (pieces in row order as [conversation, start, stop], row offsets into them [R + 1])."""
    rng = np.random.default_rng([spec.seed, epoch])
    rank = np.empty(n_conversations, dtype=np.int64)
    rank[rng.permutation(n_conversations)] = np.arange(n_conversations)  # each conversation's place in the order
    items = items[np.lexsort((items[:, 1], rank[items[:, 0]]))]  # the seeded order; a split one's pieces in order
    window = spec.window or n_conversations
    edges = np.searchsorted(rank[items[:, 0]], np.arange(0, n_conversations + window, window))
    rows_pieces, offsets = [], [0]
    for a, b in zip(edges[:-1], edges[1:], strict=False):
        if a == b:
            continue
        part = items[a:b]
        bins = best_fit_decreasing(part[:, 2] - part[:, 1] - 1, spec.seq_len)
        n_bins = int(bins.max()) + 1
        shuffled = rng.permutation(n_bins)  # row order inside the window
        by_row = np.argsort(shuffled[bins] * len(part) + np.arange(len(part)), kind="stable")
        rows_pieces.append(part[by_row, :3])
        offsets.extend(offsets[-1] + np.cumsum(np.bincount(bins, minlength=n_bins)[np.argsort(shuffled)]))
    pieces_ = np.concatenate(rows_pieces) if rows_pieces else np.zeros((0, 3), np.int64)
    return pieces_, np.asarray(offsets, dtype=np.int64)


# ------------------------------------------------------------------------------------------------
# The rows of a prepared conversation set
# ------------------------------------------------------------------------------------------------


class ChatRows:
    """The packed rows of one prepared conversation set, epoch after epoch, any row by its global index.

    Args:
        prepared: a prepared folder of conversations (`prepare --chat`).
        spec: the packing.
        name: the dataset as the user wrote it (for messages).
        tokenizer_path: the tokenizer directory (for the turn-start and padding ids).
    """

    def __init__(self, prepared: PreparedDataset, spec: PackSpec, name: str, tokenizer_path: str = ""):
        check_spec(spec)
        self.p, self.spec, self.name = prepared, spec, name
        self.n = len(prepared) - spec.holdout
        if self.n <= 0:
            raise DatasetError(f"training.holdout_docs={spec.holdout} leaves no training conversations "
                               f"({len(prepared)} in {name!r}).", "lower --training.holdout_docs.")
        self.start_id, self.pad_id = _turn_and_pad_ids(str(tokenizer_dir(tokenizer_path) / "tokenizer.json"))
        self.lut = spec.lut()
        self.dir = cache_root() / "packing" / self._key()
        self.items, self.counts = self._pieces()
        if not len(self.items):
            raise DatasetError(f"training.dataset={name!r}: no conversation has a trained token under "
                               f"training.loss_on={spec.loss_on!r} at seq_len {spec.seq_len}.",
                               "check --training.loss_on and --training.seq_len.")
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._rows_before = [0]  # global rows before each epoch packed so far

    def _key(self) -> str:
        ident = {"shards": [s["files"] for s in self.p.manifest["shards"]], **asdict(self.spec)}
        ident.pop("seed")  # the pieces do not depend on it; epochs are keyed by seed and epoch below
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    def _pieces(self) -> tuple[np.ndarray, dict]:
        f = self.dir / "pieces.npy"
        if f.is_file() and (self.dir / "pieces.json").is_file():
            return np.load(f), json.loads((self.dir / "pieces.json").read_text())
        items, counts = pieces(self.p, self.spec, self.start_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        _atomic(f, lambda t: np.save(t, items))
        _atomic(self.dir / "pieces.json", lambda t: t.write_text(json.dumps(counts)))
        return items, counts

    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch e's (pieces in row order, row offsets), from the cache or packed now (and cached)."""
        if e not in self._epochs:
            if len(self._epochs) >= 2:
                del self._epochs[min(self._epochs)]
            f = self.dir / f"seed{self.spec.seed}-epoch{e}.npz"
            if f.is_file():
                z = np.load(f)
                packed = z["pieces"], z["offsets"]
            else:
                packed = pack_epoch(self.items, self.spec, e, self.n)
                _atomic(f, lambda t: np.savez(t, pieces=packed[0], offsets=packed[1]))
            self._epochs[e] = packed
        return self._epochs[e]

    def locate(self, g: int) -> tuple[int, int]:
        """(epoch, row in it) of global row g."""
        while len(self._rows_before) <= 1 or g >= self._rows_before[-1]:
            e = len(self._rows_before) - 1
            self._rows_before.append(self._rows_before[-1] + len(self.epoch(e)[1]) - 1)
        e = int(np.searchsorted(self._rows_before, g, side="right")) - 1
        return e, g - self._rows_before[e]

    def row_pieces(self, g: int) -> np.ndarray:
        """The [conversation, start, stop] pieces of global row g."""
        e, r = self.locate(g)
        pieces_, offsets = self.epoch(e)
        return pieces_[offsets[r]:offsets[r + 1]]

    def row(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Global row g: (input ids, labels, positions), int64 [seq_len] each."""
        return fill_row(self.p, self.row_pieces(g).tolist(), self.spec.seq_len, self.lut, self.pad_id)

    @property
    def total(self) -> int:
        """An epoch in the token stream's unit: its rows x (seq_len + 1) (what a mixture's report counts in)."""
        return (len(self.epoch(0)[1]) - 1) * (self.spec.seq_len + 1)

    def stats(self, epoch: int = 0) -> dict:
        """Rows, pad fraction, trained targets and the piece counts of one epoch (the launch prints them)."""
        pieces_, offsets = self.epoch(epoch)
        rows = len(offsets) - 1
        tokens = int((pieces_[:, 2] - pieces_[:, 1] - 1).sum())  # positions filled
        return {"rows": rows, "tokens": tokens, "pad_fraction": 1 - tokens / max(rows * self.spec.seq_len, 1),
                "trained_targets": int(self.items[:, 3].sum()), "pieces": len(pieces_), **self.counts}

    def describe(self, epoch: int = 0) -> str:
        """The launch's line about this set's packing."""
        st = self.stats(epoch)
        line = (f"packed {self.name}: {st['conversations']:,} conversations -> {st['rows']:,} rows of "
                f"{self.spec.seq_len:,} tokens, pad {100 * st['pad_fraction']:.2f}%, "
                f"{st['trained_targets'] / max(st['rows'], 1):,.0f} trained tokens per row; "
                f"{st['overlong']:,} longer than seq_len ({self.spec.overlong}: {st['cut_tokens']:,} tokens left "
                f"out), {st['dropped']:,} dropped ({st['dropped_tokens']:,} tokens)")
        return line + (f", first: {'; '.join(st['examples'])}" if st["examples"] else "")

    def check_dropped(self, max_share: float) -> None:
        """Refuses the run when more than `max_share` of the conversations are dropped (training.max_dropped)."""
        st = self.counts
        share = st["dropped"] / max(st["conversations"], 1)
        if share > max_share:
            raise DatasetError(
                f"training.dataset={self.name!r}: {st['dropped']:,} of {st['conversations']:,} conversations "
                f"({100 * share:.1f}%) are dropped at seq_len {self.spec.seq_len:,} (first: "
                f"{'; '.join(st['examples'])}), more than training.max_dropped={max_share:g}.",
                "raise --training.seq_len, use --training.overlong truncate or split, or raise "
                "--training.max_dropped.")


def fill_row(p: PreparedDataset, row_pieces: list, seq_len: int, lut: np.ndarray, pad_id: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row of [conversation, start, stop] pieces: (input ids, labels, positions), int64 [seq_len] each."""
    ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE, dtype=np.int64)
    positions = np.empty(seq_len, dtype=np.int64)
    at = 0
    for i, a, b in row_pieces:
        n = b - a - 1  # positions: the piece's last token is only a target
        tokens = np.empty(n + 1, dtype=np.int64)
        p.copy_into(tokens, i, a, b)
        ids[at:at + n] = tokens[:-1]
        labels[at:at + n] = np.where(lut[p.owners(i, a + 1, b)], tokens[1:], IGNORE)
        positions[at:at + n] = np.arange(n)
        at += n
    positions[at:] = np.arange(seq_len - at)  # the padding tail: one more document, never trained
    return ids, labels, positions


def heldout_rows(p: PreparedDataset, spec: PackSpec, num_docs: int, tokenizer_path: str = ""
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The last `num_docs` conversations (those `training.holdout_docs` keeps out), one per row: (input ids,
    labels) int64 [N, seq_len], the first piece of one longer than a row. Causal attention over such a row is the
    conversation alone, so any model gives the held-out loss on trained tokens (the mean over labels != -100)."""
    start_id, pad_id = _turn_and_pad_ids(str(tokenizer_dir(tokenizer_path) / "tokenizer.json"))
    lut, rows = spec.lut(), []
    for i in range(max(len(p) - num_docs, 0), len(p)):
        piece = cut(p.document(i), lut[p.owners(i)], spec.seq_len, start_id)[0]
        rows.append(fill_row(p, [(i, *piece)], spec.seq_len, lut, pad_id)[:2])
    if not rows:
        return np.zeros((0, spec.seq_len), np.int64), np.zeros((0, spec.seq_len), np.int64)
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def check_spec(spec: PackSpec) -> None:
    if spec.loss_on not in LOSS_ON or spec.overlong not in OVERLONG:
        raise DatasetError(f"training.loss_on={spec.loss_on!r} / training.overlong={spec.overlong!r}: not a choice.",
                           f"use one of {', '.join(LOSS_ON)} / {', '.join(OVERLONG)}.")
    if spec.window and spec.window < MIN_PACK_WINDOW:
        raise DatasetError(f"training.pack_window={spec.window}: a window under {MIN_PACK_WINDOW:,} conversations "
                           "packs poorly.", f"use 0 (the whole set) or at least {MIN_PACK_WINDOW:,}.")


@functools.cache
def _turn_and_pad_ids(tokenizer_json: str) -> tuple[int, int]:
    """The ids of <|im_start|> (where turns start) and <|endoftext|> (the padding), read once per process."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    return tok.token_to_id(IM_START), tok.token_to_id(DOC_SEPARATOR)


def _atomic(path: Path, write) -> None:
    """Writes through `write(tmp_path)` then renames: readers (other ranks) never see a partial file."""
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp{path.suffix}")
    write(tmp)
    os.replace(tmp, path)

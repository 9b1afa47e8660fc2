"""The training stream: packed rows read from prepared folders, one seeded global order, elastic resume.

Packing (GPT style): documents, each followed by <|endoftext|>, are concatenated in a seeded per-epoch order
(`np.random.default_rng([seed, epoch]).permutation`) into one endless token stream, cut into rows of
seq_len + 1 tokens (input = row[:-1], labels = row[1:]). Attention is plainly causal within a row; with
`training.document_mask` the documents of a row are kept apart instead (`document_row`: positions restart at each
document, no target crosses a document end; the attention side is `workbench.backends.attention`). The last
`training.holdout_docs` documents of the fixed order never enter it; `heldout_sets` returns them for perplexity.

Global row g goes to data-parallel rank g % dp_world_size. A rank computes where its rows start in the stream
(a cumulative sum of document lengths per epoch: 16 bytes per document) and reads only those tokens through the
memory map, so nothing is tokenized at train time and no rank holds the corpus. The union of the ranks' rows is the
same stream whatever the number of ranks; the checkpoint holds the global position (the next global row, and each
mixture member's row count), the same on every rank, so a run resumes exactly on the same or another DP degree.

A raw `training.dataset` (the bundled "shakespeare", a folder of text, jsonl, parquet) is prepared on first use
into a cache folder (`WORKBENCH_DATA_CACHE`, default ~/.cache/workbench/data), under a lock: the first rank does it
with a progress bar, the others wait. Mixtures: `training.dataset = "A:0.7,B:0.3"` blends datasets row by row,
each row going to the member furthest below its share (deterministic; shares exact to one row).

Conversations (a folder prepared with `--chat`, or "chitchat") are not a token stream: their rows come from
`workbench.data.packing.ChatRows` (best-fit-decreasing, positions restarting per conversation, labels -100 where
nothing is trained), the same global-row contract.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader

from workbench.core.errors import DatasetError
from workbench.data import cache_root, mixture, parse_mixture, source_root, tokenizer_hash
from workbench.data.packing import ChatRows, PackSpec, heldout_rows
from workbench.data.prepare import FORMAT, prepare
from workbench.data.prepared import PreparedDataset, fingerprint, is_prepared


def resolve(dataset: str, tokenizer_path: str = "", text_field: str = "text", progress: bool = True) -> Path:
    """The prepared folder for one dataset: itself if prepared, else its cache folder (prepared now if needed).

    Raises:
        DatasetError: see `prepare`.
    """
    if is_prepared(dataset):
        return Path(dataset)
    root = source_root(dataset)
    key = hashlib.sha256(f"{FORMAT}|{root.resolve()}|{fingerprint(dataset)}|{tokenizer_hash(tokenizer_path)}|"
                         f"{text_field}".encode()).hexdigest()[:16]
    out = cache_root() / f"{root.name}-{key}"
    prepare(dataset, out, wait=True, text_field=text_field, tokenizer_path=tokenizer_path, progress=progress)
    return out


def mixture_report(dataset: str, lengths: list[int], rows: int, row_len: int) -> tuple[list[str], list[str]]:
    """What a launch says about a mixture: the weights normalised (when they do not sum to 1), and per member its
    share, size and passes over its data in the run; warnings for members that repeat often.

    Args:
        dataset: `training.dataset`.
        lengths: tokens per epoch of each member (its training documents).
        rows: rows of the whole run (global batch x steps).
        row_len: tokens per row (seq_len + 1).

    Returns:
        (lines, warnings); both empty for a single dataset.
    """
    written = parse_mixture(dataset)
    if len(written) < 2:
        return [], []
    shares = mixture(dataset)
    lines = []
    total = sum(w for _, w in written)
    if abs(total - 1) > 1e-9:
        lines.append(f"workbench: training.dataset weights {', '.join(f'{w:g}' for _, w in written)} sum to "
                     f"{total:g}: normalised to shares {', '.join(f'{s:.4g}' for _, s in shares)}.")
    warnings = []
    for (name, share), tokens in zip(shares, lengths, strict=True):
        epochs = share * rows * row_len / tokens
        lines.append(f"workbench: mixture member {name}: share {share:.4g}, {tokens:,} tokens, {epochs:.3g} epoch(s) "
                     f"over the run ({round(share * rows):,} rows of {row_len:,} tokens).")
        if epochs > REPEAT_WARNING:
            warnings.append(f"workbench: warning: mixture member {name} repeats {epochs:.3g} times over the run; "
                            "lower its weight or give it more data if that is not intended.")
    return lines, warnings


REPEAT_WARNING = 4.0
"""Passes over a mixture member's data in one run above which the launch warns."""


def open_dataset(dataset: str, tokenizer_path: str = "", text_field: str = "text",
                 progress: bool = True) -> list[tuple[str, PreparedDataset, float]]:
    """Every member of `training.dataset`, prepared (raw ones into the cache) and opened: [(name, dataset, w)]."""
    return [(d, PreparedDataset(resolve(d, tokenizer_path, text_field, progress), tokenizer_path), w)
            for d, w in mixture(dataset)]


class Stream:
    """One dataset's endless packed token stream (holdout excluded), read at any position.

    Args:
        prepared: the dataset.
        seed: seeds each epoch's document order.
        holdout_docs: documents at the end of the fixed order left out.
        name: the dataset as the user wrote it (for messages).
    """

    def __init__(self, prepared: PreparedDataset, seed: int, holdout_docs: int, name: str):
        n = len(prepared) - holdout_docs
        if n <= 0:
            raise DatasetError(f"training.holdout_docs={holdout_docs} leaves no training documents ({len(prepared)} "
                               f"in {name!r}).", "lower --training.holdout_docs (0 for a single-document dataset).")
        if not 0 <= prepared.manifest["first_text_document"] < n:
            raise DatasetError(f"training.dataset={name!r}: its {n} training document(s) hold no text (empty, "
                               "whitespace or <|endoftext|> only).", "point --training.dataset at files with text.")
        self.prepared, self.seed, self.n = prepared, seed, n
        self.lengths = prepared.lengths[:n]
        self.total = int(self.lengths.sum())  # tokens per epoch
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's document order and the cumulative token count at the end of each of its documents."""
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:  # a row spans at most two epochs
                del self._epochs[min(self._epochs)]
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epochs[epoch] = perm, np.cumsum(self.lengths[perm])
        return self._epochs[epoch]

    def read(self, start: int, n: int, starts: list[int] | None = None) -> np.ndarray:
        """Tokens [start, start + n) of the stream, as int64; `starts` (if given) gets the offsets in the window
        where a document begins."""
        out = np.empty(n, dtype=np.int64)
        filled = 0
        while filled < n:
            epoch, off = divmod(start + filled, self.total)
            perm, cum = self._order(epoch)
            k = int(np.searchsorted(cum, off, side="right"))
            doc, length = int(perm[k]), int(self.lengths[perm[k]])
            a = off - (int(cum[k]) - length)
            if a == 0 and starts is not None:
                starts.append(filled)
            take = min(length - a, n - filled)
            self.prepared.copy_into(out[filled:filled + take], doc, a, a + take)
            filled += take
        return out


def member_rows(name: str, prepared: PreparedDataset, seq_len: int, seed: int, holdout_docs: int,
                tokenizer_path: str = "", chat: dict | None = None) -> Stream | ChatRows:
    """One member's rows: a conversation set packed (`ChatRows`, options `chat` = PackSpec fields), or a text
    stream."""
    if prepared.chat:
        spec = PackSpec(seq_len=seq_len, seed=seed, holdout=holdout_docs, **(chat or {}))
        return ChatRows(prepared, spec, name, tokenizer_path)
    return Stream(prepared, seed, holdout_docs, name)


@dataclass(frozen=True)
class OpenedMembers:
    """The members of `training.dataset`, opened once: [(name, rows: `Stream` | `ChatRows`, weight)]. The launch's
    input check opens them (`workbench.train.check_inputs`) and the loader reads the same objects."""

    members: list[tuple[str, Stream | ChatRows, float]]

    def to_dict(self) -> dict[str, Any]:
        """What torchtitan's config dump shows of them: the names."""
        return {"members": [name for name, *_ in self.members]}


def open_members(dataset: str, tokenizer_path: str, seq_len: int, seed: int = 0, text_field: str = "text",
                 holdout_docs: int = 0, chat: dict | None = None, vocab_size: int | None = None) -> OpenedMembers:
    """Every member of `dataset` opened (`open_dataset`) with its rows (`member_rows`).

    Raises:
        DatasetError: a member prepared with more token ids than `vocab_size` (the model's vocabulary: ids past its
            embedding table would crash a step), or a holdout that leaves nothing.
    """
    opened = []
    for name, prepared, weight in open_dataset(dataset, tokenizer_path, text_field):
        if vocab_size is not None and prepared.manifest["vocab_size"] > vocab_size:
            raise DatasetError(f"training.dataset={name!r} was prepared with a tokenizer of "
                               f"{prepared.manifest['vocab_size']:,} ids, more than the model's vocabulary of "
                               f"{vocab_size:,}.", "prepare the data with the model's tokenizer (--tokenizer), or "
                               "train a model whose vocabulary holds the tokenizer's.")
        opened.append((name, member_rows(name, prepared, seq_len, seed, holdout_docs, tokenizer_path, chat), weight))
    return OpenedMembers(opened)


class PackedDataset(IterableDataset, Stateful):
    """Infinite stream of packed rows for one data-parallel rank (see the module docstring).

    Args:
        dataset: `training.dataset`: "shakespeare", a prepared folder, a raw path, or a mixture "A:0.7,B:0.3".
        tokenizer_path: tokenizer directory ("" = bundled Qwen3).
        seq_len: tokens per training row.
        dp_rank: this rank's data-parallel index.
        dp_world_size: data-parallel ranks.
        seed: seeds the per-epoch document order.
        text_field: key/column of the text in raw jsonl/parquet/arrow.
        holdout_docs: documents at the end of each member's fixed order reserved for evaluation (excluded here).
        document_mask: positions restart at 0 at each document start inside a row (the row's first token is
            position 0 either way), and no target crosses a document end (-100): `document_row`. Conversation
            members always are (their rows come from `ChatRows`).
        chat: conversation members' packing options (`PackSpec` fields: loss_on, overlong, ...).
        opened: the members opened already with these settings (`open_members`); None: opened here.
    """

    def __init__(self, dataset: str, tokenizer_path: str, seq_len: int, dp_rank: int = 0, dp_world_size: int = 1,
                 seed: int = 0, text_field: str = "text", holdout_docs: int = 0, document_mask: bool = False,
                 chat: dict | None = None, opened: OpenedMembers | None = None):
        members = (opened or open_members(dataset, tokenizer_path, seq_len, seed, text_field, holdout_docs,
                                          chat)).members
        self.names = [name for name, *_ in members]
        self.streams = [rows for _, rows, _ in members]
        self.weights = np.asarray([w for *_, w in members])
        self.seq_len, self.dp_rank, self.dp_world_size = seq_len, dp_rank, dp_world_size
        self.document_mask = document_mask
        self._state = {"row": 0, "counts": [0] * len(members)}

    def _assign(self, row: int, counts: list[int]) -> int:
        """The member global row `row` comes from: the one furthest below its share (ties: the first)."""
        return int(np.argmax(self.weights * (row + 1) - np.asarray(counts)))

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        row_len = self.seq_len + 1
        positions = torch.arange(self.seq_len)
        while True:
            g, counts = self._state["row"], list(self._state["counts"])
            # Rows g .. g+W-1 are this step's rows of all ranks; this rank's is g + dp_rank.
            member, index = 0, g + self.dp_rank
            for h in range(g, g + self.dp_world_size) if len(counts) > 1 else ():
                k = self._assign(h, counts)
                if h == g + self.dp_rank:
                    member, index = k, counts[k]
                counts[k] += 1
            if len(counts) == 1:
                counts[0] += self.dp_world_size
            self._state = {"row": g + self.dp_world_size, "counts": counts}  # the global position once all ranks
            src = self.streams[member]  # have taken their row
            if isinstance(src, ChatRows):
                ids, labels, pos = (torch.from_numpy(a) for a in src.row(index))
                yield {"input": ids, "positions": pos, "member": torch.tensor(member)}, labels
                continue
            starts: list[int] | None = [] if self.document_mask else None
            t = torch.from_numpy(src.read(index * row_len, row_len, starts))
            inputs, labels = ({"input": t[:-1], "positions": positions}, t[1:]) if starts is None else \
                document_row(t, starts)
            # "member": which dataset of a mixture the row is from (the trainer takes it off before the model)
            yield {**inputs, "member": torch.tensor(member)}, labels

    def state_dict(self) -> dict[str, Any]:
        return {"row": self._state["row"], "counts": list(self._state["counts"])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if len(state_dict["counts"]) != len(self.streams):
            raise DatasetError(f"the checkpoint's data position is for a mixture of {len(state_dict['counts'])} "
                               f"dataset(s), but training.dataset names {len(self.streams)}.",
                               "resume with the same training.dataset, or start a new run.")
        self._state = {"row": int(state_dict["row"]), "counts": [int(c) for c in state_dict["counts"]]}


def document_row(row: torch.Tensor, starts: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A packed row of seq_len + 1 tokens with its documents kept apart (`training.document_mask`): input =
    row[:-1], positions restarting at 0 at each document start (`starts`, offsets in the row), and labels = row[1:]
    less the targets that are the next document's first token (-100): no loss term crosses a document end."""
    S = row.numel() - 1
    index = torch.arange(S)
    begins = torch.zeros(S, dtype=torch.bool)
    begins[[s for s in starts if s < S]] = True
    begins[0] = True
    positions = index - torch.cummax(torch.where(begins, index, 0), 0).values
    labels = row[1:].clone()
    labels[[s - 1 for s in starts if s > 0]] = -100  # IGNORE_INDEX of torchtitan's loss
    return {"input": row[:-1], "positions": positions}, labels


def heldout_sets(dataset: str = "shakespeare", tokenizer_path: str = "", num_docs: int = 1, text_field: str = "text",
                 seq_len: int = 128, loss_on: str = "assistant") -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
    """Per member of `training.dataset`, its last `num_docs` documents in the fixed order (for perplexity; never
    trained on when the training run used the same `holdout_docs`): a text member's token ids; a conversation
    member's conversations one per row of `seq_len` (`packing.heldout_rows`) as (inputs, labels), the labels -100
    where `loss_on` trains nothing. The one reader of held-out data (`workbench.compare` measures with it)."""
    out: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    for name, p, _ in open_dataset(dataset, tokenizer_path, text_field):
        if p.chat:
            rows = heldout_rows(p, PackSpec(seq_len=seq_len, loss_on=loss_on), num_docs, tokenizer_path)
            out[name] = tuple(torch.from_numpy(a) for a in rows)
            continue
        docs = range(max(len(p) - num_docs, 0), len(p))
        out[name] = torch.from_numpy(np.concatenate([p.document(i).astype(np.int64) for i in docs]))
    return out


class PackedTextDataLoader(ParallelAwareDataloader):
    """torchtitan dataloader over `PackedDataset`.

    Its checkpoint state is the global stream position as one int64 tensor, the same on every rank (DCP keeps one
    copy), not torchtitan's per-rank pickle: any DP degree can load it (torchtitan refuses another degree).
    """

    STATE_KEY = "stream_position"

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "shakespeare"
        text_field: str = "text"
        tokenizer_path: str = ""
        seed: int = 0
        holdout_docs: int = 0
        document_mask: bool = False
        chat: dict = field(default_factory=dict)
        """Conversation members' packing options (`workbench.data.packing.PackSpec` fields)."""
        opened: OpenedMembers | None = None
        """The members the launch's input check opened with these settings (None: opened by the loader)."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs):
        del tokenizer  # the prepared folders hold token ids already
        self.packed = PackedDataset(config.dataset, config.tokenizer_path, seq_len, dp_rank, dp_world_size,
                                    config.seed, config.text_field, config.holdout_docs, config.document_mask,
                                    config.chat, config.opened)
        super().__init__(self.packed, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
                         num_workers=0, snapshot_every_n_steps=snapshot_every_n_steps)

    def state_dict(self) -> dict[str, Any]:
        st = self.packed.state_dict()
        return {self.STATE_KEY: torch.tensor([st["row"], *st["counts"]], dtype=torch.int64)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        t = state_dict[self.STATE_KEY].tolist()
        self.packed.load_state_dict({"row": t[0], "counts": t[1:]})

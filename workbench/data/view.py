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
from workbench.data.prepared import PreparedDataset

MARK = {True: ("\x1b[1;32m", "\x1b[0m"), False: ("⟦", "⟧")}  # trained targets: colour on a terminal, brackets else


def rows(folder: str, seq_len: int, first: int, stop: int, *, seed: int = 42, holdout_docs: int = 1,
         tokenizer_path: str = "", chat: dict | None = None, document_mask: bool = False) -> list[dict]:
    """Global rows [first, stop) of a prepared folder as training sees them (defaults: a launch's defaults;
    `document_mask`: text rows as `training.document_mask` makes them, conversations always)."""
    p = PreparedDataset(folder, tokenizer_path)
    if p.chat:
        src = ChatRows(p, PackSpec(seq_len=seq_len, seed=seed, holdout=holdout_docs, **(chat or {})), folder,
                       tokenizer_path)
        made = (src.row(g) for g in range(first, stop))
    else:
        import torch

        from workbench.data.loader import Stream, document_row

        stream = Stream(p, seed, holdout_docs, folder)

        def text_row(g: int):
            starts: list[int] = []
            t = stream.read(g * (seq_len + 1), seq_len + 1, starts)
            if not document_mask:
                return t[:-1], t[1:], np.arange(seq_len)
            x, labels = document_row(torch.from_numpy(t), starts)
            return x["input"].numpy(), labels.numpy(), x["positions"].numpy()

        made = (text_row(g) for g in range(first, stop))
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


def main(argv: list[str] | None = None) -> int:
    """`python -m workbench.data inspect OUT --seq-len L --rows A:B [--json]`."""
    import argparse

    from workbench.core.errors import WorkbenchError
    from workbench.data import load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m workbench.data inspect", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="a prepared folder")
    ap.add_argument("--seq-len", type=int, required=True, help="training.seq_len")
    ap.add_argument("--rows", default="0:1", help="global rows A:B (default 0:1)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row: row, input_ids, labels, positions")
    ap.add_argument("--seed", type=int, default=42, help="job.seed (default 42)")
    ap.add_argument("--holdout-docs", type=int, default=1, help="training.holdout_docs (default 1)")
    ap.add_argument("--loss-on", default="assistant", help="training.loss_on (default assistant)")
    ap.add_argument("--overlong", default="truncate", help="training.overlong (default truncate)")
    ap.add_argument("--pack-window", type=int, default=0, help="training.pack_window (default 0: the whole set)")
    ap.add_argument("--document-mask", action="store_true", help="text: training.document_mask (positions restart)")
    ap.add_argument("--tokenizer", default="", help="tokenizer directory (default: the bundled Qwen3)")
    args = ap.parse_args(argv)
    a, _, b = args.rows.partition(":")
    try:
        first = int(a or 0)
        stop = int(b) if b else first + 1
    except ValueError:
        ap.error(f"--rows {args.rows!r}: give A:B, e.g. 0:4")
    chat = {"loss_on": args.loss_on, "overlong": args.overlong, "window": args.pack_window}
    try:
        got = rows(args.out, args.seq_len, first, stop, seed=args.seed, holdout_docs=args.holdout_docs,
                   tokenizer_path=args.tokenizer, chat=chat, document_mask=args.document_mask)
    except WorkbenchError as e:
        print(e.one_line(), file=sys.stderr)
        return e.exit_code
    if args.json:
        for r in got:
            print(json.dumps(r))
        return 0
    tok = load_tokenizer(args.tokenizer)
    for r in got:
        print(as_text(r, tok, sys.stdout.isatty()))
    return 0

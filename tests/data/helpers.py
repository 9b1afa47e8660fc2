"""Small sources written by the data tests, the `prepare` command run as a user runs it, and reading rows back."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run_helpers import ROOT
from workbench import data


def write_jsonl(path: Path, rows) -> Path:
    """One line per row: a str as it is (a crafted or broken line), anything else as JSON."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_texts(path: Path, texts) -> Path:
    """A JSONL file of `{"text": t}` records."""
    return write_jsonl(path, [{"text": t} for t in texts])


def corpus(folder: Path, n: int = 60, name: str = "c.jsonl", word: str = "doc") -> Path:
    """`folder/name`: n documents of different lengths (10..~120 tokens)."""
    return write_texts(folder / name, [f"{word} {i} " + "lorem ipsum dolor " * (1 + i % 13) for i in range(n)])


def take(ds, n):
    return list(itertools.islice(iter(ds), n))


def labels(ds, n):
    return [y for _, y in take(ds, n)]


def prepare_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m workbench.data prepare ARGS` in its own session; past `timeout` its whole group is killed (its
    workers too) and the test fails."""
    proc = subprocess.Popen([sys.executable, "-m", "workbench.data", "prepare", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"prepare {' '.join(args)} did not end within {timeout} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def chitchat_conversations() -> list[list[dict]]:
    """The test's own reading of chitchat's dataset.json: the first sender is the user, a turn's utterances are
    joined with a newline; a conversation without an assistant turn or with an empty turn is left out."""
    out = []
    for rec in json.loads(data.bundled_chat_json().read_text()).values():
        first = rec["messages"][0][0]["sender"]
        msgs = [{"role": "user" if t[0]["sender"] == first else "assistant",
                 "content": "\n".join(u["text"] for u in t)} for t in rec["messages"]]
        if any(m["role"] == "assistant" for m in msgs) and all(m["content"].strip() for m in msgs):
            out.append(msgs)
    return out

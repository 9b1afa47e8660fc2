"""workbench.core.schema, through every reader of JSON from outside, fuzzed (issue 53; the config fuzz of
tests/commands/test_train.py is the model): mutated copies of a Hugging Face `config.json` and
`model.safetensors.index.json`, a checkpoint step's `checksums.json` and a prepared folder's `manifest.json`, each
read the way the workbench reads it for real.

Every mutation is bad by construction, written down here by kind, not asked of the validator: a key the reader uses
given a value of the wrong type or out of its range, a required key removed, a name that leaves its folder, a file
that is not JSON at all or not an object. So each must be refused in one line (a workbench error, or the one-line
problem `verify_checkpoint` returns): a mutation that passes is a bad file accepted, anything else is a traceback."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from workbench.core import errors, flavors

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TINY = flavors.Qwen3Shape(32, 2, 4, 2, head_dim=8, ffn_dim=48, vocab_size=512, tied=True, max_seq_len=256)
NOT_JSON = ["", "{", '{"a": 1,}', "\x00\x01binary", "[" * 100_000 + "]" * 100_000, "1" * 5000, "NaN-ish", "{'a': 1}"]
NOT_AN_OBJECT = ["[]", "3", '"text"', "null", "true"]
WRONG_INT = [-1, "3", 3.5, None, True, [], {}, 10**30]
WRONG_STR = [3, None, [], {}, True]
PATHS_OUT = ["../x", "/etc/passwd", "a/b", "..", ".", ""]


@dataclass(frozen=True)
class Mutation:
    kind: str  # which file
    what: str  # what was done to it
    apply: Callable[[object], object] | str  # JSON value -> mutated value, or the file's new text


def at(path: tuple, value) -> Callable:
    """Sets the key at `path` (keys and list indices) to `value`."""
    def apply(obj):
        obj = copy.deepcopy(obj)
        node = obj
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
        return obj
    return apply


def without(path: tuple) -> Callable:
    def apply(obj):
        obj = copy.deepcopy(obj)
        node = obj
        for p in path[:-1]:
            node = node[p]
        del node[path[-1]]
        return obj
    return apply


def renamed(path: tuple, old: str, new: str) -> Callable:
    """The key `old` of the object at `path` renamed to `new` (its value kept)."""
    def apply(obj):
        obj = copy.deepcopy(obj)
        node = obj
        for p in path:
            node = node[p]
        node[new] = node.pop(old)
        return obj
    return apply


def as_text(kind: str) -> list[Mutation]:
    return [Mutation(kind, f"text {t[:12]!r}", t) for t in NOT_JSON + NOT_AN_OBJECT]


def values(kind: str, path: tuple, bad: list) -> list[Mutation]:
    return [Mutation(kind, f"{'.'.join(map(str, path))}={str(v)[:20]!r}", at(path, v)) for v in bad]


# ---- the files, made here as the workbench and transformers write them --------------------------------------------

@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    """kind -> a folder holding a real file of that kind (and what its reader needs beside it)."""
    from transformers import AutoModelForCausalLM

    from workbench.data.prepare import prepare
    from workbench.run.checkpoint import checksumming_writer, commit_checksums

    root = tmp_path_factory.mktemp("json_fuzz")
    torch.manual_seed(0)
    hf_dir = root / "hf"
    AutoModelForCausalLM.from_config(flavors.hf_config(TINY)).save_pretrained(str(hf_dir), max_shard_size="20KB")
    step = root / "step-2"
    sums: dict = {}
    state = {"w": torch.arange(3000, dtype=torch.float32), "b": torch.ones(7)}
    commit_checksums(step, sums, dcp.save(state, storage_writer=checksumming_writer(str(step), sums), no_dist=True))
    src = root / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " + "words " * (3 + i % 9)}) + "\n" for i in range(40)))
    prepare(str(src), root / "prepared", workers=1, progress=False)
    return {"config": hf_dir, "index": hf_dir, "checksums": step, "manifest": root / "prepared"}


FILES = {"config": "config.json", "index": "model.safetensors.index.json", "checksums": "checksums.json",
         "manifest": "manifest.json"}


def mutations(originals: dict[str, Path]) -> list[Mutation]:
    index = json.loads((originals["index"] / FILES["index"]).read_text())
    first_key = sorted(index["weight_map"])[0]
    sums = json.loads((originals["checksums"] / FILES["checksums"]).read_text())
    shard = next(n for n in sums["files"] if n.endswith(".distcp"))
    out: list[Mutation] = []
    # config.json: every key the shape is read from
    out += as_text("config")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "intermediate_size", "max_position_embeddings"):
        out += values("config", (key,), [0, -4, "32", 2.5, None, 10**9])
    out += values("config", ("model_type",), ["llama", 3, None])
    out += values("config", ("tie_word_embeddings",), ["false", "true", 0, None])
    out += values("config", ("head_dim",), [0, "8", -8])
    out += values("config", ("rope_parameters", "rope_theta"), ["1e6", -1.0, 0, None])
    out += values("config", ("num_attention_heads",), [3])  # not a multiple of the 2 KV heads
    out += [Mutation("config", f"no {k}", without((k,))) for k in
            ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
             "intermediate_size")]
    # the index: its weight_map and the names in it
    out += as_text("index")
    out += values("index", ("weight_map",), [[], "x", None, 3])
    out += values("index", ("weight_map", first_key), PATHS_OUT + ["x.bin", 3, None, "missing.safetensors"])
    out += [Mutation("index", "no weight_map", without(("weight_map",))),
            Mutation("index", "a key not in its file", renamed(("weight_map",), first_key, "model.not.a.tensor"))]
    # checksums.json: the entries and the names
    out += as_text("checksums")
    out += values("checksums", ("files",), [[], "x", None, 3])
    out += values("checksums", ("files", shard), WRONG_INT[:-1] + ["x", [1]])
    out += values("checksums", ("files", shard, "bytes"), WRONG_INT + [5])
    out += values("checksums", ("files", shard, "xxh3_64"), WRONG_STR + ["0" * 16, "zz", "0" * 64])
    out += values("checksums", ("hash",), ["md5", 3])
    out += [Mutation("checksums", f"files key {p!r}", renamed(("files",), shard, p)) for p in PATHS_OUT]
    out += [Mutation("checksums", "no files", without(("files",))),
            Mutation("checksums", "no .metadata entry", without(("files", ".metadata"))),
            Mutation("checksums", "no shard entry", without(("files", shard)))]
    # the manifest: every key a reader uses, shard names, per-file digests
    out += as_text("manifest")
    for key in ("documents", "tokens", "vocab_size", "bad_rows"):
        out += values("manifest", (key,), WRONG_INT + ([] if key == "bad_rows" else [0 if key == "vocab_size" else 7]))
    out += values("manifest", ("first_text_document",), [-2, 10**6, "0", None, 1.5])
    out += values("manifest", ("format",), [2, 4, "3", None])
    for key in ("source", "text_field", "fingerprint", "tokenizer_sha256"):
        out += values("manifest", (key,), WRONG_STR)
    out += values("manifest", ("fingerprint",), ["0" * 64, "abc"])
    out += values("manifest", ("tokenizer_sha256",), ["0" * 64])
    out += values("manifest", ("dtype",), ["uint16", 4])
    out += values("manifest", ("bad_examples",), ["x", [1], None])
    out += values("manifest", ("shards",), [[], "x", None, {}])
    out += values("manifest", ("shards", 0, "name"), PATHS_OUT + ["0", "000001", 5, "00001"])
    out += values("manifest", ("shards", 0, "documents"), WRONG_INT + [39])
    out += values("manifest", ("shards", 0, "tokens"), WRONG_INT + [1])
    out += values("manifest", ("shards", 0, "files", "tokens", "sha256"), WRONG_STR + ["0" * 64, "Z" * 64])
    out += values("manifest", ("shards", 0, "files", "docs", "bytes"), WRONG_INT + [8])
    out += [Mutation("manifest", f"no {k}", without((k,))) for k in
            ("shards", "first_text_document", "documents", "tokens", "vocab_size", "tokenizer_sha256", "format")]
    out += [Mutation("manifest", "no docs file", without(("shards", 0, "files", "docs"))),
            Mutation("manifest", "a shard listed twice", lambda m: {**m, "shards": m["shards"] * 2})]
    return out


def read(kind: str, folder: Path):
    """Reads the folder the way the workbench does; returns a one-line refusal, or None if it was accepted."""
    from workbench import hf_weights as hf
    from workbench.core.config import load_config
    from workbench.data.prepared import PreparedDataset
    from workbench.run.checkpoint import verify_checkpoint

    if kind == "config":
        load_config(None, model={"hf_checkpoint": str(folder)})
    elif kind == "index":
        hf.table_of_contents(folder)
    elif kind == "checksums":
        return verify_checkpoint(folder)  # what resume, hf_export, compare and load_model ask first
    else:
        PreparedDataset(folder)  # training's open (with the manifest's tokenizer and source checks)
        PreparedDataset(folder, tokenizer_path=None, check_source=False).verify()
    return None


def test_fuzzed_json_files_are_refused_in_one_line(originals, tmp_path):
    muts = mutations(originals)
    counts = dict(tried=0, refused=0, tracebacks=0, accepted=0)
    failures = []
    for i, m in enumerate(muts):
        counts["tried"] += 1
        folder = Path(shutil.copytree(originals[m.kind], tmp_path / f"{i}"))
        f = folder / FILES[m.kind]
        if isinstance(m.apply, str):
            f.write_bytes(m.apply.encode("utf-8", "surrogatepass"))
        else:
            f.write_text(json.dumps(m.apply(json.loads(f.read_text()))))
        try:
            problem = read(m.kind, folder)
        except errors.WorkbenchError as e:
            problem = e.one_line()
        except Exception as e:  # noqa: BLE001 - anything else would be a traceback at the command line
            counts["tracebacks"] += 1
            failures.append(f"traceback: {m.kind} {m.what}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if problem is None:
            counts["accepted"] += 1
            failures.append(f"accepted: {m.kind} {m.what}")
        elif "\n" in problem:
            failures.append(f"not one line: {m.kind} {m.what}: {problem!r}")
        else:
            counts["refused"] += 1
        shutil.rmtree(folder)
    print(f"JSON fuzz: {counts} over {', '.join(FILES.values())}")
    assert not failures, "\n".join(failures)
    assert counts["tried"] >= 100 and counts["tracebacks"] == counts["accepted"] == 0
    assert all(sum(m.kind == k for m in muts) >= 25 for k in FILES)  # every kind of file well exercised

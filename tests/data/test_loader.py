"""workbench.data.loader: the rows training reads from prepared folders: the packing of whole documents, shifted and
deterministic rows, elastic data-parallel sharding and resume (also on another number of ranks), mixtures and their
held-out sets. All in process, on the real tokenizer and the bundled corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.data.helpers import corpus, labels, take
from workbench import data
from workbench.core.errors import DatasetError
from workbench.data import dataset_label, mixture
from workbench.data import prepare as prep
from workbench.data.loader import PackedDataset, PackedTextDataLoader, heldout_sets, mixture_report

ROOT = Path(__file__).resolve().parents[2]


def test_prepared_stream_is_the_packing_of_whole_documents():
    """The stream before prepared folders (tokenize each document whole + <|endoftext|>, concatenate in the seeded
    epoch order, cut rows of seq_len + 1) is what the prepared path yields, token for token (so the golden loss
    curves stay bit-identical)."""
    tok = data.load_tokenizer()
    files = [p for _, p in data.document_sources("shakespeare")][:-1]  # holdout_docs=1
    order = np.random.default_rng([5, 0]).permutation(len(files))
    ref = []
    for i in order[:2]:
        ref += tok.encode(files[i].read_text(), add_special_tokens=False).ids + [151643]
    rows = len(ref) // 1025
    got = labels(PackedDataset("shakespeare", "", 1024, seed=5, holdout_docs=1), rows)
    assert rows > 40
    assert all(torch.equal(got[r], torch.tensor(ref[r * 1025 + 1:(r + 1) * 1025])) for r in range(rows))
    prepared = data.loader.PreparedDataset(data.loader.resolve("shakespeare"))
    assert (prepared.manifest["documents"], prepared.manifest["tokens"]) == (38, 1479492)
    assert prepared.tokens[0].dtype == np.uint32


def test_rows_are_shifted_and_deterministic():
    a = take(PackedDataset("shakespeare", "", seq_len=32, seed=3), 4)
    b = take(PackedDataset("shakespeare", "", seq_len=32, seed=3), 4)
    c = take(PackedDataset("shakespeare", "", seq_len=32, seed=4), 4)
    for (x, y), (x2, y2) in zip(a, b, strict=True):
        assert torch.equal(x["input"], x2["input"]) and torch.equal(y, y2)
    assert torch.equal(a[0][0]["input"][1:], a[0][1][:-1])  # labels = inputs shifted by one
    assert not torch.equal(a[0][0]["input"], c[0][0]["input"])  # the seed changes the document order


def test_dp_ranks_partition_the_single_rank_stream():
    whole = labels(PackedDataset("shakespeare", "", 16, 0, 1, seed=1), 6)
    r0 = labels(PackedDataset("shakespeare", "", 16, 0, 2, seed=1), 3)
    r1 = labels(PackedDataset("shakespeare", "", 16, 1, 2, seed=1), 3)
    assert all(torch.equal(whole[2 * i], r0[i]) and torch.equal(whole[2 * i + 1], r1[i]) for i in range(3))


def test_resume_continues_exactly_across_epochs():
    ds = PackedDataset("shakespeare", "", 4096, seed=0)  # ~360 rows per epoch
    it = iter(ds)
    for _ in range(400):  # past the end of epoch 0
        next(it)
    state = ds.state_dict()
    expected = [next(it)[1] for _ in range(3)]
    ds2 = PackedDataset("shakespeare", "", 4096, seed=0)
    ds2.load_state_dict(json.loads(json.dumps(state)))  # state is plain data
    assert state["row"] == 400 and ds.streams[0].total * 1 < 400 * 4097  # the position is in epoch 1
    assert all(torch.equal(e, g[1]) for e, g in zip(expected, take(ds2, 3), strict=True))


def loaders(dataset: str, world: int, seq: int = 64, batch: int = 2, **kw) -> list[PackedTextDataLoader]:
    cfg = PackedTextDataLoader.Config(dataset=dataset, seed=7, holdout_docs=1)
    return [PackedTextDataLoader(cfg, dp_world_size=world, dp_rank=r, tokenizer=None, seq_len=seq,
                                 local_batch_size=batch, **kw) for r in range(world)]


def interleave(batches_per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The global row order of per-rank batches: row g is rank g % W's, so within a step the ranks interleave."""
    rows = []
    for step in zip(*batches_per_rank, strict=True):
        per_rank = [list(b) for b in step]
        for i in range(len(per_rank[0])):
            rows += [rank_rows[i] for rank_rows in per_rank]
    return rows


def run_steps(lds: list[PackedTextDataLoader], steps: int) -> list[torch.Tensor]:
    its = [iter(ld) for ld in lds]
    return interleave([[next(it)[1] for _ in range(steps)] for it in its])


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_on_another_dp_degree_continues_the_global_stream(cache, tmp_path, before, after):
    """2 ranks -> 1 and 1 -> 2: the checkpointed position (one tensor, the same on every rank, saved and loaded
    through DCP) continues the union of rows exactly where the uninterrupted run is."""
    import torch.distributed.checkpoint as dcp

    src = str(corpus(tmp_path))
    whole = run_steps(loaders(src, 1, batch=4), 20)  # 80 rows of 65 tokens: into the second epoch
    first = loaders(src, before, batch=4 // before)
    head = run_steps(first, 6)
    states = [ld.state_dict() for ld in first]
    assert all(torch.equal(s["stream_position"], states[0]["stream_position"]) for s in states)
    dcp.save({"dataloader": first[0]}, checkpoint_id=str(tmp_path / "ckpt"))
    second = loaders(src, after, batch=4 // after)
    for ld in second:
        dcp.load({"dataloader": ld}, checkpoint_id=str(tmp_path / "ckpt"))
    tail = run_steps(second, 14)
    assert len(head) + len(tail) == len(whole) == 80
    assert all(torch.equal(a, b) for a, b in zip(head + tail, whole, strict=True))


def test_mixture_shares_and_heldout_per_dataset(cache, tmp_path):
    a, b = corpus(tmp_path, 50, "a.jsonl", "alpha"), corpus(tmp_path, 30, "b.jsonl", "beta")
    out_a, out_b = tmp_path / "pa", tmp_path / "pb"
    prep.prepare(str(a), out_a, workers=1, progress=False)
    prep.prepare(str(b), out_b, workers=1, progress=False)
    spec = f"{out_a}:0.7,{out_b}:0.3"
    ds = PackedDataset(spec, "", 8, seed=1, holdout_docs=2)
    it = iter(ds)
    for _ in range(10_000):
        next(it)
    counts = ds.state_dict()["counts"]
    assert sum(counts) == 10_000 and abs(counts[0] / 10_000 - 0.7) < 0.01 and abs(counts[1] / 10_000 - 0.3) < 0.01
    # every row says which member it is from: the rows of b are b's documents
    tok = data.load_tokenizer()
    for row, _ in take(PackedDataset(spec, "", 8, seed=1, holdout_docs=2), 20):
        text = tok.decode(row["input"].tolist())
        assert row["member"].item() == (1 if "beta" in text else 0) or not ("alpha" in text or "beta" in text)
    # Elastic and deterministic with a mixture too: 3 ranks' rows interleave into the 1-rank stream.
    whole = labels(PackedDataset(spec, "", 8, seed=1, holdout_docs=2), 9)
    ranks = [labels(PackedDataset(spec, "", 8, r, 3, seed=1, holdout_docs=2), 3) for r in range(3)]
    assert all(torch.equal(whole[3 * i + r], ranks[r][i]) for i in range(3) for r in range(3))
    held = heldout_sets(spec, num_docs=2)
    tok = data.load_tokenizer()
    assert list(held) == [str(out_a), str(out_b)]
    assert tok.decode(held[str(out_b)].tolist()).startswith("beta 28 ")  # the last 2 documents of b


@pytest.mark.parametrize(("spec", "refused"), [
    ("/d/a,/d/b", "member '/d/a' has no weight; a mixture needs one for every member"),
    ("/d/a:0.5,", "member 2 is empty"),
    (",/d/a:0.5", "member 1 is empty"),
    ("/d/a:nan,/d/b:1", "the weight 'nan' of '/d/a' is not a finite positive number"),
    ("/d/a:inf,/d/b:1", "the weight 'inf' of '/d/a' is not a finite positive number"),
    ("/d/a:0,/d/b:1", "the weight '0' of '/d/a' is not a finite positive number"),
    ("/d/a:-2", "the weight '-2' of '/d/a' is not a finite positive number"),
    ("/d/a:1e-300,/d/b:1e300", "the weight of '/d/a' is so much smaller than the largest one that its share is 0"),
])
def test_mixture_weights_are_given_for_every_member_and_finite(spec, refused):
    with pytest.raises(DatasetError, match="training.dataset=") as e:
        mixture(spec)
    assert refused in e.value.message


def test_mixture_weights_are_normalised_and_the_launch_says_what_each_member_gives():
    assert mixture("/d/a:0.7,/d/b:0.7") == [("/d/a", 0.5), ("/d/b", 0.5)]
    assert mixture("/d/a:1e308,/d/b:1e308") == [("/d/a", 0.5), ("/d/b", 0.5)]  # no overflow to inf (shares 0)
    assert mixture("/d/x:y") == [("/d/x:y", 1.0)] and mixture("/d/x:2") == [("/d/x", 1.0)]  # one dataset
    assert mixture_report("/d/a", [100], 10, 9) == ([], [])
    # 1,000 rows of 9 tokens at 0.7 / 0.3 over members of 63,000 and 270 tokens
    lines, warnings = mixture_report("/d/a:0.7,/d/b:0.7,/d/c:0.6", [63_000, 270, 10_000], 1000, 9)
    assert lines == [
        "workbench: training.dataset weights 0.7, 0.7, 0.6 sum to 2: normalised to shares 0.35, 0.35, 0.3.",
        "workbench: mixture member /d/a: share 0.35, 63,000 tokens, 0.05 epoch(s) over the run (350 rows of 9 "
        "tokens).",
        "workbench: mixture member /d/b: share 0.35, 270 tokens, 11.7 epoch(s) over the run (350 rows of 9 tokens).",
        "workbench: mixture member /d/c: share 0.3, 10,000 tokens, 0.27 epoch(s) over the run (300 rows of 9 tokens)."]
    assert warnings == ["workbench: warning: mixture member /d/b repeats 11.7 times over the run; lower its weight "
                        "or give it more data if that is not intended."]
    assert mixture_report("/d/a:0.5,/d/b:0.5", [1000, 1000], 10, 9)[0][0].startswith("workbench: mixture member")
    assert dataset_label("/data/web.prepared:0.7,/x/code.jsonl:0.7") == "web.prepared 0.5 + code.jsonl 0.5"
    assert dataset_label("shakespeare") == "shakespeare" and dataset_label("/d/c.prepared/") == "c.prepared"

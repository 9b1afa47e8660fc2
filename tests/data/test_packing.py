"""workbench.data.packing: packed chat rows (best-fit decreasing): determinism in seed and epoch, the pad fraction,
whole pieces with restarting positions, truncate/split/drop, windows, the same rows on any number of ranks and after
a resume, held-out conversations. All in process."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.data.helpers import chitchat_conversations, write_jsonl
from workbench.core.errors import DatasetError
from workbench.data import chat, packing
from workbench.data.loader import PackedDataset


def spec(**kw) -> packing.PackSpec:
    return packing.PackSpec(**{"seq_len": 4096, "seed": 0, "holdout": 1, **kw})


def test_bundled_packing_at_4096_pads_under_one_percent_and_drops_nothing(bundled, cache):
    rows = packing.ChatRows(bundled, spec(), "chitchat")
    st = rows.stats()
    assert st["pad_fraction"] <= 0.01 and st["dropped"] == 0
    assert st["overlong"] == 121 and st["conversations"] == 4007
    # every training conversation is in exactly one row (truncate: one piece each)
    pieces, offsets = rows.epoch(0)
    assert sorted(pieces[:, 0].tolist()) == list(range(4007))
    assert (np.diff(offsets) > 0).all()
    assert all((pieces[a:b, 2] - pieces[a:b, 1] - 1).sum() <= 4096
               for a, b in zip(offsets[:-1], offsets[1:], strict=True))


def test_packing_is_a_function_of_seed_and_epoch(bundled, cache):
    a = packing.ChatRows(bundled, spec(seq_len=512), "chitchat")
    b = packing.ChatRows(bundled, spec(seq_len=512), "chitchat")  # read back from the cache folder
    c = packing.ChatRows(bundled, spec(seq_len=512, seed=1), "chitchat")
    assert (a.dir / "pieces.npy").is_file() and str(a.dir).startswith(str(cache))
    for e in (0, 1):
        assert all(np.array_equal(x, y) for x, y in zip(a.epoch(e), b.epoch(e), strict=True))
    assert not np.array_equal(a.epoch(0)[0], a.epoch(1)[0]) and not np.array_equal(a.epoch(0)[0], c.epoch(0)[0])
    assert sorted(map(tuple, a.epoch(0)[0].tolist())) == sorted(map(tuple, a.epoch(1)[0].tolist()))
    assert a.stats(0)["rows"] == a.stats(1)["rows"]  # equal sizes are interchangeable: the same bins every epoch


def test_rows_hold_whole_pieces_with_restarting_positions_and_labels_only_on_trained_targets(bundled, cache):
    rows = packing.ChatRows(bundled, spec(seq_len=256), "chitchat")
    lut = chat.trained_lut()
    for g in range(40):
        ids, labels, pos = rows.row(g)
        at = 0
        for i, a, b in rows.row_pieces(g).tolist():
            n = b - a - 1  # the piece's last token is a target only
            tokens = bundled.document(i, a, b).astype(np.int64)
            assert ids[at:at + n].tolist() == tokens[:-1].tolist() and pos[at:at + n].tolist() == list(range(n))
            trained = lut[bundled.owners(i, a + 1, b)]
            assert labels[at:at + n].tolist() == np.where(trained, tokens[1:], -100).tolist()
            if b == bundled.lengths[i]:  # a whole conversation's last target is the newline after <|im_end|>
                assert labels[at + n - 1] == -100
            at += n
        assert (labels[at:] == -100).all() and pos[at:].tolist() == list(range(256 - at))
        assert (labels != -100).any()


def test_truncate_split_and_drop(bundled, cache):
    t, s, d = (packing.ChatRows(bundled, spec(seq_len=2048, overlong=o), "chitchat") for o in packing.OVERLONG)
    st_t, st_s, st_d = t.stats(), s.stats(), d.stats()
    over = sum(int(bundled.lengths[i]) > 2049 for i in range(4007))
    assert st_t["overlong"] == st_s["overlong"] == st_d["dropped"] == over == 409
    assert st_t["dropped"] == st_s["dropped"] == 0
    assert st_t["pieces"] == 4007 and st_s["pieces"] > 4007 and st_d["pieces"] == 4007 - over
    assert st_s["cut_tokens"] < st_t["cut_tokens"] / 100  # split keeps nearly everything
    for i, a, b, _ in t.items.tolist():
        if int(bundled.lengths[i]) > 2049:  # truncated before a turn start, or at seq_len + 1 tokens when none fits
            assert a == 0 and b <= 2049 and (bundled.document(i, b, b + 1)[0] == t.start_id or b == 2049)
    assert "conversation" in d.describe() and "> seq_len 2,048 + 1" in d.describe()
    with pytest.raises(DatasetError, match=r"409 of 4,007 conversations .* training\.max_dropped=0\.05"):
        d.check_dropped(0.05)
    d.check_dropped(0.2)


def test_best_fit_windows_keep_their_conversations_together():
    rng = np.random.default_rng(0)
    n = 40
    items = np.stack([np.arange(n), np.zeros(n, int), rng.integers(5, 65, n), np.ones(n, int)], axis=1)
    sp = packing.PackSpec(seq_len=64, window=10)
    pieces, offsets = packing.pack_epoch(items, sp, 0, n)
    rank = np.empty(n, int)
    rank[np.random.default_rng([0, 0]).permutation(n)] = np.arange(n)
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        assert len(set(rank[pieces[a:b, 0]] // 10)) == 1
        assert (pieces[a:b, 2] - pieces[a:b, 1] - 1).sum() <= 64
    assert sorted(pieces[:, 0].tolist()) == list(range(n))
    whole = packing.pack_epoch(items, packing.PackSpec(seq_len=64), 0, n)
    assert len(whole[1]) <= len(offsets)  # a window can only pack worse
    bins = packing.best_fit_decreasing(np.array([50, 30, 20, 14, 10, 5]), 64)
    assert bins.tolist() == [0, 1, 1, 1, 0, 2]  # 30+20+14 (the fuller of the two with room 14), 50+10, 5 alone


def test_rows_are_the_same_on_any_number_of_ranks_and_resume(cache):
    convs = chitchat_conversations()[:300]
    write_jsonl(cache.parent / "c.jsonl", [{"messages": c} for c in convs])
    src = str(cache.parent / "c.jsonl")

    def take(ds, n):
        return [(x["input"].tolist(), x["positions"].tolist(), y.tolist()) for x, y in itertools.islice(iter(ds), n)]

    whole = take(PackedDataset(src, "", 128, 0, 1, seed=3, holdout_docs=2), 6)
    r0, r1 = (take(PackedDataset(src, "", 128, r, 2, seed=3, holdout_docs=2), 3) for r in (0, 1))
    assert whole[0::2] == r0 and whole[1::2] == r1
    ds = PackedDataset(src, "", 128, 0, 2, seed=3, holdout_docs=2)
    take(ds, 2)
    one = PackedDataset(src, "", 128, 0, 1, seed=3, holdout_docs=2)
    one.load_state_dict(ds.state_dict())  # 2 ranks -> 1: the global row carries over
    assert take(one, 2) == whole[4:6]
    ds = PackedDataset(src, "", 4096, 0, 1, seed=3, holdout_docs=2)
    assert sorted(ds.streams[0].epoch(0)[0][:, 0].tolist()) == list(range(298))  # the last 2 are held out


def test_heldout_conversations_are_rows_of_their_own_with_the_trained_labels(bundled):
    ids, labels = packing.heldout_rows(bundled, spec(seq_len=512), 3)
    lut = chat.trained_lut()
    assert ids.shape == labels.shape == (3, 512)
    for r, i in enumerate(range(4005, 4008)):
        doc = bundled.document(i).astype(np.int64)
        b = len(doc)
        if b > 513:  # the first piece: up to the last turn start within 513 tokens (after something trained)
            b = max(int(t) for t in np.flatnonzero(doc == 151644) if 1 < t <= 513)
            b = b if lut[bundled.owners(i, 1, b)].any() else 513
        tokens, n = doc[:b], b - 1
        assert ids[r, :n].tolist() == tokens[:-1].tolist()
        assert labels[r, :n].tolist() == np.where(lut[bundled.owners(i, 1, n + 1)], tokens[1:], -100).tolist()
        assert (labels[r, n:] == -100).all() and (labels[r] != -100).any()
    train = packing.ChatRows(bundled, spec(seq_len=512, holdout=3), "chitchat").items
    assert train[:, 0].max() == 4004


def test_packing_settings_are_checked_with_the_config():
    from workbench.core.config import load_config
    from workbench.core.errors import ConfigError

    for key, value, message in (("pack_window", 5000, "at least 10000"), ("max_dropped", 1.5, "out of range"),
                                ("loss_on", "user", "must be one of assistant, last_assistant, all"),
                                ("overlong", "wrap", "must be one of truncate, split, drop")):
        with pytest.raises(ConfigError, match=message):
            load_config("configs/cpu_dense.toml", training={key: value})
    t = load_config("configs/cpu_dense.toml", training={"pack_window": 20000, "loss_on": "all"}).training
    assert packing.PackSpec(seq_len=64, **t.chat_options()).lut().all()

"""Parity: one transformers-saved checkpoint, built under huggingface_v5 and native (fp32, CPU), gives the same
logits as transformers itself (<= 1e-4 max abs between the two paths) and the same 20-step loss curve
(<= 1e-3 relative per step), dense and MoE."""

from __future__ import annotations

import json
import pickle
import shutil

from tests.run_helpers import PicklePayload
from workbench.platform import titan_device

titan_device.pin("cpu")

from workbench import parity  # noqa: E402
from workbench.core import errors  # noqa: E402

SETTINGS = parity.Settings(steps=20, batch_size=2, seq_len=64, lr=1e-3)


def assert_paths_agree(table) -> None:
    rows = table.set_index("backend")
    hf, native = rows.loc["huggingface_v5"], rows.loc["native"]
    for row in (hf, native):
        assert row["status"] == "ok", row["note"]
        # each within 5e-5 of transformers, so within 1e-4 of each other
        assert row["logits_max_abs_diff"] <= 5e-5, row
        assert row["max_rel_loss_diff"] <= 1e-3, row
    assert len(hf["losses"]) == len(native["losses"]) == SETTINGS.steps
    pairwise = max(abs(a - b) / abs(b) for a, b in zip(hf["losses"], native["losses"], strict=True))
    assert pairwise <= 1e-3, pairwise
    assert native["losses"][-1] < native["losses"][0]  # the 20 steps trained something


def test_dense_parity(checkpoints, tmp_path):
    out = tmp_path / "parity.json"
    table = parity.run_parity(checkpoints["dense"], settings=SETTINGS, out_json=out)
    assert list(table["backend"]) == [parity.REFERENCE, *parity.BACKENDS]
    assert_paths_agree(table)
    nki = table.set_index("backend").loc["nki_moe"]
    assert nki["status"] == "skipped" and "dense" in nki["note"]
    report = json.loads(out.read_text())
    assert report["settings"]["steps"] == SETTINGS.steps
    assert [r["backend"] for r in report["rows"]] == list(table["backend"])


def test_moe_parity(checkpoints):
    # nki_moe is the other engineer's path (its emulated kernels are slow here); its row is exercised by them.
    table = parity.run_parity(checkpoints["moe"], backends=("huggingface_v5", "native"), settings=SETTINGS)
    assert_paths_agree(table)


def test_parity_refuses_a_pickle_only_folder_before_transformers_reads_it(checkpoints, tmp_path, capsys):
    from workbench import parity

    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(checkpoints["dense"] / "config.json", d)
    marker = tmp_path / "unpickled"
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(PicklePayload(marker)))
    assert parity.main([str(d), "--steps", "1"]) == errors.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pytorch_model.bin" in err and "never unpickles" in err
    assert not marker.exists()

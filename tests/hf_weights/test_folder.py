"""workbench.hf_weights.folder: a checkpoint folder's files and the table of contents of their tensors, read from
headers only: a missing shard, a truncated file, pickles (never unpickled), a FIFO and an index naming a file outside
the folder are each refused in one line."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from tests.hf_weights.helpers import DENSE, copy_of
from tests.run_helpers import PicklePayload, unblocking
from workbench.core import errors, flavors
from workbench.model import load_model

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)


def test_missing_shard(saved, tmp_path):
    d = copy_of(saved, "dense-sharded", tmp_path)
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(errors.HFCheckpointError, match=rf"missing from .*{victim.name}.*fetch the missing shard"):
        load_model(None, hf_checkpoint=d)


def test_truncated_safetensors(saved, tmp_path):
    d = copy_of(saved, "dense", tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(errors.HFCheckpointError,
                       match="model.safetensors is not a readable safetensors file.*truncated"):
        load_model(None, hf_checkpoint=d)


def test_pickle_weights_are_refused_never_unpickled(saved, tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(saved["dense"][0] / "config.json", d)
    marker = tmp_path / "unpickled"
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(PicklePayload(marker)))
    with pytest.raises(errors.HFCheckpointError, match=r"pytorch_model.bin.*never unpickles.*save_pretrained"):
        load_model(None, hf_checkpoint=d)
    assert not marker.exists()


def test_a_fifo_named_safetensors_is_refused_not_read(tmp_path):
    from workbench import hf_weights as hf

    d = tmp_path / "ckpt"
    d.mkdir()
    flavors.hf_config(DENSE).save_pretrained(str(d))
    os.mkfifo(d / "model.safetensors")
    with unblocking(d / "model.safetensors") as hung, pytest.raises(errors.HFCheckpointError) as refused:
        hf.table_of_contents(d)
    assert not hung(), "the reader blocked on the FIFO"
    assert f"{d / 'model.safetensors'} is a FIFO, not a regular file" in refused.value.one_line()


def test_an_index_naming_a_file_outside_is_refused_before_it_is_opened(saved, tmp_path):
    from workbench import hf_weights as hf

    d = Path(shutil.copytree(saved["dense"][0], tmp_path / "ckpt"))
    outside = tmp_path / "outside.safetensors"
    shutil.move(d / "model.safetensors", outside)
    keys = hf.folder._file_keys(outside)
    (d / hf.INDEX_FILE).write_text(json.dumps({"weight_map": {k: "../outside.safetensors" for k in keys}}))
    with pytest.raises(errors.HFCheckpointError, match=r"weight_map\['model.embed_tokens.weight'\] is "
                                                       r"'../outside.safetensors' \(a string\); expected a"):
        hf.table_of_contents(d)


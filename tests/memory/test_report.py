"""workbench.memory.report and tables: a plan that does not fit is re-planned with a change that fits and says what to
change first; the device runtime's reserve is its own category, from the table or the override."""

from __future__ import annotations

import pytest

from workbench.core.config import load_config
from workbench.memory import report, tables, tracer

pytestmark = pytest.mark.machine_cpu_path  # quoted plans are fake-tensor traces: no CPU kernel runs (run_helpers.py)

TINY = ["--model.flavor", "tiny", "--training.seq_len", "256", "--training.local_batch_size", "2"]
MiB, GiB = 2**20, 2**30


def test_not_fitting_is_replanned_with_a_working_change(monkeypatch, capsys):
    base = tracer.trace(load_config(argv=TINY), "cpu", 1)["peak_bytes"]
    # A device just too small for the plain loss: the planner must find (by re-planning) what fits. The re-plans
    # run in this process, where the patched device exists.
    monkeypatch.setitem(tables.DEVICES, "trn2", tables.Device("cpu", 0.8 * base))
    monkeypatch.setattr(tracer, "plan_in_subprocess", lambda job, device, world, reserve_gib=None: report.plan(
        job, device, world, suggest=False, reserve_gib=reserve_gib))
    p = report.plan(load_config(argv=TINY), "trn2", 1)
    assert not p["fits"] and p["peak_bytes"] == base
    good = [s for s in p["suggestions"] if s["fits"]]
    assert good and good[-1]["peak_bytes"] < 0.8 * base
    assert "loss_chunks" in p["suggestions"][0]["change"]
    assert "DOES NOT FIT" in report.render(p) and good[-1]["change"] in report.render(p)
    # What to change: the largest category first, the tensors that make it at the peak (the logits' [tokens, vocab]
    # fp32 tensors) and its lever, whose saving is the re-planned peak (the suggestion's trace, reused).
    first = p["advice"][0]
    assert first["category"] == "logits and loss" and first["change"] == p["suggestions"][0]["change"]
    assert first["peak_bytes_after"] == p["suggestions"][0]["peak_bytes"] < p["peak_bytes"]
    assert first["top"][0]["shape"][-1] == 151_936 and first["top"][0]["dtype"] == "float32"
    assert sum(t["bytes"] for t in first["top"]) <= first["bytes"]
    # "other temporaries" is exactly the sum of its parts, and the rendered table shows them
    assert sum(p["other_parts"].values()) == p["categories"]["other temporaries"]
    text = report.render(p)
    for part in tables.OTHER_PARTS:
        assert f"  - {part}" in text
    unit = "GiB" if p["peak_bytes"] >= GiB else "MiB"
    assert f"saves {report.amount(p['peak_bytes'] - first['peak_bytes_after'], unit)} {unit}, re-planned" in text
    err = capsys.readouterr().err
    assert "tracing one training step" in err and "initial_load_model_only" not in err and "DTensor" not in err


def test_device_runtime_is_its_own_category_from_the_table_or_the_override():
    """trn2's runtime reserve: every item has a source (the microcode figure from the Neuron device-memory page,
    the rest documented assumptions); the plan adds it as "device runtime"; --reserve-gib replaces it."""
    items = tables.runtime_reserve("trn2")
    assert items[0]["source"].startswith(tables.DEVICE_MEMORY_DOC) and items[0]["bytes"] == 2 * 96 * MiB
    assert all(i["source"].startswith("assumption") for i in items[1:])
    assert tables.runtime_reserve("cpu") == []
    job = load_config(argv=TINY)
    p = report.plan(job, "trn2", 1, suggest=False)
    reserve = sum(i["bytes"] for i in items)
    assert p["categories"]["device runtime"] == reserve == 1764 * MiB
    traced = sum(v for k, v in p["categories"].items() if k != "device runtime")
    assert p["peak_bytes"] == traced + reserve
    q = report.plan(job, "trn2", 1, suggest=False, reserve_gib=0.5)
    assert q["categories"]["device runtime"] == GiB // 2 and q["peak_bytes"] == traced + GiB // 2
    assert q["device_runtime"] == [{"what": "device runtime", "bytes": GiB // 2, "source": "--reserve-gib"}]
    assert "device runtime" in report.render(p) and "--reserve-gib" in report.render(p)

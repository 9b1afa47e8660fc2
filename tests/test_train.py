"""The launch's preflight (`workbench.train.preflight`), in this process: each thing worked out once and carried
into the run, not worked out again."""

from __future__ import annotations

from pathlib import Path

from workbench.platform import titan_device

titan_device.pin("cpu")  # before torchtitan is imported (the run's config imports it)

from workbench import train  # noqa: E402
from workbench.core import flavors  # noqa: E402
from workbench.data import loader  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_the_run_reads_what_the_preflight_opened_and_no_model_is_built_before_the_run(tmp_path, monkeypatch):
    """The dataset is opened once (by the input check) and the run's loader reads those very members; the CPU
    memory floor counts the parameters by formula, so the preflight builds no model; the run's record writes the
    resolved config as it was checked."""
    opens = []
    real_open = loader.open_dataset

    def counted_open(*args, **kwargs):
        opens.append(args[0])
        return real_open(*args, **kwargs)

    def no_model(shape):
        raise AssertionError("the preflight built a model to count its parameters")

    monkeypatch.setattr(loader, "open_dataset", counted_open)
    monkeypatch.setattr(flavors, "count_params", no_model)
    checked = train.preflight(["--job.config_file", str(ROOT / "configs/cpu_dense.toml"), "--job.dump_folder",
                               str(tmp_path)], 1)
    cfg = checked.titan_config(1)
    packed = cfg.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=cfg.training.seq_len,
                                  local_batch_size=cfg.training.local_batch_size).packed
    assert opens == ["shakespeare"]
    assert len(packed.streams) == 1 and packed.streams[0] is checked.opened.members[0][1]
    assert cfg.run.config_toml() == checked.job.to_toml()
    assert cfg.run.memory_plan is checked.memory_plan is None  # a tiny CPU launch is not planned, nor measured
    assert not cfg.run.measure_memory

"""workbench.train: what the launcher checks before any process group, in this process.

Config fuzz (issue 33): mutated copies of the shipped configs either pass everything train.py checks before any
process group (`workbench.train.preflight`) or are refused with one line, never a traceback.

Each mutation carries its own verdict, written down here by kind (a value out of the field's documented range, a
device that cannot run it, a file that is no UTF-8 TOML), not asked of the validator: a mutation marked bad that
passes is a bad value accepted. Two real `python -m workbench.train` launches show the command line's side (one
line on stderr, exit code 2, no traceback). The inputs (`check_inputs`): the tokenizer and the dataset, prepared
on first use, refused when nothing can be trained on. Each thing the preflight works out is carried into the run,
not worked out again."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.data.helpers import corpus
from tests.run_helpers import ROOT
from workbench.platform import titan_device

titan_device.pin("cpu")  # before torchtitan is imported (the run's config imports it)

from workbench import train  # noqa: E402
from workbench.core import errors, flavors  # noqa: E402
from workbench.core.errors import DatasetError  # noqa: E402
from workbench.data import loader  # noqa: E402
from workbench.data import prepare as prep  # noqa: E402
from workbench.data.loader import Stream  # noqa: E402

DENSE = ROOT / "configs/cpu_dense.toml"
SEED = 33
N_MUTATIONS = 120
CPU_BASES = ("configs/cpu_dense.toml", "configs/cpu_moe.toml")  # the shipped configs that train on this machine
BASES = tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.toml")))


@dataclass(frozen=True)
class Mutation:
    kind: str
    args: tuple[str, ...]  # command-line overrides, or ("file", encoding) for a rewritten config file
    bad: bool


def _values(kind: str, key: str, bad: list, good: list) -> list[Mutation]:
    return [Mutation(kind, (f"--{key}", str(v)), True) for v in bad] + \
        [Mutation(kind, (f"--{key}", str(v)), False) for v in good]


# kind -> the mutations of that kind, each with its verdict (bad = outside the field's documented range, or
# something this CPU machine cannot run).
KINDS: dict[str, list[Mutation]] = {
    "lr": _values("lr", "optimizer.lr", ["inf", "-inf", "nan", "1e30", "-1", "0", "1e5"], ["3e-4", "1e-30", "0.01"]),
    "weight_decay": _values("weight_decay", "optimizer.weight_decay", ["-1", "nan", "inf", "5"], ["0", "0.01"]),
    "betas": _values("betas", "optimizer.beta1", ["1.5", "-0.1", "1.0", "nan"], ["0", "0.5"])
    + _values("betas", "optimizer.beta2", ["-0.1", "1", "2"], ["0.999"]),
    "eps": _values("eps", "optimizer.eps", ["-1", "0", "inf", "nan"], ["1e-8", "1e-6"]),
    "max_norm": _values("max_norm", "training.max_norm", ["-1", "0", "nan", "inf"], ["0.5", "10"]),
    "scheduler": _values("scheduler", "lr_scheduler.warmup_steps", ["-3", "-1"], ["0", "5"])
    + _values("scheduler", "lr_scheduler.decay_ratio", ["2.0", "-0.5", "nan"], ["-1", "0.0", "1.0"])
    + _values("scheduler", "lr_scheduler.min_lr_factor", ["-1", "1.5", "nan"], ["0", "0.1"])
    + _values("scheduler", "lr_scheduler.total_steps", ["0", "-2"], ["-1", "40"]),
    "seed": _values("seed", "job.seed", ["-1", "2e20", str(2**63), "1.5"], ["0", "7", str(2**63 - 1)]),
    "parallelism": _values("parallelism", "parallelism.tp", ["0", "-1", "-3"], ["1"])
    + _values("parallelism", "parallelism.ep", ["0", "-3", "-1"], ["1"])
    + _values("parallelism", "parallelism.dp_replicate", ["0", "-1"], ["1"])
    + _values("parallelism", "parallelism.dp_shard", ["0", "-2"], ["-1", "1"])
    + [Mutation("parallelism", ("--parallelism.tp", "-1", "--parallelism.dp_replicate", "-1"), True)],
    "attention": _values("attention", "model.attn_backend", ["flex", "varlen", "flash"], ["sdpa"]),
    "dataset": [Mutation("dataset", ("--training.dataset=",), True),
                Mutation("dataset", ("--training.dataset=   ",), True),
                Mutation("dataset", ("--training.dataset", "x" * 5000), True),
                Mutation("dataset", ("--training.dataset", "/nonexistent/corpus.jsonl"), True),
                Mutation("dataset", ("--training.dataset", "shakespeare"), False)],
    "batch": _values("batch", "training.local_batch_size", ["4096", "0", "-2"], ["1"]),
    "counts": _values("counts", "training.steps", [str(10**19), str(10**9 + 1)], ["20"])
    + _values("counts", "checkpoint.interval", [str(10**19)], ["5"])
    + _values("counts", "metrics.log_freq", [str(10**19)], ["2"])
    + _values("counts", "lr_scheduler.warmup_steps", [str(10**19)], ["1"])
    + _values("counts", "profiling.steps", [str(10**19)], ["1"])
    + _values("counts", "training.holdout_docs", [str(10**19)], ["2"])
    + _values("counts", "model.n_layers", ["10000000", "-1"], ["1"]),
    "neuron": _values("neuron", "neuron.init_timeout_s", ["-5", "0", str(10**19)], ["60"])
    + _values("neuron", "neuron.step_timeout_s", ["-1", str(8 * 24 * 3600)], ["900"])
    + _values("neuron", "neuron.process_group", ["'bad name'", "../x"], ["gloo"]),
    "experiment_name": [Mutation("experiment_name", ("--job.experiment_name=",), True)]
    + _values("experiment_name", "job.experiment_name", ["..", ".", "a/b", "/abs"], ["run_2"]),
    "checkpoint_folder": [Mutation("checkpoint_folder", ("checkpoint_file",), True)],
    "encoding": [Mutation("encoding", ("file", "utf-16"), True), Mutation("encoding", ("file", "binary"), True),
                 Mutation("encoding", ("file", "utf-8"), False)],
}


def mutations(rng: random.Random) -> list[tuple[str, Mutation]]:
    """N_MUTATIONS (base config, mutation) pairs: every mutation once on a CPU config, the rest drawn at random
    over all shipped configs."""
    every = [m for ms in KINDS.values() for m in ms]
    out = [(rng.choice(CPU_BASES), m) for m in every]
    while len(out) < N_MUTATIONS:
        out.append((rng.choice(BASES), rng.choice(every)))
    return out


def argv_of(base: str, m: Mutation, tmp: Path, i: int) -> list[str]:
    """The launch's arguments: the base config (rewritten for an encoding mutation) plus the mutation."""
    dump = tmp / f"out{i}"
    config = ROOT / base
    args = list(m.args)
    if m.kind == "encoding":
        config = tmp / f"config{i}.toml"
        text = (ROOT / base).read_text()
        config.write_bytes(text.encode("utf-16") if m.args[1] == "utf-16" else
                           bytes(range(256)) * 4 if m.args[1] == "binary" else text.encode())
        args = []
    if m.kind == "checkpoint_folder":  # the checkpoint folder of the run is a file
        run_dir = dump / "cpu_run"
        run_dir.mkdir(parents=True)
        (run_dir / "checkpoint").write_text("not a folder")
        args = ["--job.experiment_name", "cpu_run", "--checkpoint.enable", "true"]
    return ["--job.config_file", str(config), "--job.dump_folder", str(dump), *args]


def world_size_of(base: str) -> int:
    """The smallest world size the unmutated base config validates for (trn2 configs name their degrees)."""
    from workbench.core.config import load_config

    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        try:
            load_config(ROOT / base, world_size=n)
            return n
        except errors.ConfigError:
            continue
    raise AssertionError(f"{base} validates for no world size")


def test_fuzzed_configs_start_or_are_refused_in_one_line(tmp_path):
    rng = random.Random(SEED)
    sizes = {b: world_size_of(b) for b in BASES}
    counts = dict(tried=0, refused=0, started=0, tracebacks=0, bad_accepted=0)
    failures = []
    for i, (base, m) in enumerate(mutations(rng)):
        counts["tried"] += 1
        try:
            train.preflight(argv_of(base, m, tmp_path, i), sizes[base])
        except (errors.ConfigError, FileNotFoundError) as e:  # what train.main turns into one line, exit 2
            line = errors.recognised(e).one_line()
            assert "\n" not in line and line.startswith("workbench: ")
            counts["refused"] += 1
            if not m.bad and base in CPU_BASES:
                failures.append(f"good value refused: {base} {m.args}: {line}")
        except Exception as e:  # noqa: BLE001 - anything else would be a traceback at the command line
            counts["tracebacks"] += 1
            failures.append(f"traceback: {base} {m.args}: {type(e).__name__}: {e}")
        else:
            counts["started"] += 1
            if m.bad:
                counts["bad_accepted"] += 1
                failures.append(f"bad value accepted: {base} {m.args}")
    print(f"config fuzz: {counts}")
    assert not failures, "\n".join(failures)
    assert counts["tried"] >= 100 and counts["tracebacks"] == counts["bad_accepted"] == 0
    assert counts["started"] >= 20 and counts["refused"] >= 60  # both outcomes well exercised


def test_the_command_line_refuses_in_one_line(tmp_path):
    """Real launches (no torchrun: a lone process), run side by side: one line on stderr, exit 2, no traceback."""
    utf16 = tmp_path / "utf16.toml"
    utf16.write_bytes((ROOT / "configs/cpu_dense.toml").read_text().encode("utf-16"))
    launches = {
        "optimizer.lr=inf": ["--job.config_file", "configs/cpu_dense.toml", "--optimizer.lr", "inf"],
        "not a UTF-8 text file": ["--job.config_file", str(utf16)],
    }
    procs = {want: subprocess.Popen([sys.executable, "-m", "workbench.train", *args, "--job.dump_folder",
                                     str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for want, args in launches.items()}
    for want, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == errors.EXIT_CONFIG, err
        assert "Traceback" not in out + err and want in err
        assert len(err.strip().splitlines()) == 1 and err.startswith("workbench: config error: "), err


@pytest.mark.parametrize("argv, message", [
    (["--optimizer.lr", "1e30"], "optimizer.lr=1e+30 is out of range: valid is 0 < lr <= 10000."),
    (["--optimizer.beta1", "1.5"], "optimizer.beta1=1.5 is out of range: valid is 0 <= beta1 < 1."),
    (["--training.max_norm", "-1"], "training.max_norm=-1.0 is out of range: valid is 0 < max_norm."),
    (["--lr_scheduler.decay_ratio", "2"],
     "lr_scheduler.decay_ratio=2.0 is out of range: valid is 0 <= decay_ratio <= 1 (or -1 = decay over all "
     "post-warm-up "
     "steps)."),
    (["--job.seed", "-1"], "job.seed=-1 is out of range: valid is 0 <= seed <= 9223372036854775807."),
    (["--parallelism.ep", "0"], "parallelism.ep=0 is out of range: valid is 1 <= ep."),
    (["--training.dataset="], "training.dataset is empty"),
    (["--neuron.init_timeout_s", "-5"],
     "neuron.init_timeout_s=-5 is out of range: valid is 1 <= init_timeout_s <= 604800."),
    (["--training.steps", str(10**19)], "training.steps=10000000000000000000 is out of range: valid is 1 <= steps <= "
     "1000000000."),
    (["--job.experiment_name="], "job.experiment_name='' is empty: it must be one folder name"),
])
def test_a_range_error_names_field_value_and_range(argv, message):
    from workbench.core.config import load_config

    with pytest.raises(errors.ConfigError) as e:
        load_config(ROOT / "configs/cpu_dense.toml", argv)
    assert message in str(e.value)


def test_undecodable_file_is_a_located_bad_row(tmp_path, monkeypatch):
    """Bytes that are not UTF-8 are a bad row, skipped and located in the launcher's check (before any process
    group); `prepare --strict` refuses them in one line (tests/data/test_prepare.py)."""
    from workbench.core.config import load_config
    from workbench.data.loader import resolve
    from workbench.data.prepared import PreparedDataset
    from workbench.train import check_inputs

    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("To be, or not to be.")
    (data / "b.txt").write_bytes(b"plain start " + bytes(range(128, 256)) * 40)
    check_inputs(load_config(DENSE, ["--training.dataset", str(data), "--training.holdout_docs", "0"]))
    m = PreparedDataset(resolve(str(data))).manifest
    assert (m["documents"], m["bad_rows"], m["bad_examples"]) == (1, 1, [f"{data / 'b.txt'}:1 (not UTF-8 (byte 12))"])


@pytest.mark.parametrize("holdout", [0, 1])
def test_a_dataset_without_text_is_refused_whatever_holdout_docs(tmp_path, holdout, monkeypatch):
    from workbench.core.config import load_config
    from workbench.train import check_inputs

    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("")
    (data / "b.txt").write_text(" <|endoftext|>\n<|endoftext|> ")
    (data / "c.txt").write_text("\n")
    job = load_config(DENSE, ["--training.dataset", str(data), "--training.holdout_docs", str(holdout)])
    with pytest.raises(errors.DatasetError) as refused:
        check_inputs(job)
    assert refused.value.one_line() == (
        f"workbench: config error: training.dataset={str(data)!r}: its {3 - holdout} training document(s) hold no "
        "text (empty, whitespace or <|endoftext|> only). Fix: point --training.dataset at files with text.")
    (data / "a.txt").write_text("Now is the winter of our discontent")
    check_inputs(job)  # one document with text is enough


def test_check_inputs_refuses_before_training(tmp_path, monkeypatch):
    """The launcher's check (every rank, before any process group) prepares a raw dataset and refuses a bad one."""
    import workbench
    from workbench.train import check_inputs

    cache = tmp_path / "cache"
    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(cache))
    src = corpus(tmp_path, 3)
    check_inputs(workbench.load_config(DENSE, training={"dataset": str(src)}))
    assert len(list(cache.iterdir())) == 1  # prepared into the cache once
    with pytest.raises(DatasetError, match="holdout_docs=3 leaves no training documents"):
        check_inputs(workbench.load_config(DENSE,
                                           training={"dataset": str(src), "holdout_docs": 3}))
    folder = next(cache.iterdir())
    assert Stream(prep.PreparedDataset(folder), 0, 0, "x").total == prep.PreparedDataset(folder).manifest["tokens"]


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
    checked = train.preflight(["--job.config_file", str(DENSE), "--job.dump_folder",
                               str(tmp_path)], 1)
    cfg = checked.titan_config(1)
    packed = cfg.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=cfg.training.seq_len,
                                  local_batch_size=cfg.training.local_batch_size).packed
    assert opens == ["shakespeare"]
    assert len(packed.streams) == 1 and packed.streams[0] is checked.opened.members[0][1]
    assert cfg.run.config_toml() == checked.job.to_toml()
    assert cfg.run.memory_plan is checked.memory_plan is None  # a tiny CPU launch is not planned, nor measured
    assert not cfg.run.measure_memory

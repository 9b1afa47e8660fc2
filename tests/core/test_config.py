"""The TOML + CLI config layer: overrides, the article's field names, and every error before training starts."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.run_helpers import ROOT
from workbench.core import errors, flavors
from workbench.core.config import help_text, load_config, parse_cli, validate
from workbench.core.errors import ConfigError

ARTICLE = ROOT / "configs" / "qwen3_trainium.toml"
DENSE = ROOT / "configs" / "cpu_dense.toml"


def test_article_config_loads_with_its_field_names():
    cfg = load_config(ARTICLE, world_size=64)  # the article's file shards over 64 ranks
    assert cfg.parallelism.dp_shard == 64  # job.model_parallel_size
    assert cfg.checkpoint.enable is True  # job.enable_checkpoint
    assert cfg.checkpoint.folder == "checkpoint"  # job.checkpoint_folder
    assert cfg.training.local_batch_size == 2  # training.batch_size (article: 4; see the file's header)
    assert cfg.training.gradient_accumulation_steps == 8
    assert cfg.model.flavor == "30B-A3B" and cfg.model.norm_type == "RMSNorm"


def test_world_size_is_passed_not_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "64")
    with pytest.raises(ConfigError, match="do not fit 1 rank"):
        load_config(ARTICLE)  # default world_size=1, whatever the environment says


def test_shape_is_resolved_once_and_carried(monkeypatch):

    calls = []
    real = flavors.resolve
    monkeypatch.setattr(flavors, "resolve", lambda *a: calls.append(a) or real(*a))
    cfg = load_config(None, model={"flavor": "tiny-moe"})
    assert cfg.shape == flavors.FLAVORS["tiny-moe"] and cfg.flavor_name == "tiny-moe"
    cfg.shape, cfg.shape  # noqa: B018
    assert calls == [("tiny-moe", "")]  # validation resolved it; later reads use the carried shape
    cfg.model.flavor = "tiny"
    assert cfg.shape == flavors.FLAVORS["tiny"] and len(calls) == 2  # a changed flavor is resolved again
    assert "shape" not in cfg.to_dict() and "_shape_cache" not in cfg.to_toml()


@pytest.mark.parametrize("backend, argv, message", [
    ("huggingface_v5", ["--parallelism.tp", "2"], "huggingface_v5 supports FSDP"),
    ("huggingface_v5", ["--model.attn_backend", "flex"], "huggingface_v5 uses transformers' sdpa"),
    ("nki_moe", ["--model.moe_experts_impl", "loop"], "nki_moe computes its experts blockwise"),
    ("nki_moe", ["--parallelism.ep", "2"], "expert parallelism is only wired for the native backend"),
    ("nki_moe", ["--model.moe_block_size", "200"], "model.moe_block_size=200: the NKI kernels take a block of"),
])
def test_each_backend_checks_its_own_rules(backend, argv, message):
    from workbench.core.config import BACKEND_RULES

    job = load_config(None, model={"flavor": "tiny-moe", "backend": "native"}, world_size=2)
    for i in range(0, len(argv), 2):
        from workbench.core.config.load import _set

        _set(job, argv[i][2:], argv[i + 1])
    job.model.backend = backend
    with pytest.raises(ConfigError, match=message):
        BACKEND_RULES[backend](job)  # the rule's one home
    with pytest.raises(ConfigError, match=message):
        validate(job, world_size=2)  # reached through validation


@pytest.mark.parametrize("toml", sorted(p.name for p in (ROOT / "configs").glob("*.toml")))
def test_load_config_imports_no_torch(toml):
    """The bottom floor (config, flavors, errors) validates a TOML, backend rules included, without torch."""
    code = (f"import sys; from workbench.core.config import load_config; load_config('configs/{toml}', world_size=64); "
            "print(sorted(m for m in ('torch', 'torchtitan', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_cli_overrides_every_form():
    cfg = load_config(DENSE, argv=["--training.steps", "7", "--optimizer.lr=0.01", "--checkpoint.enable",
                                   "--job.model_parallel_size", "-1"])
    got = (cfg.training.steps, cfg.optimizer.lr, cfg.checkpoint.enable, cfg.parallelism.dp_shard)
    assert got == (7, 0.01, True, -1)
    assert parse_cli(["--a.b", "--c.d", "1"]) == [("a.b", "true"), ("c.d", "1")]
    cfg = load_config(DENSE, training={"steps": 3}, model__backend="huggingface_v5")
    assert cfg.training.steps == 3 and cfg.model.backend == "huggingface_v5"


@pytest.mark.parametrize("argv, message", [
    (["--model.flavor", "72B"], "Qwen3 has no 72B model"),
    (["--model.flavor", "8b"], "Did you mean '8B'?"),
    (["--training.stepz", "3"], "Did you mean 'training.steps'?"),
    (["--trainning.steps", "3"], "Did you mean 'training.steps'?"),
    (["--training.steps", "abc"], "training.steps expects int"),
    (["--training.steps", "0"], "training.steps must be positive"),
    (["--checkpoint.enable", "maybe"], "checkpoint.enable expects bool"),
    (["--model.backend", "jax"], "model.backend must be one of huggingface_v5, native, nki_moe"),
    (["--model.backend", "nki_moe"], "flavor 'tiny' is dense"),
    (["--model.norm_type", "LayerNorm"], "Qwen3 uses RMSNorm"),
    (["--model.name", "llama3"], "trains Qwen3 only"),
    (["--job.model_parallel_size", "8"], "Parallel degrees do not fit 1 rank(s)"),
    (["--training.global_batch_size", "3"], "must be a positive multiple of local_batch_size"),
    (["--training.global_batch_size", "4", "--training.gradient_accumulation_steps", "3"], "contradicts"),
    (["--training.seq_len", "100000"], "exceeds the model's max_seq_len"),
    (["--model.hf_checkpoint", "/nonexistent/ckpt"], "is not a directory"),
    (["steps", "3"], "options look like --section.key value"),
    (["--optimizer.lr", "0"], "optimizer.lr must be positive; got 0.0. Set e.g. --optimizer.lr 3e-4."),
    (["--checkpoint.interval", "0"], "checkpoint.interval must be positive; got 0."),
    (["--checkpoint.keep_latest_k", "1"], "checkpoint.keep_latest_k=1: keep 0 (all) or at least 2, so that the last"),
    (["--checkpoint.keep_latest_k", "-1"], "checkpoint.keep_latest_k=-1: keep 0 (all) or at least 2"),
    (["--profiling.enable", "true", "--profiling.start_step", "0"],
     "profiling: start_step=0, steps=2 must profile at least one of the run's steps 1..30 (start_step within them"),
    (["--profiling.enable", "true", "--profiling.start_step", "31"], "start_step=31, steps=2 must profile"),
    (["--profiling.enable", "true", "--profiling.steps", "0"], "start_step=3, steps=0 must profile"),
    (["--metrics.log_freq", "0"], "metrics.log_freq must be positive; got 0."),
    (["--training.holdout_docs", "-1"], "training.holdout_docs must be >= 0; got -1."),
    (["--training.loss_chunks", "-1"], "training.loss_chunks=-1 must be 0 (plain loss) or divide"),
    (["--training.loss_chunks", "3"], "training.loss_chunks=3 must be 0 (plain loss) or divide training.seq_len (128)"),
])
def test_bad_input_is_a_clear_error(argv, message):
    with pytest.raises(ConfigError) as e:
        load_config(DENSE, argv=argv)
    assert message in str(e.value)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    flat = tmp_path / "flat.toml"
    flat.write_text("steps = 3\n")
    with pytest.raises(ConfigError, match="must be a \\[section\\] table"):
        load_config(flat)


def test_flavor_required_without_checkpoint():
    with pytest.raises(ConfigError, match="model.flavor is not set"):
        load_config()


def test_world_size_drives_dp_validation():
    cfg = load_config(DENSE)
    cfg.parallelism.dp_shard = 2
    validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match="do not fit 4 rank"):
        validate(cfg, world_size=4)


@pytest.mark.parametrize("argv", [
    ["--checkpoint.keep_latest_k", "0"], ["--checkpoint.keep_latest_k", "2"], ["--checkpoint.interval", "1"],
    ["--profiling.enable", "true", "--profiling.start_step", "1", "--profiling.steps", "1"],
    ["--profiling.enable", "true", "--profiling.start_step", "30"],
    ["--profiling.start_step", "0"],  # only checked when profiling is on
    ["--metrics.log_freq", "1"], ["--training.holdout_docs", "0"], ["--training.loss_chunks", "4"],
])
def test_boundary_values_that_are_accepted(argv):
    load_config(DENSE, argv=argv)


def test_help_lists_every_section():
    text = help_text()
    for section in ("[job]", "[model]", "[optimizer]", "[lr_scheduler]", "[training]", "[parallelism]",
                    "[checkpoint]", "[profiling]", "[metrics]"):
        assert section in text
    assert "--training.steps" in text and "job.model_parallel_size -> parallelism.dp_shard" in text


@pytest.mark.parametrize("args, message", [
    (["--model.flavor", "72B"], "Valid flavors: 0.6B, 1.7B, 4B, 8B, 14B, 32B, 30B-A3B, 235B-A22B"),
    (["--training.stepz", "3"], "training.steps"),
    (["--job.model_parallel_size", "-1", "--training.dataset", "/nonexistent/corpus"],
     "does not exist. Use 'shakespeare'"),
    (["--job.model_parallel_size", "-1", "--model.tokenizer_path", "/nonexistent/tok"], "No tokenizer.json"),
    (["--job.model_parallel_size", "-1", "--training.holdout_docs", "38"], "leaves no training documents"),
])
def test_cli_exits_nonzero_before_any_process_group(args, message):
    """The acceptance commands: `python -m workbench.train --job.config_file configs/qwen3_trainium.toml ...`."""
    proc = subprocess.run([sys.executable, "-m", "workbench.train", "--job.config_file", str(ARTICLE), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "torch.distributed" not in proc.stderr and "Traceback" not in proc.stderr


def test_load_model_applies_the_backend_rules():
    import workbench

    with pytest.raises(ConfigError, match="flavor 'tiny' is dense"):
        workbench.load_model(load_config(DENSE), backend="nki_moe")


@pytest.mark.parametrize("name", ["huggingface_v5", "native", "nki_moe"])
def test_each_backend_module_satisfies_the_backend_protocol(name):
    import importlib
    import inspect

    from workbench import backends
    from workbench.core.config import BACKENDS

    assert set(BACKENDS) == {"huggingface_v5", "native", "nki_moe"}
    module = backends.get(name)
    assert isinstance(module, backends.BackendModule)
    flavors_module = importlib.import_module("workbench.core.flavors")
    assert not isinstance(flavors_module, backends.BackendModule)  # the check can fail
    for member in ("model_config", "model_spec", "hf_adapter"):
        want = list(inspect.signature(getattr(backends.BackendModule, member)).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(module, member)).parameters) == want, (name, member)


# ---- the batch-size and parallel-degree rules at world size > 1 (data-parallel ranks = world / tp) ----------------

TP2 = ["--model.backend", "native", "--parallelism.tp", "2", "--training.local_batch_size", "2"]


@pytest.mark.parametrize("world, argv, accumulation", [
    (8, [*TP2, "--training.global_batch_size", "8"], 1),  # 2 x (8 / 2) ranks = 8 per pass
    (8, [*TP2, "--training.global_batch_size", "24"], 1),  # accumulation 1 = derived from the global batch
    (8, [*TP2, "--training.global_batch_size", "24", "--training.gradient_accumulation_steps", "3"], 3),
    (4, ["--training.local_batch_size", "3", "--training.global_batch_size", "24",
         "--training.gradient_accumulation_steps", "2"], 2),  # FSDP only: 3 x 4 = 12 per pass
    (8, [*TP2, "--parallelism.dp_shard", "2", "--parallelism.dp_replicate", "2",
         "--training.global_batch_size", "16", "--training.gradient_accumulation_steps", "2"], 2),
])
def test_global_batch_size_over_several_ranks(world, argv, accumulation):
    cfg = load_config(DENSE, argv=argv, world_size=world)
    assert cfg.training.gradient_accumulation_steps == accumulation


@pytest.mark.parametrize("world, argv, message", [
    (8, [*TP2, "--training.global_batch_size", "12"],
     "training.global_batch_size=12 must be a positive multiple of local_batch_size (2) x data-parallel ranks (4) "
     "= 8."),
    (8, [*TP2, "--training.global_batch_size", "4"], "= 8."),  # below one pass
    (8, [*TP2, "--training.global_batch_size", "0"], "global_batch_size=0 must be a positive multiple"),
    (8, [*TP2, "--training.global_batch_size", "16", "--training.gradient_accumulation_steps", "4"],
     "training.gradient_accumulation_steps=4 contradicts global_batch_size=16 (2 accumulation steps); set only one"),
    (4, ["--training.local_batch_size", "3", "--training.global_batch_size", "18"],
     "local_batch_size (3) x data-parallel ranks (4) = 12."),
    (6, ["--model.backend", "native", "--parallelism.tp", "3"],
     "training.seq_len=128 must be divisible by parallelism.tp=3."),
    (8, [*TP2, "--training.seq_len", "96", "--training.loss_chunks", "32"],
     "training.loss_chunks=32 must be 0 (plain loss) or divide training.seq_len (96) per tensor-parallel rank"),
    (8, [*TP2, "--parallelism.dp_shard", "3"], "Parallel degrees do not fit 8 rank(s): dp_shard (3"),
    (6, [*TP2, "--parallelism.dp_replicate", "2"], "Parallel degrees do not fit 6 rank(s)"),
    (2, [*TP2, "--parallelism.dp_shard", "2"], "Parallel degrees do not fit 2 rank(s)"),
])
def test_multi_rank_and_tp_rules_refuse(world, argv, message):
    with pytest.raises(ConfigError) as e:
        load_config(DENSE, argv=argv, world_size=world)
    assert message in str(e.value)


@pytest.mark.parametrize("world, argv", [
    (8, [*TP2, "--training.seq_len", "96", "--training.loss_chunks", "16"]),  # 96 / (16 x 2) = 3 rows per chunk
    (8, [*TP2, "--parallelism.dp_shard", "4"]),
    (8, [*TP2, "--parallelism.dp_shard", "2", "--parallelism.dp_replicate", "2"]),
    (6, ["--model.backend", "native", "--parallelism.tp", "3", "--training.seq_len", "255"]),
])
def test_multi_rank_and_tp_rules_accept(world, argv):
    load_config(DENSE, argv=argv, world_size=world)


@pytest.mark.parametrize("lr", ["0", "-0.01", "-1e-12", "nan"])
def test_non_positive_lr_is_refused(lr):
    with pytest.raises(ConfigError, match=rf"optimizer.lr must be positive; got {re.escape(str(float(lr)))}\."):
        load_config(DENSE, ["--optimizer.lr", lr])
    assert load_config(DENSE, ["--optimizer.lr", "1e-30"]).optimizer.lr == 1e-30  # the edge: any positive lr


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../../elsewhere", "/abs/run", "x" * 300])
def test_experiment_name_is_one_folder_name(name):
    with pytest.raises(errors.ConfigError) as refused:
        load_config(DENSE, job={"experiment_name": name})
    assert refused.value.one_line().startswith(f"workbench: config error: job.experiment_name={name[:60]!r} ")
    assert "one folder name" in refused.value.message
    assert load_config(DENSE, job={"experiment_name": "run-2.b"}).run_dir.name == "run-2.b"


def test_an_absurd_depth_is_refused_before_any_estimate():
    """10^7 layers: refused by range when the config is read (the memory gate's estimate would build every layer)."""
    with pytest.raises(errors.ConfigError, match=r"model.n_layers=10000000 is out of range: valid is 0 <= n_layers "
                                                 r"<= 1024 \(0 = the flavor's\)"):
        load_config(DENSE, model={"n_layers": 10_000_000})
    assert load_config(DENSE, model={"n_layers": 3}).shape.n_layers == 3

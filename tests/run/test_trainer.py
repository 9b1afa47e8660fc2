"""training.loss_chunks: torchtitan's ChunkedLossWrapper (native, nki_moe) and the same chunked lm_head + CE for
huggingface_v5 give the plain loss and gradients (fp32, within 1e-6), through the real model, FSDP2 wrapping and
loss the trainer builds (`workbench.memory.tracer.build`), in-process on a one-rank gloo group."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.run_helpers import ROOT, free_port
from workbench.core.config import load_config
from workbench.core.errors import ConfigError
from workbench.memory import tracer


@pytest.fixture(scope="module")
def one_rank():
    from workbench.platform import titan_device

    titan_device.pin("cpu")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _loss_and_grads(job, state=None):
    pd = tracer.parallel_dims_for(job, "cpu", 1)
    torch.manual_seed(0)
    b = tracer.build(job, "cpu", 1, pd)
    if state is not None:
        b.model.load_state_dict(state)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 151_936, (2, 64), generator=g)
    labels = torch.randint(0, 151_936, (2, 64), generator=g)
    pred = b.model(tokens)
    loss, _ = b.loss_fn(pred, labels, torch.tensor(float(labels.numel())))
    loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in b.model.named_parameters()}
    return loss.detach(), grads, b.model.state_dict()


@pytest.mark.parametrize("backend,flavor", [("native", "tiny"), ("huggingface_v5", "tiny"), ("nki_moe", "tiny-moe")])
def test_chunked_loss_equals_plain(one_rank, backend, flavor):
    args = ["--model.flavor", flavor, "--model.backend", backend, "--training.seq_len", "64",
            "--training.local_batch_size", "2"]
    plain_loss, plain_grads, state = _loss_and_grads(load_config(argv=args))
    chunk_loss, chunk_grads, _ = _loss_and_grads(load_config(argv=[*args, "--training.loss_chunks", "4"]), state)
    assert plain_loss.item() > 10  # ~ln(151936) = 11.9 from a fresh init: a real loss, not a stub
    assert abs(chunk_loss.item() - plain_loss.item()) <= 1e-6 * max(1.0, abs(plain_loss.item()))
    assert plain_grads.keys() == chunk_grads.keys()
    for name, g in plain_grads.items():
        assert torch.allclose(chunk_grads[name], g, rtol=1e-5, atol=1e-6), (
            f"{name}: max diff {(chunk_grads[name] - g).abs().max().item():.3g}")
    lm = [n for n in plain_grads if "lm_head" in n or "embed" in n]
    assert lm and all(plain_grads[n].abs().sum() > 0 for n in lm)  # the chunked path trains the head too


def test_loss_chunks_must_divide_seq_len():
    with pytest.raises(ConfigError, match="loss_chunks"):
        load_config(argv=["--model.flavor", "tiny", "--training.seq_len", "100", "--training.loss_chunks", "8"])


def test_resume_keeps_the_checkpoints_global_batch_or_refuses_naming_the_setting():
    from workbench.core.config import load_config
    from workbench.run.trainer import resume_batch

    record = {"global_batch_size": 12, "local_batch_size": 2, "data_parallel_ranks": 2,
              "gradient_accumulation_steps": 3}
    training = load_config(ROOT / "configs/cpu_dense.toml").training  # local batch 2, global batch from the ranks
    assert resume_batch(None, training, 1, None) is None  # a fresh run
    assert resume_batch(record, training, 6, 8) is None  # 6 ranks x 2 = 12 rows: what the config gives already
    kept, line = resume_batch(record, training, 3, 8)
    assert kept == 12 and "3 data-parallel rank(s) x local batch 2 x 2 accumulation step(s) (step 8 trained with 2 " \
                          "data-parallel rank(s) x local batch 2 x 3 accumulation step(s))" in line
    with pytest.raises(ConfigError) as e:  # 4 ranks x 2 = 8 rows per pass do not divide 12
        resume_batch(record, training, 4, 8)
    assert "global batch of 12 rows, which 4 data-parallel rank(s) x training.local_batch_size 2 = 8 rows per pass " \
           "do not divide" in e.value.message and e.value.fix.startswith("set --training.local_batch_size 1 ")
    with pytest.raises(ConfigError, match="global batch of 12 rows") as e:
        resume_batch(record, training, 5, 8)
    assert e.value.fix.startswith("resume on a number of data-parallel ranks that divides 12")
    training.global_batch_size = 8  # set on purpose: wins, and the line says so
    assert resume_batch(record, training, 4, 8) == (8, "workbench: resuming with training.global_batch_size=8 as set; "
                                                       "the checkpoint's was 12 (step 8 trained with 2 data-parallel "
                                                       "rank(s) x local batch 2 x 3 accumulation step(s)).")

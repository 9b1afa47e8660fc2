"""Packed documents that never see each other (workbench/backends/attention.py), all in process on CPU, fp32.

* the boundary function: fixed capacity (the same shapes whatever the number of documents; no data-dependent op:
  it runs under fake tensors), a padded tail as one more document, a row of one document = plain causal;
* the CPU mask path (SDPA with the additive block-causal mask, `BlockCausalSDPA`) equal to each document run
  alone, outputs and gradients; the varlen fixed-capacity metadata against an independent per-document SDPA loop
  (`varlen_attn` has no CPU kernel); flex's mask_mod against the dense mask (flex runs forward eagerly on CPU);
* the loader with `training.document_mask`: positions restart after every <|endoftext|>, no target crosses one;
* packed parity on all three backends against transformers running each document alone (tiny dense and MoE
  checkpoints written by transformers): `python -m workbench.parity --packed`;
* the real trainer's step (post_dataloading_process, forward, torchtitan's loss, backward) on every backend: the
  loss of document 2 has exactly zero gradient on the input embeddings of documents 1 and 3;
* the memory plan files the mask as "attention mask": B x S x S x 4 bytes, by hand.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from workbench.platform import titan_device

titan_device.pin("cpu")

from workbench.backends import attention  # noqa: E402

GQA = dict(heads=4, kv_heads=2, head_dim=8)


def positions_of(*rows: list[int]) -> torch.Tensor:
    """[B, S] positions of rows given as document lengths."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def qkv(B: int, S: int, seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, GQA["heads"], S, GQA["head_dim"])] + [(B, GQA["kv_heads"], S, GQA["head_dim"])] * 2
    return [torch.randn(s, generator=g).requires_grad_(grad) for s in shapes]


def each_document_alone(q, k, v, lengths: list[int]) -> torch.Tensor:
    """The oracle: plain causal SDPA on every document separately, concatenated (one row)."""
    outs, a = [], 0
    for n in lengths:
        outs.append(F.scaled_dot_product_attention(q[:, :, a:a + n], k[:, :, a:a + n], v[:, :, a:a + n],
                                                   is_causal=True, enable_gqa=True))
        a += n
    return torch.cat(outs, dim=2)


# --------------------------------------------------------------------------------------------
# The boundary function
# --------------------------------------------------------------------------------------------


def test_boundaries_have_fixed_capacity_whatever_the_documents():
    few = attention.document_boundaries(positions_of([10, 6], [16]))
    many = attention.document_boundaries(positions_of([1, 3, 2, 4, 6], [2, 2, 2, 2, 8]))
    for docs in (few, many):
        assert docs.ids.shape == (2, 16) and docs.cu_seqlens.shape == (33,) and docs.max_seqlen == 16
        assert docs.ids.dtype == docs.cu_seqlens.dtype == torch.int32
    # document starts over the flattened batch, in order, then B * S to the end
    assert few.cu_seqlens.tolist() == [0, 10, 16] + [32] * 30
    assert many.cu_seqlens.tolist() == [0, 1, 4, 6, 10, 16, 18, 20, 22, 24] + [32] * 23
    assert many.ids[0].tolist() == [0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4]
    # no data-dependent op: the same code runs on fake tensors (shapes only), e.g. when the memory plan traces it
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = attention.document_boundaries(positions_of([3, 5, 8], [16]))
        mask = attention.block_causal_mask(fake, torch.float32)
    assert fake.cu_seqlens.shape == (33,) and mask.shape == (2, 1, 16, 16)


def test_a_padded_tail_is_one_more_document_and_one_document_is_plain_causal():
    docs = attention.document_boundaries(positions_of([5, 7, 4]))  # the last 4: padding (positions restart at it)
    mask = attention.block_causal_mask(docs)[0, 0]
    assert not mask[12:, :12].any() and not mask[:12, 12:].any()
    assert mask[12:, 12:].equal(torch.ones(4, 4, dtype=torch.bool).tril())
    one = attention.block_causal_mask(attention.document_boundaries(torch.arange(16)))
    assert one[0, 0].equal(torch.ones(16, 16, dtype=torch.bool).tril())
    # the row's first token starts a document even if its position is not 0
    assert attention.document_boundaries(torch.tensor([[3, 4, 0, 1]])).ids.tolist() == [[0, 0, 1, 1]]


# --------------------------------------------------------------------------------------------
# Each kernel's mask against each document run alone
# --------------------------------------------------------------------------------------------


def test_cpu_mask_path_equals_each_document_alone_forward_and_backward():
    """BlockCausalSDPA with the trainer's mask (additive, fp32) = SDPA on each document by itself; also the
    gradients of q, k, v. Without the mask (plain causal) the row is not the documents apart."""
    lengths = [11, 7, 14]
    positions = positions_of(lengths)
    sdpa = attention.BlockCausalSDPA(attention.BlockCausalSDPA.Config())
    q, k, v = qkv(1, 32, grad=True)
    mask = attention.block_causal_mask(attention.document_boundaries(positions), torch.float32)
    out = sdpa(*(t.transpose(1, 2) for t in (q, k, v)), attention_masks=mask, enable_gqa=True).transpose(1, 2)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = each_document_alone(q2, k2, v2, lengths)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=0)
    plain = sdpa(*(t.transpose(1, 2) for t in (q, k, v)), enable_gqa=True).transpose(1, 2)
    assert (plain - ref).abs().max() > 0.1


def test_varlen_fixed_capacity_metadata_equals_a_per_document_loop():
    """`varlen_attn` has no CPU kernel: its metadata is checked by reading it as varlen does (every [start, end)
    pair of cu_seqlens over the flattened batch is one causal sequence, empty pairs add nothing) against the dense
    block-causal mask, on a batch with rows of different document counts."""
    positions = positions_of([5, 9, 2], [16])
    meta = attention.attention_masks(_cfg("varlen"), positions)
    assert (meta.max_q, meta.max_k) == (16, 16) and meta.cu_seq_q is meta.cu_seq_k
    q, k, v = (t.transpose(1, 2).reshape(32, -1, GQA["head_dim"]) for t in qkv(2, 16))  # [T, N, H]
    out = torch.zeros(32, GQA["heads"], GQA["head_dim"])
    cu = meta.cu_seq_q.tolist()
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        if b > a:
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                      v[a:b].transpose(0, 1), is_causal=True,
                                                      enable_gqa=True).transpose(0, 1)
    dense = F.scaled_dot_product_attention(*qkv(2, 16), enable_gqa=True,
                                           attn_mask=attention.block_causal_mask(attention.document_boundaries(positions)))
    torch.testing.assert_close(out.view(2, 16, -1, GQA["head_dim"]).transpose(1, 2), dense, atol=1e-6, rtol=0)
    assert len([a for a, b in zip(cu[:-1], cu[1:], strict=True) if b > a]) == 4  # 3 + 1 documents


def test_flex_mask_mod_equals_the_dense_mask():
    """flex's BlockMask of the documents (eager on CPU, forward only) gives the dense mask's attention, and its
    mask_mod, evaluated everywhere, is the dense mask."""
    from torch.nn.attention.flex_attention import create_mask, flex_attention

    positions = positions_of([70, 20, 38], [128])  # over one 128-token flex block and across blocks
    docs = attention.document_boundaries(positions)
    dense = attention.block_causal_mask(docs)
    assert create_mask(attention.document_mask_mod(docs), 2, None, 128, 128, device="cpu").equal(dense)
    block_mask = attention.attention_masks(_cfg("flex"), positions)
    q, k, v = qkv(2, 128)
    with torch.no_grad():
        out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True),
                               atol=1e-6, rtol=0)


def _cfg(backend: str):
    """A tiny native model config whose attention is `backend` (the memory of the config, not of a model)."""
    from workbench.core import flavors

    return flavors.titan_model_config(flavors.get_shape("tiny"), attn_backend=backend)


def test_mask_kind_follows_the_config():
    from workbench.backends import huggingface_v5, native
    from workbench.core.config import load_config

    def kind(backend, **training):
        job = load_config("configs/cpu_dense.toml", model__backend=backend,
                          **{f"training__{k}": v for k, v in training.items()})
        return attention.mask_kind((native if backend == "native" else huggingface_v5).model_config(job, job.shape))

    assert kind("native") is None and kind("huggingface_v5") is None  # isolation off: SDPA's is_causal, unchanged
    assert kind("native", document_mask=True) == kind("huggingface_v5", document_mask=True) == "dense"
    assert attention.mask_kind(_cfg("flex")) == "flex" and attention.mask_kind(_cfg("varlen")) == "varlen"


# --------------------------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------------------------


def test_loader_positions_restart_after_every_endoftext_and_no_target_crosses_one(tmp_path, monkeypatch):
    """Read independently from the tokens: a document starts after each <|endoftext|>; its positions count from 0
    there, and the target of an <|endoftext|> (the next document's first token) is not trained. The tokens are
    those of the plain stream."""
    import itertools

    from workbench.data import prepare
    from workbench.data.loader import PackedDataset

    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i} " + "lorem ipsum " * (1 + i % 7)}) + "\n"
                           for i in range(40)))
    prepare.prepare(str(src), tmp_path / "p", workers=1, progress=False)
    eos = 151643
    plain = list(itertools.islice(PackedDataset(str(tmp_path / "p"), "", 64, holdout_docs=0), 6))
    isolated = list(itertools.islice(PackedDataset(str(tmp_path / "p"), "", 64, holdout_docs=0,
                                                   document_mask=True), 6))
    starts = 0
    for (x, y), (xi, yi) in zip(plain, isolated, strict=True):
        assert xi["input"].equal(x["input"])
        after_eos = torch.cat([torch.tensor([True]), x["input"][:-1] == eos])
        expected, p = [], 0
        for new in after_eos.tolist():
            p = 0 if new else p + 1
            expected.append(p)
        assert xi["positions"].tolist() == expected
        assert yi.equal(torch.where(x["input"] == eos, -100, y))
        starts += int(after_eos[1:].sum())
    assert starts >= 6  # rows of several documents were read


# --------------------------------------------------------------------------------------------
# Packed parity, every backend
# --------------------------------------------------------------------------------------------


def test_packed_parity_dense_through_the_command(checkpoints, tmp_path, capsys):
    from workbench import parity

    out = tmp_path / "packed.json"
    assert parity.main([str(checkpoints["dense"]), "--packed", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["model"]: r for r in report["rows"]}
    assert report["settings"]["doc_lengths"] == [24, 17, 23]
    for name in ("huggingface_v5", "native"):
        assert rows[name]["status"] == "ok" and rows[name]["packed_max_abs"] <= 1e-5, rows[name]
        assert rows[name]["causal_max_abs"] > 1e-2  # the same row without isolation: the check can fail
    assert rows["nki_moe"]["status"] == "skipped"  # dense checkpoint
    assert "packed_max_abs" in capsys.readouterr().out


def test_packed_parity_moe_every_backend(checkpoints):
    from workbench import parity

    table = parity.run_packed_parity(checkpoints["moe"])
    assert list(table["model"]) == list(parity.BACKENDS) and set(table["status"]) == {"ok"}
    assert (table["packed_max_abs"] <= 1e-5).all(), table
    assert (table["causal_max_abs"] > 1e-2).all(), table


@pytest.mark.parametrize("backend", ["huggingface_v5", "native"])
def test_the_explicit_mask_alone_keeps_documents_apart(checkpoints, backend):
    """The boundaries reach the attention as the mask, not through positions: given continuous positions (nothing
    to infer packing from; transformers would infer it from restarting ones) and the mask of the documents, each
    document's logits are those of the document alone (RoPE depends on relative positions only)."""
    from workbench import parity

    settings = parity.Settings()
    model, _ = parity.backend_model(backend, checkpoints["dense"], settings, document_mask=True)
    ref, _ = parity.reference_model(checkpoints["dense"])
    docs = parity.packed_documents(settings, ref.config.vocab_size)
    masks = attention.attention_masks(model.workbench_info.model_config, positions_of(settings.doc_lengths))
    row = torch.cat(docs)[None]
    with torch.no_grad():
        got = model.eval()(row, positions=torch.arange(row.shape[1])[None], attention_masks=masks)[0]
        expected = torch.cat([ref.eval()(input_ids=d[None]).logits[0] for d in docs])
    assert (got - expected).abs().max() <= 1e-4


# --------------------------------------------------------------------------------------------
# The real trainer's step: no gradient crosses a document
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,config", [("native", "cpu_dense"), ("huggingface_v5", "cpu_dense"),
                                            ("nki_moe", "cpu_moe")])
def test_trainer_step_no_gradient_crosses_documents(backend, config, tmp_path):
    """WorkbenchTrainer built in process (one gloo rank) with training.document_mask; its forward_backward_step
    (post_dataloading_process, forward, torchtitan's loss, backward) on one row of three documents, labels only in
    document 2: the input embeddings of documents 1 and 3 get exactly zero gradient, document 2's do not; the model
    was handed the documents' mask."""
    from benchmarks.attention_step_time import one_rank_trainer
    from workbench.core.config import load_config

    job = load_config(f"configs/{config}.toml", model__backend=backend, training__document_mask=True,
                      training__seq_len=64, training__local_batch_size=1, job__dump_folder=str(tmp_path))
    positions = positions_of([20, 25, 19])
    with one_rank_trainer(job) as trainer:
        model = trainer.model_parts[0]
        embedding = model.hf.model.embed_tokens if backend == "huggingface_v5" else model.tok_embeddings
        seen = {}

        def keep(module, args, out):
            out.retain_grad()
            seen["h"] = out

        embedding.register_forward_hook(keep)
        model.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs=kwargs), with_kwargs=True)
        tokens = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(0))
        labels = torch.full((1, 64), -100)
        labels[0, 20:45] = tokens[0, 21:46]  # document 2 = tokens 20..44
        trainer.forward_backward_step(input_dict={"input": tokens, "positions": positions}, labels=labels,
                                      global_valid_tokens=torch.tensor(25.0))
        grad = seen["h"].grad[0].abs().sum(-1)
    assert grad[:20].max() == 0 and grad[45:].max() == 0
    assert grad[20:45].min() > 0
    # explicitly: the model got the masks of the boundaries (transformers is never left to infer them from positions)
    expected = attention.block_causal_mask(attention.document_boundaries(positions), torch.float32)
    assert seen["kwargs"]["attention_masks"].equal(expected)


# --------------------------------------------------------------------------------------------
# The memory plan
# --------------------------------------------------------------------------------------------


def test_memory_plan_counts_the_mask():
    """With training.document_mask the traced step builds the mask from rows of two documents: one fp32 additive
    [B=2, 1, S=256, S] mask shared by the layers, 2 x 256 x 256 x 4 = 524,288 bytes, its own category; off, none."""
    from workbench.core.config import load_config
    from workbench.memory import tracer

    tiny = ["--model.flavor", "tiny", "--training.seq_len", "256", "--training.local_batch_size", "2"]
    on = tracer.trace(load_config(argv=[*tiny, "--training.document_mask", "true"]), "cpu", 1, progress=lambda m: None)
    assert on["categories"]["attention mask"] == 2 * 256 * 256 * 4
    assert on["categories"]["attention scores"] == 0  # the CPU flash kernel takes the mask: no S x S scores
    off = tracer.trace(load_config(argv=tiny), "cpu", 1, progress=lambda m: None)
    assert off["categories"]["attention mask"] == 0
    assert on["peak_bytes"] - off["peak_bytes"] >= 2 * 256 * 256 * 4


"""The NKI MoE kernels fit trn2's *usable* SBUF, with margin, at every shipped MoE config's expert shapes.

The usable figure is `nl.tile_size.total_available_sbuf_size` (212,464 B per partition: the raw 224 KiB less the
compiler's reservations; nki-library's memory manager allocates within it), which the emulator's sbuf-capacity rule
enforces. Each case runs forward + backward (three tokens, bf16: the trn2 dtype) at the config's D and F, at LNC 1
and 2 and block sizes 128/256/512 (parity with the torch reference at these shapes: test_moe_kernels.py), and
asserts the emulator's SBUF high-water mark leaves at least `MARGIN` bytes per partition free. The resident backward
tiles fill SBUF up to `nki_moe.SBUF_BYTES` less the small-tile allowance, so the peak also stays above 90% of it.
"""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
import torch
from test_moe_kernels import make_case, outputs_and_grads

from workbench.kernels import blockwise_moe_nki, nki_moe
from workbench.kernels.nki_api import REAL_NKI, nl

pytestmark = pytest.mark.skipif(REAL_NKI, reason="the emulator's SBUF accounting is what is under test")

USABLE = 212_464  # trn2: nl.tile_size.total_available_sbuf_size (nki_emulator/memory.py cites it)
MARGIN = 1024  # bytes per partition left free at the peak (nki_moe.SMALL_TILES_BYTES: the tiles beyond it are < 100 B)


def _moe_shapes():
    """{(D, F)} of the shipped configs' MoE flavors (configs/*.toml)."""
    from workbench.core.config import load_config

    shapes = set()
    for path in sorted(glob.glob(str(Path(__file__).resolve().parents[2] / "configs" / "*.toml"))):
        shape = load_config(path, world_size=64).shape
        if shape.is_moe:
            shapes.add((shape.dim, shape.moe_ffn_dim))
    return sorted(shapes)


def test_usable_sbuf_is_the_capacity():
    """The kernels, the emulator's nl.tile_size and its capacity rule all use the usable figure."""
    from workbench.kernels.nki_emulator import memory

    assert nl.tile_size.total_available_sbuf_size == memory.SBUF_PARTITION_BYTES == nki_moe.SBUF_BYTES == USABLE
    assert memory.SBUF_RAW_PARTITION_BYTES - USABLE == 16384 + 8 + 520


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("D,F", _moe_shapes())
def test_kernels_fit_usable_sbuf_at_shipped_shapes(D, F, lnc, monkeypatch):
    from workbench.kernels.nki_emulator import counters

    assert (2048, 768) in _moe_shapes()  # Qwen3-30B-A3B is shipped (configs/trn2_qwen3_30b_a3b.toml)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(lnc))
    case = make_case(3, 1, 2, D, F, dtype=torch.bfloat16, ids=[0, 1, 1])
    for bs in (128, 256, 512):
        with counters() as c:
            outputs_and_grads(blockwise_moe_nki, case, block_size=bs)
        assert c.sbuf_peak + MARGIN <= USABLE, (D, F, lnc, bs, c.sbuf_peak)
        assert c.psum_peak <= 8 * 2048
        if D >= 1024:  # the resident tiles fill what the weights and the workspace leave
            assert c.sbuf_peak > 0.9 * USABLE, (D, F, lnc, bs, c.sbuf_peak)


def test_a_shape_that_does_not_fit_names_the_fix():
    """D = 4096 in fp32 with 128-slot blocks: the backward's three resident matrices, workspace and one resident
    tile exceed the usable SBUF (they fit the raw 224 KiB): refused with the fix, not left to fail on hardware."""
    with pytest.raises(ValueError, match="does not fit SBUF at D=4096, F=768, 128-slot blocks in torch.float32: "
                       "use a smaller model.moe_block_size"):
        nki_moe.backward_layout(4096, 768, torch.float32, nki_moe.piece_widths(128, 3))
    assert nki_moe.backward_layout(4096, 768, torch.float32, nki_moe.piece_widths(64, 3)) == (128, 1)

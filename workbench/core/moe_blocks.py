"""The NKI MoE kernels' block-size rule, written once: torch-free, so that the config's validation (before any torch
import) and the kernels' host code (`workbench.kernels.autograd`) both read it here."""

from __future__ import annotations

MAX_BLOCK = 128
"""The largest block that is one kernel block as it is: the SBUF's 128 partitions (`kernels.nki_moe.P`)."""
KERNEL_BLOCKS = (256, 128)
"""The kernel blocks a larger block is split into, the largest that divides it first."""


def kernel_block_size(block_size: int) -> int:
    """Slots per full kernel block: `block_size` (`model.moe_block_size`) if <= 128, else the largest of 256/128
    dividing it.

    A block larger than that is several consecutive kernel blocks with the same expert (one segment, so
    the expert's weights are still loaded once). 256 keeps the backward's resident weights plus one block's
    activations inside SBUF at D = 2048 (docs/nki_kernels.md).

    Raises:
        ValueError: a block the kernels cannot take (the config refuses it as `model.moe_block_size`).
    """
    if 1 <= block_size <= MAX_BLOCK:
        return block_size
    for kb in KERNEL_BLOCKS:
        if block_size % kb == 0:
            return kb
    raise ValueError(f"the NKI kernels need block_size <= 128 or a multiple of 128, got {block_size}")

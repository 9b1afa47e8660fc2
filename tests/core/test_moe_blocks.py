"""workbench.core.moe_blocks: the NKI MoE kernels' block-size rule, written once: the config accepts exactly the
blocks the kernels split into kernel blocks."""

from __future__ import annotations

from workbench.core.config import load_config, validate
from workbench.core.errors import ConfigError


def test_nki_moe_block_rule_is_the_kernels_block_split():
    """config's moe_block_size rule accepts exactly the blocks `kernel_block_size` splits into kernel blocks (the
    rule is written once, in core/moe_blocks.py; this keeps the config from growing a rule of its own)."""
    from workbench.core.moe_blocks import kernel_block_size

    def kernels_take(b: int) -> bool:
        try:
            return kernel_block_size(b) > 0
        except ValueError:
            return False

    job = load_config(None, model={"flavor": "tiny-moe", "backend": "nki_moe"})
    accepted = []
    for b in range(1, 1025):
        job.model.moe_block_size = b
        try:
            validate(job)
            accepted.append(b)
        except ConfigError:
            pass
    assert accepted == [b for b in range(1, 1025) if kernels_take(b)]
    assert len(accepted) == 128 + 7  # 1..128 and 256, 384, ..., 1024

"""NKI kernels for the blockwise Qwen3-MoE experts (forward and backward), standalone NKI API, LNC 1 or 2.

Design, tables, time model and cost report: docs/nki_kernels.md. Modules: `layout` (sizes and SBUF budgets),
`columns` (the host tables' columns), `tables` (building them), `tiles` (data movement, PSUM, transposes), `mlp`,
`forward`, `backward`, `weight_grads`, `combine`, `checks`.

Dimensions (one meaning per letter in the package; lowercase fl, dl, sl, cl: one tile's length of F/FC, D, slots,
columns):
    T: tokens; K: experts per token (top-k); E: experts; D: hidden size
    F: the experts' intermediate size; FC: the F chunk kept resident (F when it fits SBUF, else a multiple of 128)
    G: slot granule (each expert's slots are padded to a multiple of G: 32, or KB when KB is not 32 x 2^k)
    NG: slot groups of G (rows of the [NG, G] slot tables, the cores' no-op areas last); NS = NG * G: slots
    KB: slots of a full kernel block, G * 2^(L-1); L: piece classes; B: slots of one piece (its class: KB >> k)
    TS: slots per resident backward tile, min(128, KB); NT: resident main tiles of a sub-segment
    S: segment positions per core; M: rows of `piece`; J: sub-segments per position (a static bound);
        Z: per-core rows of `zero_rows`
    nT, TT: token tiles of the combine and tokens per tile; LNC: logical cores; P: 128 partitions
    R, C: rows and columns of whatever matrix a generic helper moves

Runs here through the CPU emulator (`nki_emulator`); nothing here has run on Trainium yet.
"""

from .backward import moe_blockwise_bwd
from .columns import PieceCol, SegCol, SubCol
from .forward import moe_blockwise_fwd
from .layout import (
    SBUF_BYTES,
    SMALL_TILES_BYTES,
    P,
    alternates_halves,
    assignment_rows,
    backward_layout,
    f_chunk,
    fit_backward,
    piece_widths,
    tile_slots,
    tiles_needed,
    token_tiles,
)

__all__ = ["P", "SBUF_BYTES", "SMALL_TILES_BYTES", "PieceCol", "SegCol", "SubCol", "alternates_halves",
           "assignment_rows", "backward_layout", "f_chunk", "fit_backward", "moe_blockwise_bwd", "moe_blockwise_fwd",
           "piece_widths", "tile_slots", "tiles_needed", "token_tiles"]

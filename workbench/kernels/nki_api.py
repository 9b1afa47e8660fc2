"""The NKI namespace kernels import: the real `nki` package when it imports, else our CPU emulator.

    from workbench.kernels.nki_api import nki, nl, nisa

The real package is only on AWS's pip index (Neuron SDK); here it is normally absent, so kernels run on
`workbench.kernels.nki_emulator`. Set WORKBENCH_NKI=emulator to force the emulator even where `nki` imports
(e.g. to compare it with `nki.simulate` on a Neuron host).
"""

from __future__ import annotations

import os


def _load():
    if os.environ.get("WORKBENCH_NKI", "").lower() != "emulator":
        try:
            import nki as real_nki
            import nki.isa as real_isa
            import nki.language as real_language

            return real_nki, real_language, real_isa, True
        except ImportError:
            pass
    from workbench.kernels import nki_emulator

    return nki_emulator, nki_emulator.language, nki_emulator.isa, False


nki, nl, nisa, REAL_NKI = _load()

__all__ = ["REAL_NKI", "nki", "nisa", "nl"]

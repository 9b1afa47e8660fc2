"""A CPU emulator for the subset of NKI that `workbench.kernels.nki_moe` uses.

Import it the way the real package is imported (`nki`, `nki.language`, `nki.isa`); `workbench.kernels.nki_api`
picks the real `nki` when it imports and this module otherwise, so one kernel source runs on both. It enforces
the documented tile, buffer and dtype rules (raising `NkiRuleError` that names the rule) and never relaxes them
to make a kernel pass. Coverage, rules and known differences from `nki.simulate`: docs/nki_emulator.md.
"""

from workbench.core.errors import NkiRuleError

from . import isa, language, version
from .counters import Counters, HbmAllocation, counters
from .dtypes import dtype
from .kernel import Kernel, jit, simulate
from .launch import races_reported
from .memory import capacity_lifted

__all__ = ["Counters", "HbmAllocation", "Kernel", "NkiRuleError", "capacity_lifted", "counters", "dtype", "isa", "jit",
           "language", "races_reported", "simulate", "version"]

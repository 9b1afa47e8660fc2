"""Which NKI the emulator models, and how to check a kernel under an older version's rules.

The emulator models **NKI 0.7.0**, the NKI of Neuron SDK 2.33, the first SDK with TorchNeuron (the `neuron`
device). Source: Neuron docs, "NKI Migration Guides" (version table) and "Migrating from NKI 0.6.0 to NKI 0.7.0".
Neuron SDK 2.34 documents no NKI version change (its release notes and the torch-neuronx v2.34.0 notes name no new
NKI, the migration guides stop at 0.6.0 to 0.7.0; 2.34's one NKI-facing removal is the old `neuronxcc.nki`
namespace in neuronx-cc, which the `nki.*` kernels here never import), so 0.7.0 stands for both; re-check when an
NKI release note for 2.34 or later appears.

Rules that changed between versions are looked up here, never hard-coded per call site:

    from workbench.kernels.nki_emulator import version
    if version.at_least("0.7.0"): ...            # e.g. nl.dynamic_range removed

An older version's rules (only the documented differences, not a second emulator) are selected with

    with version.rules_of("0.4.0"): kernel[2](...)     # or WORKBENCH_NKI_VERSION=0.4.0 in the environment

so code written for an older NKI (e.g. nki-library's published kernels) can be checked as its authors ran it.
"""

from __future__ import annotations

import contextlib
import os

NKI_VERSION = "0.7.0"  # the NKI the emulator models by default
NEURON_SDK = "2.33"  # the Neuron SDK that introduced it (2.34 changed nothing documented: see above)
ENV = "WORKBENCH_NKI_VERSION"

_override: str | None = None


def parse(v: str) -> tuple[int, int, int]:
    """'0.7' or '0.7.0' -> (0, 7, 0); anything else is a ValueError naming the expected form."""
    parts = str(v).strip().split(".")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"NKI version {v!r}: expected MAJOR.MINOR[.PATCH], e.g. {NKI_VERSION}")
    nums = [int(p) for p in parts] + [0] * (3 - len(parts))
    return nums[0], nums[1], nums[2]


def active() -> str:
    """The version whose rules apply now: `rules_of`'s, else $WORKBENCH_NKI_VERSION, else NKI_VERSION."""
    v = _override or os.environ.get(ENV, "").strip() or NKI_VERSION
    parse(v)
    return v


def at_least(v: str) -> bool:
    """True when the active version is `v` or newer (a rule introduced in `v` applies)."""
    return parse(active()) >= parse(v)


@contextlib.contextmanager
def rules_of(v: str):
    """Check kernels under NKI `v`'s documented rules inside the block."""
    global _override
    parse(v)
    old, _override = _override, v
    try:
        yield
    finally:
        _override = old

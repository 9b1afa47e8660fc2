"""`nki.collectives` (cross-device collectives, `ReplicaGroup`): outside the emulated subset.

The names exist so that modules importing them load; using any of them raises NotImplementedError naming it.
(https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/nki.collectives.html)
"""

from __future__ import annotations


class _Unemulated:
    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"nki.collectives.{self.name} is outside the emulated subset (one device, no "
                                  "collectives)")

    def __getattr__(self, attr):
        return _Unemulated(f"{self.name}.{attr}")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unemulated(name)

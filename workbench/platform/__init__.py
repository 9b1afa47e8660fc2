"""The machine: device detection, pinning torchtitan to it, the per-device adjustments, ranks and collectives."""

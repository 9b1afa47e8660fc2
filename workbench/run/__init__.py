"""One training run: the torchtitan trainer subclass, checkpoints, the run folder, profiling (MFU)."""

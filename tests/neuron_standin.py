"""Launch `train.py` with a stand-in for TorchNeuron's process group: gloo, registered under the name "neuron".

    torchrun --nproc_per_node=2 -m tests.neuron_standin --job.config_file configs/cpu_dense.toml --neuron.apply always

Run as a module of the `tests` package from the repository root (as a script, its folder would come first on
`sys.path`, and `tests/platform/` would hide the standard library's `platform`).

`import torch_neuronx` registers the real "neuron" backend on a trn2 host (AWS's torch.distributed guide); here the
same name is registered for a plain gloo backend, which, like any backend that does not implement it, rejects
`ReduceOp.PREMUL_SUM`. The run then goes through the workbench's own code unchanged: `[neuron] apply = "always"`
applies `workbench/platform/neuron_adjustments.py` on CPU,
which maps the device to `neuron.process_group` and forces FSDP's
SUM reduction. Each rank appends one line to `$WORKBENCH_STANDIN_LOG.<rank>` when its backend is created, so a test
can tell that the run really used this process group.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch.distributed as dist


def _create_gloo(store, rank: int, size: int, timeout):
    log = os.environ.get("WORKBENCH_STANDIN_LOG")
    if log:
        with open(f"{log}.{rank}", "a") as f:
            f.write(f"neuron stand-in (gloo) created: rank {rank} of {size}\n")
    return dist.ProcessGroupGloo(store, rank, size, timeout)


dist.Backend.register_backend("neuron", _create_gloo, devices=["cpu"])

if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    sys.argv[0] = str(root / "train.py")
    runpy.run_path(str(root / "train.py"), run_name="__main__")

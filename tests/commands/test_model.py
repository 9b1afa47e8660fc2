"""workbench.model: the notebooks' model API (`load_model`), in this process. Loading published weights:
tests/hf_weights/test_load.py; exporting them: tests/hf_weights/test_export.py."""

from __future__ import annotations

import torch

from workbench.core.config import load_config
from workbench.platform import titan_device

titan_device.pin("cpu")  # the fp32 reference numerics (also on machines with an accelerator)

from workbench.model import load_model  # noqa: E402  (after the device is pinned)


def test_load_model_without_checkpoint_is_seeded():
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    job = load_config(None, model={"flavor": "tiny"})
    a, b = load_model(job), load_model(job)
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))  # every buffer (RoPE cache) initialised, no stray state

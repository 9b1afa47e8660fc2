"""Qwen3-on-Trainium workbench: one launcher, one TOML config, three training paths.

Python API (what the notebooks call)::

    job = workbench.load_config("configs/cpu_moe.toml", training={"steps": 10})
    run_dir = workbench.train.train(job, nproc=2)           # torchrun in a subprocess -> run folder
    model = workbench.load_model(job, backend="native", hf_checkpoint=None)   # forward(input_ids) -> logits
    workbench.export_hf(model, "out/hf")                     # safetensors + config.json + tokenizer

`workbench.train` is the launcher module (`python -m workbench.train`); its Python entry point is the function
`workbench.train.train` (one spelling: the module is not callable). Imports are lazy so that `import workbench`
stays fast and torch-free, and so does `load_config` (validation included: the backend rules are plain functions).
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_config", "train", "load_model", "export_hf"]

_API = {
    "load_config": ("workbench.core.config", "load_config"),
    "train": ("workbench.train", None),  # the launcher module (python -m workbench.train); its API is .train()
    "load_model": ("workbench.model", "load_model"),
    "export_hf": ("workbench.model", "export_hf"),
}


def __getattr__(name: str) -> Any:
    if name in _API:
        import importlib

        module, attr = _API[name]
        mod = importlib.import_module(module)
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")

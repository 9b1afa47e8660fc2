"""Hugging Face weights in and out: published Qwen3 checkpoints into any workbench model, and any model back out.

The interchange format between the paths (and with the Hugging Face Hub) is what `transformers` reads and writes: a
folder with `config.json` and either `model.safetensors` or `model-0000i-of-0000N.safetensors` shards listed in
`model.safetensors.index.json`, under the published keys.

Key mapping belongs to the backend: `backends.hf_adapter(name, shape)` returns an object with `to_hf(state_dict)` /
`from_hf(hf_state_dict)` between the model's `state_dict()` keys and the per-expert HF keys; both directions accept
any subset of keys that covers one unit (`units`).

    folder.py   the checkpoint folder: its files, the table of contents of their tensors (headers only)
    units.py    the pieces loaded and exported one at a time, and the check of a folder against them
    load.py     into a model (`load_into_model`) or a trainer's sharded model (`load_into_trainer`)
    export.py   out of a model (`export_model`) or a trainer (`export_trainer`), atomically
"""

from workbench.hf_weights.export import (
    EXPORT_MARKER,
    export_dtype,
    export_model,
    export_trainer,
    export_weights,
    target_problem,
)
from workbench.hf_weights.folder import INDEX_FILE, table_of_contents, weight_files
from workbench.hf_weights.load import describe_casts, load_into_model, load_into_trainer, load_weights
from workbench.hf_weights.units import ModelInfo, check_against, group_units, meta_state_dict, unit_of

__all__ = [
    "EXPORT_MARKER", "INDEX_FILE", "ModelInfo", "check_against", "describe_casts", "export_dtype", "export_model",
    "export_trainer", "export_weights", "group_units", "load_into_model", "load_into_trainer", "load_weights",
    "meta_state_dict", "table_of_contents", "target_problem", "unit_of", "weight_files",
]

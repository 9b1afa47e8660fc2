"""The project's Jupyter kernel "Qwen3 workbench" (`qwen3-workbench`), named in every notebook's metadata.

    python -m workbench.notebook kernel            # register this environment's Python (make setup does this)
    python -m workbench.notebook kernel --replace  # take the name over from another clone's environment

The name is fixed, because the committed notebooks name it. A kernel spec is only a pointer to one Python, so a
second clone's `make setup` would silently repoint every clone's notebooks at its own venv. So registration
never replaces a spec that points at *another Python that still exists*: it leaves it, and warns naming that
Python and the `--replace` command. A spec of this same Python is refreshed; one whose Python is gone (a deleted
clone) is replaced.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

NAME = "qwen3-workbench"
DISPLAY_NAME = "Qwen3 workbench"


def registered_python(name: str = NAME) -> Path | None:
    """The interpreter an installed kernel spec `name` runs (its argv[0]), or None when there is none."""
    from jupyter_client.kernelspec import KernelSpecManager

    resource_dir = KernelSpecManager().find_kernel_specs().get(name)
    if resource_dir is None:
        return None
    try:
        argv = json.loads((Path(resource_dir) / "kernel.json").read_text())["argv"]
    except (OSError, ValueError, KeyError, IndexError):
        return None
    return Path(argv[0]) if argv else None


def register(name: str = NAME, *, replace: bool = False, echo=print, warn=None) -> bool:
    """Registers this Python as kernel `name` for the current user, unless another clone's Python holds the name.

    Returns:
        True when the spec now points at this Python.
    """
    from ipykernel.kernelspec import install

    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    me = Path(sys.executable)
    old = registered_python(name)
    # Compare without resolving symlinks: a venv's python is a link to the base interpreter, shared by clones.
    if old is not None and old.absolute() != me.absolute() and old.exists() and not replace:
        warn(f"warning: Jupyter kernel {name!r} already runs {old} (another clone's environment?); left as it "
             f"is, so notebooks opened on {name!r} use that environment. To point it at this one ({me}): "
             f"{me} -m workbench.notebook kernel --replace")
        return False
    path = install(user=True, kernel_name=name, display_name=DISPLAY_NAME)
    echo(f"Jupyter kernel {name!r} ({DISPLAY_NAME}) -> {me}" + (f" (was {old})" if old and old != me else "")
         + f" [{path}]")
    return True


__all__ = ["NAME", "DISPLAY_NAME", "registered_python", "register"]

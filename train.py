"""The article's launcher: `torchrun --nproc_per_node=N train.py --job.config_file F.toml --model.backend B`.

Thin on purpose: everything lives in `workbench.train` (also runnable as `python -m workbench.train`).
"""

import sys

from workbench.train import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m workbench.data prepare SRC OUT [--workers N] [--strict]` (see `workbench.data.prepare`)."""

import sys

from workbench.data.prepare import main

if __name__ == "__main__":  # importing the package's modules (tests walk them all) must not run the command
    sys.exit(main())

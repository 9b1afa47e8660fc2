"""`python -m workbench.data prepare SRC OUT [--chat] ...`, `verify OUT`, `inspect OUT --seq-len L --rows A:B [--json]`
(see `workbench.data.prepare` and `workbench.data.view`)."""

import sys

from workbench.data.prepare import main

if __name__ == "__main__":  # importing the package's modules (tests walk them all) must not run the command
    sys.exit(main())

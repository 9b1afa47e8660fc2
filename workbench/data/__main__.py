"""`python -m workbench.data prepare SRC OUT [--workers N] [--strict]` (see `workbench.data.prepare`)."""

import sys

from workbench.data.prepare import main

sys.exit(main())

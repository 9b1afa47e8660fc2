"""`python -m workbench.data prepare SRC OUT [--chat] ...`, `verify OUT` (`workbench.data.prepare`) and
`inspect OUT --seq-len L --rows A:B [--json]` (`workbench.data.view`)."""

import sys

if __name__ == "__main__":  # importing the package's modules (tests walk them all) must not run the command
    if sys.argv[1:2] == ["inspect"]:
        from workbench.data.view import main
    else:
        from workbench.data.prepare import main
    sys.exit(main(sys.argv[2:] if sys.argv[1:2] == ["inspect"] else None))

"""``python -m enginecore``: the ``enginecore`` command."""

import sys

from enginecore.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m tiercheck.cli``: the same as the ``tiercheck`` command."""

from __future__ import annotations

import sys

from tiercheck.cli import main

if __name__ == "__main__":
    sys.exit(main())

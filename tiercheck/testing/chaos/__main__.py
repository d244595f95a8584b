"""``python -m tiercheck.testing.chaos``: see :mod:`tiercheck.testing.chaos.driver`."""

import sys

from tiercheck.testing.chaos.driver import main

sys.exit(main())

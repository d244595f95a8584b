"""Test helpers that ship with tiercheck, for its own tests and for plugin authors.

* :class:`TierTests` -- the conformance suite every tier passes (:mod:`tiercheck.testing.tiers`).
  It needs ``pytest`` and ``pytest-asyncio`` (the ``test`` extra); it is imported on first use,
  so the other helpers here do not need them.
* :mod:`tiercheck.testing.faults` -- tiers that fail or "die" at a chosen operation.
* :class:`LocalGroup` -- several ranks of one job in one process (threads), for fast tests of
  multi-rank behaviour without ``torch.distributed`` (:mod:`tiercheck.testing.coordinators`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiercheck.testing.tiers import TierTests

from tiercheck.testing.coordinators import LocalGroup, ThreadCoordinator

__all__ = ["LocalGroup", "ThreadCoordinator", "TierTests"]

# Under pytest, let it rewrite the suite's asserts so that failures show the values compared.
# Registration must precede the import of the module, hence here and not in it.
if "pytest" in sys.modules:
    sys.modules["pytest"].register_assert_rewrite("tiercheck.testing.tiers")


def __getattr__(name: str) -> Any:
    if name == "TierTests":
        from tiercheck.testing.tiers import TierTests

        return TierTests
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

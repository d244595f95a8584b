"""Test helpers that ship with tiercheck, for its own tests and for plugin authors.

* :class:`TierTests` -- the conformance suite every tier passes (:mod:`tiercheck.testing.tiers`).
  It needs ``pytest`` and ``pytest-asyncio`` (the ``test`` extra); it is imported on first use,
  so the other helpers here do not need them.
* :class:`TierStateMachine` -- a Hypothesis state machine that checks any tier against a dict,
  step by step (:mod:`tiercheck.testing.stateful`). It needs ``hypothesis`` (the ``test``
  extra) and is imported on first use, like :class:`TierTests`.
* :mod:`tiercheck.testing.faults` -- tiers that fail or "die" at a chosen operation.
* :class:`LocalGroup` -- several ranks of one job in one process (threads), for fast tests of
  multi-rank behaviour without ``torch.distributed`` (:mod:`tiercheck.testing.coordinators`).
* :mod:`tiercheck.testing.chaos` -- a seeded chaos soak: a real multi-process job, faults from a
  catalog, an oracle after every recovery (``python -m tiercheck.testing.chaos``, or
  ``tiercheck chaos``). It needs the ``test`` and ``s3`` extras; nothing here imports it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiercheck.testing.stateful import TierStateMachine
    from tiercheck.testing.tiers import TierTests

from tiercheck.testing.coordinators import LocalGroup, ThreadCoordinator

__all__ = ["LocalGroup", "ThreadCoordinator", "TierStateMachine", "TierTests"]

# Under pytest, let it rewrite the suite's asserts so that failures show the values compared.
# Registration must precede the import of the module, hence here and not in it.
if "pytest" in sys.modules:
    sys.modules["pytest"].register_assert_rewrite(
        "tiercheck.testing.tiers", "tiercheck.testing.stateful"
    )


def __getattr__(name: str) -> Any:
    if name == "TierTests":
        from tiercheck.testing.tiers import TierTests

        return TierTests
    if name == "TierStateMachine":
        from tiercheck.testing.stateful import TierStateMachine

        return TierStateMachine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

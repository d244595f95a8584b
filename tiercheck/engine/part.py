"""What the parts of one rank's engine that work on the tiers share, set in one place.

The reader, the elastic reader, the restorer, the timeline and the rejoin each act for this
rank on every tier's pipeline under this opening's claim; :class:`RankPart` gives them the same
names for it, so that none spells out its own copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiercheck.engine.commit.tier import TierPipeline
    from tiercheck.engine.open.claim import Claim
    from tiercheck.engine.options import Options
    from tiercheck.topology import Topology

__all__ = ["RankPart"]


class RankPart:
    """A part of this rank's engine: its options, place, claim and tier pipelines."""

    def __init__(self, options: Options, claim: Claim, pipes: Mapping[str, TierPipeline]) -> None:
        self.options = options
        #: This rank's place in the job (rank, world size, node).
        self.topo: Topology = options.job.topology
        self.rank = self.topo.rank
        self.job_id = options.job.job_id
        self.claim = claim
        #: Every tier's pipeline, by tier name, fastest first.
        self.pipes = pipes

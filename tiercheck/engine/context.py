"""What every part of the engine shares: options, figures, manifest, the ranks' channels."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tiercheck._threads import DaemonExecutor
from tiercheck.consistency.coordinator import Coordinator, SoloCoordinator
from tiercheck.engine.claim import Claim
from tiercheck.engine.jobs import Job
from tiercheck.engine.journal import Journal
from tiercheck.engine.options import Options
from tiercheck.engine.results import CheckpointerStats

__all__ = ["Context"]


class Context:
    """The engine's shared state; lives on the private loop, like every part that holds it."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.topo = options.job.topology
        self.rank = options.job.topology.rank
        self.job_id = options.job.job_id
        self.stats = CheckpointerStats()
        self.journal = Journal(self.stats)
        self.coordinator: Coordinator = SoloCoordinator()
        #: Worker threads for hashing and compression.
        self.cpu = ThreadPoolExecutor(options.encode.threads, thread_name_prefix="tiercheck-cpu")
        # One thread per channel keeps its exchanges in order; daemon threads, because an
        # exchange may wait on a dead rank for minutes and must never delay the process's exit.
        self.channels: dict[str, DaemonExecutor] = {}
        #: The incarnation of this opening, agreed by every rank (see Engine.open).
        self.session = ""
        self.claim = Claim(self)
        #: Saves whose commit rounds are not all over yet.
        self.jobs: set[Job] = set()

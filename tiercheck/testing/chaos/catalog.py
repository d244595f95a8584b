"""The faults the soak injects, and its schedule: a pure function of the seed.

Each :class:`Fault` says what it does, which tiers a version committed before it must survive
in (what the oracle holds the next restore to), whether it ends in a restart or is transient
(training goes on; commits must resume within K saves), and whether it is expected to pass
today. The faults expected to fail name the issue whose fix they wait for; they run only when
asked for (``--faults``), so the default soak runs what passes and a catalog run
(``--catalog``) shows which fail and how.

:func:`schedule` draws the episodes from ``random.Random(seed)`` alone: the same seed and the
same fault list give the same episodes, in any process, whatever happens while they run. (The
job's own timing -- which background write finishes first -- is not replayed: these are real
processes. A failing seed replays the same faults at the same steps.)
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["CATALOG", "PASSING", "TIERS", "Episode", "Fault", "passing", "schedule"]

#: Tier names, fastest first.
TIERS = ("local", "peer", "persistent")


@dataclass(frozen=True)
class Fault:
    """One kind of fault."""

    name: str
    description: str
    #: Tiers whose committed versions survive it (the restore after it must reach the newest
    #: of them); ``None`` for a transient fault (no restart; commits must resume).
    survivors: tuple[str, ...] | None
    #: ``None``: expected to pass today; else why it is expected to fail.
    fails_today: str | None = None
    weight: float = 1.0
    #: Only where the ranks are started by ``torchrun`` (``--launcher torchrun``).
    torchrun_only: bool = False
    #: It destroys copies in memory: the versions committed before it bind the restore right
    #: after it, but not after a later fault before the job commits again (a second node lost
    #: before anything was re-replicated is two failures, which no memory tier survives).
    degrades: bool = False


_ALL = TIERS
CATALOG: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault("kill-rank", "SIGKILL one rank (a process crash); the others leave", _ALL, None, 2),
        Fault("kill-all", "SIGKILL every rank at once (the job is restarted)", _ALL, None, 1),
        Fault(
            "kill-restoring",
            "SIGKILL one rank while the restarted job opens and restores, then restart again",
            _ALL,
            None,
            1,
        ),
        Fault("term-rank", "SIGTERM one rank (preemption of one process)", _ALL, None, 1),
        Fault("term-all", "SIGTERM every rank (the job is preempted)", _ALL, None, 1),
        Fault(
            "node-lost",
            "SIGKILL one node's ranks and wipe its memory root (a node is lost)",
            ("peer", "persistent"),
            None,
            2,
            degrades=True,
        ),
        Fault(
            "cluster-lost",
            "SIGKILL every rank and wipe every memory root (the cluster is lost)",
            ("persistent",),
            None,
            1,
            degrades=True,
        ),
        Fault(
            "damage-blob",
            "SIGKILL every rank; one of the newest blobs in a memory root is cut in half or "
            "has a bit flipped",
            _ALL,  # less the damaged blob's tier (the driver drops it)
            None,
            1,
            degrades=True,
        ),
        Fault(
            "damage-s3-blob",
            "SIGKILL every rank; the newest blob in S3 is cut in half; every memory root is "
            "wiped too, or none",
            _ALL,  # less the persistent tier, and the memory tiers when wiped
            None,
            1,
        ),
        Fault(
            "manifest-cut",
            "SIGKILL every rank and one node's manifest process; that node's manifest "
            "(data.mdb) is cut short at a random byte, at rest",
            _ALL,  # the manifest is history: restore trusts the tiers
            None,
            1,
        ),
        Fault(
            "manifest-kill",
            "SIGKILL one node's manifest process while its ranks train: training goes on, "
            "commits resume, and the node's manifest records them again",
            None,
            None,
            1,
        ),
        Fault(
            "manifest-cut-live",
            "cut one node's manifest (data.mdb) short at a random byte while its ranks train "
            "(its manifest process may die of it): training goes on, commits resume, and the "
            "node's manifest records them again",
            None,
            None,
            1,
        ),
        Fault(
            "fill-memory",
            "the tmpfs that holds every node's memory is filled for 1-4 s, then freed (needs "
            "root to mount it; skipped, with the reason, elsewhere)",
            None,
            None,
            1,
        ),
        Fault(
            "kill-closing",
            "ask the job to end, SIGKILL one rank 0-1 s later (while it waits for its saves and "
            "closes), restart",
            _ALL,
            None,
            1,
        ),
        Fault(
            "wipe-live",
            "remove one node's memory root while its ranks train (an operator, a cleanup job): "
            "training goes on, commits resume",
            None,
            None,
            1,
        ),
        Fault(
            "damage-live",
            "cut or flip a bit in one of the newest blobs of a node while its ranks train; "
            "then SIGKILL every rank",
            _ALL,  # less the damaged blob's tier (the driver drops it)
            None,
            1,
            degrades=True,
        ),
        Fault(
            "world-size",
            "relaunch with another number of ranks: every rank must refuse, nothing stored may "
            "change; then relaunch as before",
            _ALL,
            None,
            1,
        ),
        Fault(
            "pause-short",
            "SIGSTOP one rank for 0.2-0.6 x peer_timeout, then SIGCONT",
            None,
            None,
            2,
        ),
        Fault(
            "s3-blip",
            "the S3 endpoint refuses connections for 0.2-1 s (its proxy killed), then is back",
            None,
            None,
            2,
        ),
        Fault(
            "s3-down",
            "the S3 endpoint refuses connections for 2-8 s (its proxy killed), then is back",
            None,
            None,
            1,
        ),
        Fault(
            "s3-hang",
            "the S3 server stops answering for 2-8 s (SIGSTOP), then answers again",
            None,
            None,
            1,
        ),
        Fault(
            "kill-launcher",
            "SIGKILL the torchrun launcher of a node other than node 0: its ranks train on, "
            "orphaned",
            None,
            None,
            1,
            torchrun_only=True,
        ),
        Fault(
            "kill-store-launcher",
            "SIGKILL node 0's torchrun launcher, which hosts the job's key-value store: the "
            "ranks train on, orphaned, without a store",
            None,
            "found by this soak (no issue yet): the peer tier sends its control messages "
            "through the job's key-value store; once the store's host is gone no version "
            "commits in the peer tier again, while training goes on (one WARNING)",
            1,
            torchrun_only=True,
        ),
        Fault(
            "term-launcher",
            "SIGTERM one node's torchrun launcher (the scheduler preempts it): it stops its "
            "ranks, the others leave",
            _ALL,
            None,
            1,
            torchrun_only=True,
        ),
        Fault(
            "pause-long",
            "SIGSTOP one rank for 1.5-3 x peer_timeout, then SIGCONT",
            None,
            None,
            1,
        ),
        Fault(
            "s3-down-restart",
            "the S3 endpoint refuses connections; SIGKILL every rank; relaunch during the outage "
            "(memory holds the newest versions); the endpoint is back 10 s later",
            _ALL,
            None,
            1,
        ),
        Fault(
            "term-all-cluster-lost",
            "SIGTERM every rank, then wipe every memory root (preempted, then the nodes are "
            "gone): the newest version committed in memory must have been made durable",
            TIERS,
            None,
            1,
            degrades=True,
        ),
    ]
}

#: The faults expected to pass today: the default soak (with ``--launcher torchrun``; without,
#: less the faults that need it, see :func:`passing`).
PASSING = tuple(name for name, f in CATALOG.items() if f.fails_today is None)


def passing(launcher: str) -> tuple[str, ...]:
    """The faults expected to pass today that ``launcher`` can produce."""
    return tuple(n for n in PASSING if launcher == "torchrun" or not CATALOG[n].torchrun_only)


@dataclass(frozen=True)
class Episode:
    """One fault of the schedule, with every parameter it may use already drawn."""

    index: int
    fault: str
    #: Versions the job saves after the previous recovery before the fault (0: at once).
    after: int
    #: The rank or node it hits (modulo the ranks or nodes there are).
    rank: int
    node: int
    #: A number in [0, 1) that scales its duration within the fault's range.
    scale: float
    #: A number that picks among things found only at run time (a blob to cut).
    pick: int

    def describe(self, peer_timeout: float) -> str:
        """One line: what happens."""
        what = {
            "kill-rank": f"SIGKILL rank {self.rank}",
            "term-rank": f"SIGTERM rank {self.rank}",
            "kill-restoring": f"restart, SIGKILL rank {self.rank} "
            f"{self.seconds(0.0, 1.5):.1f} s after the ranks joined",
            "node-lost": f"lose node {self.node}",
            "damage-blob": f"SIGKILL all, {'cut' if self.pick % 2 else 'flip a bit in'} blob "
            f"#{self.pick} on node {self.node}",
            "damage-s3-blob": f"SIGKILL all, cut the newest S3 blob"
            f"{', wipe every memory root' if self.scale < 0.5 else ''}",
            "manifest-cut": f"SIGKILL all, cut node {self.node}'s manifest at "
            f"{self.scale:.0%} of its length",
            "manifest-kill": f"SIGKILL node {self.node}'s manifest process under its live ranks",
            "manifest-cut-live": f"cut node {self.node}'s manifest at {self.scale:.0%} of its "
            "length under its live ranks",
            "fill-memory": f"fill the memory tmpfs for {self.seconds(1, 4):.1f} s",
            "pause-short": f"SIGSTOP rank {self.rank} "
            f"{self.seconds(0.2 * peer_timeout, 0.6 * peer_timeout):.1f} s",
            "pause-long": f"SIGSTOP rank {self.rank} "
            f"{self.seconds(1.5 * peer_timeout, 3 * peer_timeout):.1f} s",
            "s3-blip": f"S3 down {self.seconds(0.2, 1):.1f} s",
            "s3-down": f"S3 down {self.seconds(2, 8):.1f} s",
            "s3-hang": f"S3 hung {self.seconds(2, 8):.1f} s",
            "world-size": "relaunch on another world size",
            "kill-closing": f"end the job, SIGKILL rank {self.rank} {self.scale:.1f} s later",
            "wipe-live": f"remove node {self.node}'s memory root under its live ranks",
            "damage-live": f"{'cut' if self.pick % 2 else 'flip a bit in'} blob #{self.pick} "
            f"on node {self.node} under its live ranks, then SIGKILL all",
            "kill-launcher": f"SIGKILL node {max(1, self.node)}'s launcher",
            "kill-store-launcher": "SIGKILL node 0's launcher (the store's host)",
            "term-launcher": f"SIGTERM node {self.node}'s launcher",
        }.get(self.fault, self.fault)
        return f"#{self.index} after {self.after} saves: {what}"

    def seconds(self, low: float, high: float) -> float:
        """A duration in ``[low, high)``, by :attr:`scale`."""
        return low + (high - low) * self.scale


def schedule(seed: int, faults: Sequence[str], world: int, nodes: int) -> Iterator[Episode]:
    """The episodes of seed ``seed`` drawing from ``faults`` (catalog names), endless."""
    unknown = [f for f in faults if f not in CATALOG]
    if unknown or not faults:
        raise ValueError(f"unknown faults {unknown} (known: {', '.join(CATALOG)})")
    rng = random.Random(seed)
    names = sorted(set(faults))
    weights = [CATALOG[n].weight for n in names]
    for index in itertools.count():
        fault = rng.choices(names, weights)[0]
        yield Episode(
            index=index,
            fault=fault,
            after=rng.randint(0, 12),
            rank=rng.randrange(world),
            node=rng.randrange(nodes),
            scale=rng.random(),
            pick=rng.randrange(1 << 16),
        )

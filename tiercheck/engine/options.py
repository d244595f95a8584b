"""A checkpointer's configuration, checked and resolved once, in frozen groups.

:func:`resolve_options` turns the keyword arguments of :class:`~tiercheck.Checkpointer` into an
:class:`Options`: every value validated (a :class:`~tiercheck.errors.ConfigError` saying what
was expected), every default filled in (the placement from the launcher, the folders, a policy
for each tier). The engine reads nothing else; each part of it reads the group it needs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tiercheck.codec import CodecOptions
from tiercheck.consistency.coordinator import Coordinator
from tiercheck.defaults import DEFAULT_KEEP, default_persistent_url, default_root
from tiercheck.errors import ConfigError
from tiercheck.tiers.base import FailureScope, Tier
from tiercheck.topology import Topology

__all__ = [
    "BusyPolicy",
    "CloseMode",
    "CodecSetup",
    "CoordinationOptions",
    "JobOptions",
    "Options",
    "PerRankPolicy",
    "ScheduleOptions",
    "StalePolicy",
    "TierEncoding",
    "TierOptions",
    "TierPolicy",
    "VersionSelector",
    "check_job_id",
    "resolve_options",
]

TierEncoding = Literal["full", "packed"]
BusyPolicy = Literal["wait", "skip"]
StalePolicy = Literal["error", "discard", "adopt"]
#: What an elastic restore does with leaves that are not DTensors and differ between the ranks
#: that saved them: ``"refuse"`` (a :class:`~tiercheck.errors.ReshardError`) or ``"wrap"`` (new
#: rank ``q`` takes old rank ``q % N``'s); see :mod:`tiercheck.codec.reshard`.
PerRankPolicy = Literal["refuse", "wrap"]
VersionSelector = Literal["all", "base"] | Callable[[int], bool]
#: How a checkpointer closes: ``"collective"`` -- the normal end, every save finished and the
#: ranks leaving the store and each other in order; ``"bounded"`` -- leaving on an exception,
#: pending saves get at most ``close_timeout`` seconds, no agreement with other ranks;
#: ``"now"`` -- no waiting for saves at all (``close(flush=False)``).
CloseMode = Literal["collective", "bounded", "now"]


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """What one tier receives and keeps.

    Attributes:
        keep: how many committed versions the tier retains (bases that kept deltas need are
            kept on top).
        encoding: ``"full"`` stores the raw payload as is (fastest to write and read, no base
            needed); ``"packed"`` stores deltas against a base, byte planes and zstd (smallest).
        versions: ``"all"``, ``"base"`` (only versions scheduled as bases), or a predicate on
            the version (bases are always included, since a delta needs its base in the tier).
    """

    keep: int = 2
    encoding: TierEncoding = "packed"
    versions: VersionSelector = "all"

    def __post_init__(self) -> None:
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"a tier must keep at least 1 version, got keep={self.keep!r}")
        if self.encoding not in ("full", "packed"):
            raise ConfigError(f"encoding must be 'full' or 'packed', got {self.encoding!r}")
        if not (self.versions in ("all", "base") or callable(self.versions)):
            raise ConfigError(
                "versions must be 'all', 'base' or a callable(version) -> bool, "
                f"got {self.versions!r}"
            )

    def targets(self, version: int, scheduled_base: bool) -> bool:
        """Whether ``version`` goes to this tier."""
        if self.versions == "all":
            return True
        if self.versions == "base":
            return scheduled_base
        assert callable(self.versions)
        return scheduled_base or bool(self.versions(version))


@dataclass(frozen=True, slots=True)
class JobOptions:
    """Whose checkpoints these are and where they live."""

    job_id: str
    topology: Topology
    #: This node's shared-memory folder.
    node_root: Path
    #: The ``persistent=`` URL (the job's folder is below it).
    persistent_url: str
    storage_options: Mapping[str, Any]
    stale_memory: StalePolicy
    #: Whether a job saved by another number of ranks may be opened and restored (resharded).
    elastic: bool = False
    per_rank: PerRankPolicy = "refuse"


@dataclass(frozen=True, slots=True)
class TierOptions:
    """Which tiers, and what each receives and keeps."""

    #: Tier names or instances, in configuration order.
    specs: tuple[str | Tier, ...]
    policies: Mapping[str, TierPolicy]
    local_capacity: int | None
    peer_replicas: int
    #: Encoded versions that may wait for one tier before newer ones are dropped for it.
    tier_queue: int

    def policy(self, tier: str) -> TierPolicy:
        """The policy of ``tier``; a :class:`ConfigError` for a tier without one."""
        try:
            return self.policies[tier]
        except KeyError:
            raise ConfigError(f"no policy for tier {tier!r}") from None


@dataclass(frozen=True, slots=True)
class ScheduleOptions:
    """When a save is a base, and what happens when saves come faster than they drain."""

    base_every: int
    on_busy: BusyPolicy
    max_pending: int
    overlap: bool


@dataclass(frozen=True, slots=True)
class CodecSetup:
    """How states become blobs."""

    codec: CodecOptions
    allow_pickle: bool
    #: Worker threads for hashing and compression.
    threads: int


@dataclass(frozen=True, slots=True)
class CoordinationOptions:
    """How ranks agree, and how long anything may wait on another rank or a store."""

    coordinator: Coordinator | None
    peer_timeout: float
    close_timeout: float


@dataclass(frozen=True, slots=True)
class Options:
    """Everything a checkpointer was configured with, resolved (see :func:`resolve_options`)."""

    job: JobOptions
    tiers: TierOptions
    schedule: ScheduleOptions
    encode: CodecSetup
    coordination: CoordinationOptions

    @property
    def tier_names(self) -> list[str]:
        """The configured tiers' names, in configuration order."""
        return [t.name if isinstance(t, Tier) else t for t in self.tiers.specs]


def check_job_id(job_id: object) -> str:
    """``job_id`` if it can name the job's folders, else a :class:`ConfigError`."""
    if not isinstance(job_id, str) or not job_id or "/" in job_id or job_id in (".", ".."):
        raise ConfigError(
            f"job_id must be a non-empty name without '/', got {job_id!r}; "
            "it names the job's folders in every tier"
        )
    return job_id


def resolve_options(
    job_id: str,
    *,
    persistent: str | None = None,
    local_root: str | os.PathLike[str] | None = None,
    tiers: Sequence[str | Tier] | None = None,
    base_every: int = 10,
    keep: int | Mapping[str, int] | None = None,
    persist: VersionSelector = "base",
    encodings: Mapping[str, TierEncoding] | None = None,
    policies: Mapping[str, TierPolicy] | None = None,
    on_busy: BusyPolicy = "wait",
    max_pending: int = 1,
    overlap: bool = False,
    tier_queue: int = 4,
    codec: CodecOptions | None = None,
    allow_pickle: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    node: str | None = None,
    coordinator: Coordinator | None = None,
    local_capacity: int | None = None,
    peer_replicas: int = 1,
    peer_timeout: float = 300.0,
    threads: int = 0,
    storage_options: Mapping[str, Any] | None = None,
    stale_memory: StalePolicy = "error",
    close_timeout: float = 30.0,
    elastic: bool = False,
    per_rank: PerRankPolicy = "refuse",
) -> Options:
    """Check the arguments of :class:`~tiercheck.Checkpointer` and fill in the defaults.

    The arguments are documented there. Raises :class:`ConfigError` for the first one that
    does not hold; detects the placement (:meth:`Topology.detect`) when not given.
    """
    job_id = check_job_id(job_id)
    if not isinstance(base_every, int) or base_every < 1:
        raise ConfigError(f"base_every must be a positive int, got {base_every!r}")
    if on_busy not in ("wait", "skip"):
        raise ConfigError(f"on_busy must be 'wait' or 'skip', got {on_busy!r}")
    if not isinstance(overlap, bool):
        raise ConfigError(f"overlap must be True or False, got {overlap!r}")
    if max_pending < 1 or tier_queue < 1:
        raise ConfigError("max_pending and tier_queue must be at least 1")
    if stale_memory not in ("error", "discard", "adopt"):
        raise ConfigError(
            f"stale_memory must be 'error', 'discard' or 'adopt', got {stale_memory!r}"
        )
    if not isinstance(elastic, bool):
        raise ConfigError(f"elastic must be True or False, got {elastic!r}")
    if per_rank not in ("refuse", "wrap"):
        raise ConfigError(f"per_rank must be 'refuse' or 'wrap', got {per_rank!r}")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise ConfigError(
            f"storage_options must be a mapping of fsspec options, got {storage_options!r}"
        )
    if not isinstance(close_timeout, (int, float)) or not close_timeout >= 0:
        raise ConfigError(f"close_timeout must be a number of seconds >= 0, got {close_timeout!r}")
    topology = Topology.detect(rank, world_size, ranks_per_node)
    if coordinator is not None and (
        coordinator.rank != topology.rank or coordinator.world_size != topology.world_size
    ):
        raise ConfigError(
            f"the coordinator is rank {coordinator.rank} of {coordinator.world_size}, "
            f"the checkpointer rank {topology.rank} of {topology.world_size}"
        )
    if tiers is None:
        tiers = (
            ("local", "peer", "persistent") if topology.num_nodes > 1 else ("local", "persistent")
        )
    if not tiers:
        raise ConfigError("a checkpointer needs at least one tier")
    tier_names = [t.name if isinstance(t, Tier) else t for t in tiers]
    for t in tiers:
        if not isinstance(t, (str, Tier)):
            raise ConfigError(f"a tier is a name or a Tier instance, got {t!r}")
    resolved = _policies(tiers, tier_names, keep, persist, encodings)
    resolved.update(policies or {})
    if persistent is None:
        persistent = default_persistent_url()
    root = (
        Path(local_root)
        if local_root is not None
        else default_root(job_id, node or topology.node_name)
    )
    return Options(
        job=JobOptions(
            job_id=job_id,
            topology=topology,
            node_root=root,
            persistent_url=persistent,
            storage_options=dict(storage_options or {}),
            stale_memory=stale_memory,
            elastic=elastic,
            per_rank=per_rank,
        ),
        tiers=TierOptions(
            specs=tuple(tiers),
            policies=resolved,
            local_capacity=local_capacity,
            peer_replicas=peer_replicas,
            tier_queue=tier_queue,
        ),
        schedule=ScheduleOptions(
            base_every=base_every, on_busy=on_busy, max_pending=max_pending, overlap=overlap
        ),
        encode=CodecSetup(
            codec=codec or CodecOptions(),
            allow_pickle=allow_pickle,
            threads=threads or os.cpu_count() or 1,
        ),
        coordination=CoordinationOptions(
            coordinator=coordinator,
            peer_timeout=peer_timeout,
            close_timeout=float(close_timeout),
        ),
    )


def _policies(
    specs: Sequence[str | Tier],
    names: Sequence[str],
    keep: int | Mapping[str, int] | None,
    persist: VersionSelector,
    encodings: Mapping[str, TierEncoding] | None,
) -> dict[str, TierPolicy]:
    """A policy per tier from the shorthand arguments (``keep``, ``persist``, ``encodings``)."""
    keep_map: dict[str, int] = {}
    for name in names:
        if isinstance(keep, int):
            keep_map[name] = keep
        elif keep is not None and name in keep:
            keep_map[name] = keep[name]
        else:
            keep_map[name] = DEFAULT_KEEP.get(name, 2)
    if isinstance(keep, Mapping):
        unknown = set(keep) - set(names)
        if unknown:
            raise ConfigError(f"keep names tiers that are not in use: {sorted(unknown)}")
    resolved: dict[str, TierPolicy] = {}
    for spec, name in zip(specs, names, strict=True):
        durable = (
            spec.survives >= FailureScope.CLUSTER
            if isinstance(spec, Tier)
            else name == "persistent"
        )
        encoding: TierEncoding = (encodings or {}).get(
            name, "full" if name == "local" else "packed"
        )
        resolved[name] = TierPolicy(
            keep=keep_map[name], encoding=encoding, versions=persist if durable else "all"
        )
    return resolved

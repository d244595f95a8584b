"""A checkpointer's configuration, checked and resolved once, in frozen groups.

:func:`resolve_options` turns the keyword arguments of :class:`~tiercheck.Checkpointer` (declared
once, on :class:`~tiercheck.engine.core.CheckpointerCore`, which both faces inherit) into an
:class:`Options`: every value validated (a :class:`~tiercheck.errors.ConfigError` saying what
was expected), every default filled in (the placement from the launcher, the folders, a policy
for each tier). The engine reads nothing else; each part of it reads the group it needs.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tiercheck.codec import CodecOptions
from tiercheck.consistency.coordinator import Coordinator
from tiercheck.defaults import (
    ENCODINGS,
    Encoding,
    check_job_id,
    check_node_name,
    default_encoding,
    default_keep,
    default_persistent_url,
    default_root,
)
from tiercheck.errors import ConfigError
from tiercheck.tiers.base import FailureScope, Tier
from tiercheck.tiers.registry import get_tier_class
from tiercheck.topology import Topology

__all__ = [
    "RESERVED_CHANNELS",
    "BusyPolicy",
    "CloseMode",
    "CodecSetup",
    "CoordinationOptions",
    "HealthOptions",
    "JobOptions",
    "Options",
    "PerRankPolicy",
    "PreemptionOptions",
    "ScheduleOptions",
    "StalePolicy",
    "TierEncoding",
    "TierOptions",
    "TierPolicy",
    "VersionSelector",
    "check_job_id",
    "resolve_options",
]

TierEncoding = Encoding
BusyPolicy = Literal["wait", "skip"]
StalePolicy = Literal["error", "discard", "adopt"]
#: What an elastic restore does with leaves that are not DTensors and differ between the ranks
#: that saved them: ``"refuse"`` (a :class:`~tiercheck.errors.ReshardError`) or ``"wrap"`` (new
#: rank ``q`` takes old rank ``q % N``'s); see :mod:`tiercheck.codec.reshard.reshard`.
PerRankPolicy = Literal["refuse", "wrap"]
VersionSelector = Literal["all", "base"] | Callable[[int], bool]
#: Coordination channels that are not a tier's (each tier's rounds run on one named after it):
#: the opening's, restores' and closes' exchanges, the flush on SIGTERM's, and the settling of the
#: timeline after a restore (tiercheck.engine.restore.timeline).
RESERVED_CHANNELS = ("control", "preempt", "timeline")
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
        if not _is_int(self.keep) or self.keep < 1:
            raise ConfigError(
                f"keep must be an int >= 1 (versions a tier retains), got keep={self.keep!r}"
            )
        if self.encoding not in ENCODINGS:
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
    #: Encoded versions that may wait for one tier; beyond, the oldest are dropped for it
    #: (see :func:`~tiercheck.engine.save.plan.make_room`).
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
    #: A durable tier that could not be reached at opening is tried again in the background,
    #: first after ``durable_retry_delay`` seconds, each wait twice the one before, up to
    #: ``durable_retry_max`` (see :mod:`tiercheck.engine.open.rejoin`).
    durable_retry_delay: float = 1.0
    durable_retry_max: float = 60.0


@dataclass(frozen=True, slots=True)
class HealthOptions:
    """When a tier counts as *behind* (see :mod:`tiercheck.engine.health`)."""

    #: More saves sent to a tier since its newest commit than this, not committed.
    behind_saves: int = 10
    #: The oldest save sent to a tier since its newest commit, not committed, older than this.
    behind_seconds: float = 600.0


@dataclass(frozen=True, slots=True)
class PreemptionOptions:
    """What happens on SIGTERM (see :mod:`tiercheck.engine.close.sigterm`)."""

    #: Whether a SIGTERM handler flushes the newest version committed in memory to the
    #: durable tiers before the process ends as it would have.
    enabled: bool = True
    #: The longest the flush may take, in seconds, from the signal on.
    grace: float = 20.0


@dataclass(frozen=True, slots=True)
class Options:
    """Everything a checkpointer was configured with, resolved (see :func:`resolve_options`)."""

    job: JobOptions
    tiers: TierOptions
    schedule: ScheduleOptions
    encode: CodecSetup
    coordination: CoordinationOptions
    health: HealthOptions = HealthOptions()
    preemption: PreemptionOptions = PreemptionOptions()

    @property
    def tier_names(self) -> list[str]:
        """The configured tiers' names, in configuration order."""
        return [t.name if isinstance(t, Tier) else t for t in self.tiers.specs]


def _is_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` proper (``True`` and ``False`` are not counts)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _count(name: str, value: object, minimum: int, what: str) -> int:
    """``value`` if it is an int >= ``minimum``, else a :class:`ConfigError` naming ``name``."""
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        raise ConfigError(f"{name} must be an int >= {minimum} ({what}), got {value!r}")
    return value  # type: ignore[return-value]


def _seconds(name: str, value: object, *, zero: bool) -> float:
    """``value`` as seconds: a real number > 0 (or >= 0 with ``zero``), not NaN, not a bool."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or value < 0
        or (value == 0 and not zero)
    ):
        bound = ">= 0" if zero else "> 0"
        raise ConfigError(f"{name} must be a number of seconds {bound}, got {value!r}")
    return float(value)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        listed = " or ".join(repr(c) for c in choices)
        raise ConfigError(f"{name} must be {listed}, got {value!r}")


def _tier_map(name: str, value: object, names: Sequence[str], what: str) -> Mapping[str, Any]:
    """``value`` as a mapping keyed by tiers in use (``{}`` for ``None``)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a mapping of tier name to {what}, got {value!r}")
    unknown = [k for k in value if k not in names]
    if unknown:
        raise ConfigError(
            f"{name} names tiers that are not in use: {sorted(map(repr, unknown))}; "
            f"the tiers are {list(names)}"
        )
    return value


def resolve_options(given: Mapping[str, Any]) -> Options:
    """Check the arguments of :class:`~tiercheck.Checkpointer` and fill in the defaults.

    ``given``: every argument of the constructor by name, as the caller passed it (or its
    default). The options are declared once, with their types, defaults and documentation: as
    the keyword arguments of :class:`~tiercheck.engine.core.CheckpointerCore`, which both faces
    inherit; here each is taken by name and checked, since a caller may pass anything. Raises
    :class:`ConfigError` for the first one that does not hold; detects the placement
    (:meth:`Topology.detect`) when not given.
    """
    args = dict(given)
    job_id = check_job_id(args.pop("job_id"))
    persistent = args.pop("persistent")
    local_root = args.pop("local_root")
    tiers = args.pop("tiers")
    base_every = args.pop("base_every")
    keep = args.pop("keep")
    persist = args.pop("persist")
    encodings = args.pop("encodings")
    policies = args.pop("policies")
    on_busy = args.pop("on_busy")
    max_pending = args.pop("max_pending")
    overlap = args.pop("overlap")
    tier_queue = args.pop("tier_queue")
    codec = args.pop("codec")
    allow_pickle = args.pop("allow_pickle")
    rank = args.pop("rank")
    world_size = args.pop("world_size")
    ranks_per_node = args.pop("ranks_per_node")
    node = args.pop("node")
    coordinator = args.pop("coordinator")
    local_capacity = args.pop("local_capacity")
    peer_replicas = args.pop("peer_replicas")
    peer_timeout = args.pop("peer_timeout")
    threads = args.pop("threads")
    storage_options = args.pop("storage_options")
    stale_memory = args.pop("stale_memory")
    close_timeout = args.pop("close_timeout")
    elastic = args.pop("elastic")
    per_rank = args.pop("per_rank")
    behind_saves = args.pop("behind_saves")
    behind_seconds = args.pop("behind_seconds")
    preemption = args.pop("preemption")
    preemption_grace = args.pop("preemption_grace")
    durable_retry_delay = args.pop("durable_retry_delay")
    durable_retry_max = args.pop("durable_retry_max")
    # An option declared on the constructor that nothing here reads would be silently ignored.
    assert not args, f"options the constructor declares but nothing resolves: {sorted(args)}"
    if persistent is not None and (not isinstance(persistent, str) or not persistent.strip()):
        raise ConfigError(
            "persistent must be an fsspec URL string (file:///data/ckpt, s3://bucket/ckpt, "
            f"memory://ckpt) or None, got {persistent!r}; for a folder, pass "
            "pathlib.Path(folder).resolve().as_uri()"
        )
    if local_root is not None and not isinstance(local_root, (str, os.PathLike)):
        raise ConfigError(
            f"local_root must be a folder (a str or a path) or None, got {local_root!r}"
        )
    if isinstance(local_root, str) and not local_root:
        raise ConfigError("local_root must name a folder, got an empty string")
    _count("base_every", base_every, 1, "every base_every-th save is a base")
    _choice("on_busy", on_busy, ("wait", "skip"))
    _flag("overlap", overlap)
    _count("max_pending", max_pending, 1, "saves that may be encoding at once")
    _count("tier_queue", tier_queue, 1, "encoded versions that may wait for one tier")
    if codec is not None and not isinstance(codec, CodecOptions):
        raise ConfigError(f"codec must be a tiercheck.codec.CodecOptions or None, got {codec!r}")
    _flag("allow_pickle", allow_pickle)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None:
            _count(name, value, 0 if name == "rank" else 1, "or None to detect it")
    if ranks_per_node is not None:
        _count("ranks_per_node", ranks_per_node, 1, "or None to detect it")
    if node is not None:
        check_node_name(node)
    if coordinator is not None and not isinstance(coordinator, Coordinator):
        raise ConfigError(
            f"coordinator must be a tiercheck Coordinator or None, got {coordinator!r}"
        )
    if local_capacity is not None:
        _count("local_capacity", local_capacity, 0, "bytes the local tier may use, or None")
    _count("peer_replicas", peer_replicas, 1, "peer nodes that hold a replica of each blob")
    peer_timeout = _seconds("peer_timeout", peer_timeout, zero=False)
    _count("threads", threads, 0, "worker threads for hashing and compression; 0: every core")
    _choice("stale_memory", stale_memory, ("error", "discard", "adopt"))
    _flag("elastic", elastic)
    _choice("per_rank", per_rank, ("refuse", "wrap"))
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise ConfigError(
            f"storage_options must be a mapping of fsspec options, got {storage_options!r}"
        )
    close_timeout = _seconds("close_timeout", close_timeout, zero=True)
    _count("behind_saves", behind_saves, 1, "saves a tier may fall behind before a WARNING")
    behind_seconds = _seconds("behind_seconds", behind_seconds, zero=False)
    _flag("preemption", preemption)
    preemption_grace = _seconds("preemption_grace", preemption_grace, zero=False)
    if math.isinf(preemption_grace):
        # A flush that may take forever would hold the process past its scheduler's SIGKILL.
        raise ConfigError(
            "preemption_grace must be a finite number of seconds (well under the scheduler's "
            "grace period before SIGKILL: 30 s by default in Kubernetes, Slurm and torchrun), "
            f"got {preemption_grace!r}"
        )
    durable_retry_delay = _seconds("durable_retry_delay", durable_retry_delay, zero=False)
    durable_retry_max = _seconds("durable_retry_max", durable_retry_max, zero=False)
    if not math.isfinite(durable_retry_max) or durable_retry_max < durable_retry_delay:
        raise ConfigError(
            "durable_retry_max must be a finite number of seconds >= durable_retry_delay "
            f"({durable_retry_delay}), got {durable_retry_max!r}"
        )
    if persist is not None and persist not in ("all", "base") and not callable(persist):
        raise ConfigError(
            "persist must be 'all', 'base', a callable(version) -> bool, or None (every "
            f"version where no memory tier takes them, else bases), got {persist!r}"
        )
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
    if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Sequence):
        raise ConfigError(
            f"tiers must be a list of tier names or Tier instances, got {tiers!r}; "
            'for example tiers=["local", "persistent"]'
        )
    if not tiers:
        raise ConfigError("a checkpointer needs at least one tier")
    for t in tiers:
        if not isinstance(t, Tier) and (not isinstance(t, str) or not t):
            raise ConfigError(f"a tier is a name or a Tier instance, got {t!r}")
    tier_names = [t.name if isinstance(t, Tier) else t for t in tiers]
    if len(set(tier_names)) != len(tier_names):
        raise ConfigError(f"tier names must be unique, got {tier_names}")
    reserved = sorted(set(tier_names) & set(RESERVED_CHANNELS))
    if reserved:
        # Each tier's commit rounds run on a coordination channel named after it.
        raise ConfigError(
            f"tier names {reserved} are taken by the ranks' own coordination channels "
            f"{list(RESERVED_CHANNELS)}; name the tier otherwise"
        )
    if _is_int(keep):
        _count("keep", keep, 1, "versions each tier retains")
    elif keep is not None and not isinstance(keep, Mapping):
        raise ConfigError(
            f"keep must be an int >= 1 or a mapping of tier name to an int >= 1, got {keep!r}"
        )
    elif keep is not None:
        for name, value in _tier_map("keep", keep, tier_names, "versions it retains").items():
            _count(f"keep[{name!r}]", value, 1, "versions the tier retains")
    for name, value in _tier_map("encodings", encodings, tier_names, "an encoding").items():
        _choice(f"encodings[{name!r}]", value, ENCODINGS)
    overrides = _tier_map("policies", policies, tier_names, "a TierPolicy")
    for name, value in overrides.items():
        if not isinstance(value, TierPolicy):
            raise ConfigError(f"policies[{name!r}] must be a TierPolicy, got {value!r}")
    resolved = _policies(_durable(tiers, tier_names), keep, persist, encodings)
    resolved.update(overrides)
    _warn_unstored(resolved, persist, base_every)
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
            close_timeout=close_timeout,
            durable_retry_delay=durable_retry_delay,
            durable_retry_max=durable_retry_max,
        ),
        health=HealthOptions(behind_saves=behind_saves, behind_seconds=behind_seconds),
        preemption=PreemptionOptions(enabled=preemption, grace=preemption_grace),
    )


def _warn_unstored(
    resolved: Mapping[str, TierPolicy],
    persist: VersionSelector | None,
    base_every: int,
) -> None:
    """Warn (once per call site) when no tier takes every version: the saves that are neither
    bases nor chosen by a predicate would then be stored nowhere."""
    selectors = [p.versions for p in resolved.values()]
    if "all" in selectors or (base_every == 1 and all(v == "base" for v in selectors)):
        return
    given = f"persist={persist!r}" if persist is not None else "the policies given"
    warnings.warn(
        f"no tier takes every version ({given}, tiers {sorted(resolved)}): saves that are not "
        f"bases (one save in {base_every} is) are stored in no tier, and their handles target "
        "none. Add a memory tier (tiers=['local', ...]) or pass persist='all' to store every "
        "save durably",
        UserWarning,
        stacklevel=4,
    )


def _durable(specs: Sequence[str | Tier], names: Sequence[str]) -> dict[str, bool]:
    """Whether each tier outlives the cluster, as it declares (``survives``), by tier name.

    What a tier is named decides nothing: a tier given by name is looked up in the registry
    here (importing a plugin's module), so that a name registered wrongly, or not at all, fails
    at construction rather than at opening, and its class's declaration is what counts.
    """
    durable: dict[str, bool] = {}
    for spec, name in zip(specs, names, strict=True):
        survives = spec.survives if isinstance(spec, Tier) else get_tier_class(spec).survives
        durable[name] = survives >= FailureScope.CLUSTER
    return durable


def _policies(
    durable: Mapping[str, bool],
    keep: int | Mapping[str, int] | None,
    persist: VersionSelector | None,
    encodings: Mapping[str, TierEncoding] | None,
) -> dict[str, TierPolicy]:
    """A policy per tier from the shorthand arguments (``keep``, ``persist``, ``encodings``),
    already checked, and each tier's kind (``durable``, by tier name): what is not given
    follows from the kind (:func:`~tiercheck.defaults.default_keep`,
    :func:`~tiercheck.defaults.default_encoding`)."""
    if persist is None:
        # Bases only where a memory tier takes every version; a job stored only in durable
        # tiers stores every version there, or the saves between bases would go nowhere.
        persist = "base" if not all(durable.values()) else "all"
    resolved: dict[str, TierPolicy] = {}
    for name, is_durable in durable.items():
        if isinstance(keep, int):
            kept = keep
        elif keep is not None and name in keep:
            kept = keep[name]
        else:
            kept = default_keep(is_durable)
        encoding: TierEncoding = (encodings or {}).get(name, default_encoding(is_durable))
        resolved[name] = TierPolicy(
            keep=kept, encoding=encoding, versions=persist if is_durable else "all"
        )
    return resolved

"""What :class:`~tiercheck.Checkpointer` and :class:`~tiercheck.SyncCheckpointer` share.

One constructor for both: its keyword arguments are the one place the options are declared,
with their types, defaults and documentation (both faces inherit it;
:func:`~tiercheck.engine.options.resolve_options` checks and resolves them), and a few read-only
properties. The public calls themselves are written once, as steps both faces drive, in
:mod:`tiercheck.engine.steps`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tiercheck.codec import CodecOptions
from tiercheck.consistency.coordinator import Coordinator
from tiercheck.defaults import persistent_job_url
from tiercheck.engine.health import Health
from tiercheck.engine.options import (
    BusyPolicy,
    PerRankPolicy,
    StalePolicy,
    TierEncoding,
    TierPolicy,
    VersionSelector,
    resolve_options,
)
from tiercheck.engine.results import CheckpointerStats, check_timeout
from tiercheck.engine.steps import CallSteps
from tiercheck.tiers.base import Tier
from tiercheck.topology import Topology

__all__ = ["CheckpointerCore"]


class CheckpointerCore(CallSteps):
    """What :class:`Checkpointer` and :class:`~tiercheck.SyncCheckpointer` share: the
    configuration (one constructor for both), its properties, and the steps of every public call
    (:class:`~tiercheck.engine.steps.CallSteps`)."""

    def __init__(
        self,
        job_id: str,
        *,
        persistent: str | None = None,
        local_root: str | os.PathLike[str] | None = None,
        tiers: Sequence[str | Tier] | None = None,
        base_every: int = 10,
        keep: int | Mapping[str, int] | None = None,
        persist: VersionSelector | None = None,
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
        behind_saves: int = 10,
        behind_seconds: float = 600.0,
        preemption: bool = True,
        preemption_grace: float = 20.0,
        durable_retry_delay: float = 1.0,
        durable_retry_max: float = 60.0,
    ) -> None:
        """Configure; nothing is opened or written until first use (or ``open``).

        Args:
            job_id: names the job; everything it stores sits under this name: 1 to 128 ASCII
                letters, digits, ``.``, ``_`` and ``-``, not starting with ``.`` or ``-``
                (``"run-1"``; see :func:`~tiercheck.defaults.check_job_id`). Anything else is
                a :class:`~tiercheck.errors.ConfigError` here, before anything is opened.
            persistent: an fsspec URL for durable storage (``file://``, ``s3://``, ``memory://``,
                ...), or ``None`` for ``./tiercheck-checkpoints``.
            local_root: this node's shared-memory folder (default
                ``/dev/shm/tiercheck/<job>/<node>``).
            tiers: tier names or :class:`~tiercheck.tiers.Tier` instances, any order (they are
                used fastest first). Default: ``local`` + ``persistent``, plus ``peer`` when the job
                spans more than one node.
            base_every: every ``base_every``-th save is a base, the others deltas against it.
            keep: versions each tier retains: one number for all tiers or a mapping by tier name
                (defaults: local 2, peer 2, persistent 3).
            persist: which versions go to tiers that outlive the cluster: ``None`` (default)
                sends bases there when a memory tier takes every version, and every version
                when the job has durable tiers only (so that no save is stored nowhere);
                ``"base"``, ``"all"``, or a predicate on the version (bases always go). With
                ``"base"`` or a predicate and no memory tier, the other saves are stored in no
                tier: a :class:`UserWarning` says so at construction.
            encodings: ``"full"`` or ``"packed"`` per tier name (default: ``full`` for the local
                tier, ``packed`` elsewhere).
            policies: full :class:`TierPolicy` objects by tier name (override the three above).
            on_busy: ``"wait"`` (default) or ``"skip"`` when the previous save is still encoding.
            max_pending: how many saves may be encoding at once before ``on_busy`` applies.
            overlap: ``save`` returns before the snapshot is copied; the copy runs on a worker
                thread (and, for GPU tensors, a side stream) while training computes. The state
                must not change until the copy is done: pass the fence first --
                ``handle.staged()``, ``ckpt.fence()``, or install it once with
                :func:`~tiercheck.fence_before_step` (an optimizer step pre-hook) or
                :func:`~tiercheck.fence_before_forward`; every optimizer step waits for it
                anyway while copies are in flight. A change made before the fence that
                torch's version counters show makes the version fail
                (:class:`~tiercheck.errors.StateChanged`) instead of storing a torn copy: the
                counters are compared on the caller's side once the copy is done (the fence,
                the next save, ``wait``, ``close``, the handle's ``result``), and no tier
                stores the version before. Inference tensors and numpy arrays, whose changes
                no counter shows, are copied before ``save`` returns.
            tier_queue: how many encoded versions may wait for one tier (a slow remote store
                never blocks training). One more, and the oldest waiting are dropped for that
                tier, never the newest whole one (a base, or a delta with its base); a durable
                tier whose write failed (an outage) sends the newest whole version next.
            codec: compression options for packed blobs.
            allow_pickle: admit arbitrary Python objects in the state through pickle (off: a
                checkpoint from a stranger must not be able to run code).
            rank, world_size, ranks_per_node: placement; detected from torch.distributed and the
                launcher's environment when not given.
            node: the node's name (default ``node<index>``; the grammar of ``job_id``).
            coordinator: how ranks agree (default: none for one rank, dedicated gloo groups
                for more).
            local_capacity: bytes the local tier may use.
            peer_replicas, peer_timeout: peer tier replica count and the seconds any exchange with
                another rank may take before failing.
            threads: worker threads for hashing and compression (default: every core).
            storage_options: options for the ``persistent`` URL's fsspec filesystem, e.g. for
                S3 ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``
                (default: the backend's own, such as the AWS environment variables).
            stale_memory: what to do with a node's shared memory that is not known to be this
                run's (another run of the same ``job_id``, another durable location, a location
                that was made anew, or an identity record that is damaged or missing):
                ``"error"`` (default) refuses to open with
                :class:`~tiercheck.errors.StaleMemory`, whose message says which case it is and
                which versions exist only there; ``"discard"`` deletes that memory;
                ``"adopt"`` takes memory whose identity is damaged or missing as this run's
                (never memory that names another run or location).
            close_timeout: seconds the close may spend on each step that can wait on something
                it does not control: when leaving ``with``/``async with`` on an exception, the
                wait for the saves in flight (memory tiers first; no agreement with other
                ranks, which may be failing too), and stopping the peer tier's server. The
                normal close waits for every save without this bound (each exchange with
                another rank is bounded by ``peer_timeout``).
            elastic: allow a job saved by another number of ranks to be opened here and
                restored, resharded onto this world (DTensors on a one-dimensional mesh over
                all ranks, FSDP2's; see :mod:`tiercheck.codec.reshard.reshard` for the rules). Off
                (default), such a job is refused with
                :class:`~tiercheck.errors.WorldSizeMismatch` before anything is read. A job
                opened on another number of ranks must ``restore()`` before its first save.
            per_rank: in an elastic restore, what happens to a leaf that is not a DTensor and
                differs between the ranks that saved it (a rank's own RNG state or data-loader
                position): ``"refuse"`` (default) raises
                :class:`~tiercheck.errors.ReshardError` naming it; ``"wrap"`` gives new rank
                ``q`` the value old rank ``q % N`` saved.
            behind_saves, behind_seconds: when a tier counts as behind -- more than
                ``behind_saves`` saves sent to it since its newest committed version have not
                committed there, or the oldest of them is more than ``behind_seconds`` old
                (another rank paused past ``peer_timeout``, storage down, a tier full). A
                WARNING says so once, and once more when the tier commits again;
                :meth:`health` has the figures. A tier that cannot keep up with the saves lags
                by up to ``tier_queue`` + 1 saves; the defaults (10 saves, 600 s) leave room
                for that and for a large upload.
            preemption: on SIGTERM (a scheduler preempting the job, torchrun stopping its
                workers), make the newest version committed in memory durable before the
                process ends: the ranks agree on the newest version every one of them holds in
                memory, and where a durable tier holds nothing as new, each rank writes its
                blob of it there as a base and rank 0 commits it; what is left of the grace
                goes to the saves still in flight to durable tiers. Then the signal goes on to
                the handler that was in place before (the default one ends the process with
                SIGTERM's status; an ignored SIGTERM stays ignored; a Python handler is called).
                The flush starts from the signal itself, even while the main thread is inside a
                long C++ call. The handler is installed when a checkpointer opens on the main
                thread (an INFO line says when it cannot be) and put back when the last one
                closes; one handler serves every checkpointer of the process (see
                :mod:`tiercheck.engine.close.sigterm`). ``False``: no handler is installed and the
                one in place is left alone. Every rank must use the same setting.
            preemption_grace: the longest the flush on SIGTERM may take, in seconds (default
                20, under the 30 s that Kubernetes, Slurm and torchrun give before SIGKILL): a
                rank that does not answer in time, or a durable tier that does not take the
                version in time, makes the flush give up with a WARNING, and the process ends
                as it would have.
            durable_retry_delay, durable_retry_max: a durable tier that cannot be reached when
                the job opens, while the nodes' memory holds this run's versions, does not stop
                the opening (see below): it is tried again in the background, first after
                ``durable_retry_delay`` seconds, each wait twice the one before (with jitter),
                up to ``durable_retry_max`` seconds between tries.

        Opening refuses, with a typed error and before anything is read or changed: a second
        live writer of the same rank on this node (:class:`~tiercheck.errors.JobLocked`), a
        durable location that cannot be written, read and deleted from
        (:class:`~tiercheck.errors.StorageError`), a job saved by another number of ranks
        (:class:`~tiercheck.errors.WorldSizeMismatch`, unless ``elastic``), and stale memory
        (above). A second opening of the job elsewhere takes the durable tiers over; this one
        then stops writing there (:class:`~tiercheck.errors.Superseded`, ``stats.superseded``).

        A durable tier that cannot be *reached* (a connection or timeout error, not a refusal
        such as a permission error or a missing bucket) is refused the same way, unless the
        nodes' memory holds versions of this run that can be verified without it (every node
        that holds data names this job, this durable location and one incarnation): the job
        then opens *degraded*, with one WARNING naming the tier and the error. ``restore``
        reads from memory (call it before saving: what the tier stores cannot be checked),
        saves go to the memory tiers, and ``stats.unreachable`` names the tier. Once every
        rank reaches it again, the start of the next save checks this run's ownership there
        (the job record, ``tiercheck rm-job``'s tombstone, the writer generations -- an
        opening made while the tier was unreachable is newer and keeps it) and claims it;
        only then is anything written there, first what the restore left to set aside.

        Memory: staging costs one copy of the state (in the local tier's memory when it is used),
        a second copy is held as the delta base when a packed tier receives deltas, and each
        tier's queue holds at most ``tier_queue`` encoded versions. Replicated state
        (:class:`~tiercheck.Replicated`, DTensors placed ``Replicate()`` over all ranks) counts
        once per node: only the node's first rank stores it, so a node's shared memory holds
        the ranks' own state plus one copy of it per version (and durable tiers one copy in
        all). A node's first rank other than rank 0 holds, while it encodes for a durable
        tier, a copy of its own (unreplicated) state, and keeps one with the delta base.
        """
        # Every argument by name, as given (the signature above is the one declaration).
        given = dict(locals())
        del given["self"]
        self._config = resolve_options(given)
        self._loop = None
        self._engine = None
        self._closed = False

    # --- properties ---------------------------------------------------------------------------

    @property
    def job_id(self) -> str:
        """The job's name."""
        return self._config.job.job_id

    @property
    def topology(self) -> Topology:
        """Where this rank sits."""
        return self._config.job.topology

    @property
    def tier_names(self) -> list[str]:
        """The tiers in use, fastest first (after opening; configuration order before)."""
        if self._engine is not None and self._engine.tiers:
            return [t.name for t in self._engine.tiers]
        return [t.name if isinstance(t, Tier) else t for t in self._config.tiers.specs]

    @property
    def policies(self) -> Mapping[str, TierPolicy]:
        """The policy of each tier."""
        return dict(self._config.tiers.policies)

    @property
    def node_root(self) -> Path:
        """This node's shared-memory folder."""
        return self._config.job.node_root

    @property
    def persistent_job_url(self) -> str:
        """The job's folder in the built-in persistent tier: the ``persistent=`` URL plus the
        job id (where a ``"persistent"`` tier stores; a :class:`Tier` instance stores elsewhere).
        """
        return persistent_job_url(self._config.job.persistent_url, self._config.job.job_id)

    @property
    def opened(self) -> bool:
        """Whether the checkpointer was opened (explicitly, or by the first call that needed
        its tiers); it stays ``True`` after closing. A call refused for bad input before
        anything was touched leaves it ``False``."""
        return self._engine is not None

    @property
    def stats(self) -> CheckpointerStats:
        """Running totals (a snapshot copy)."""
        if self._engine is None:
            return CheckpointerStats()
        return self._engine.figures()

    def health(self) -> Health:
        """Whether each tier keeps committing, as this rank sees it, now (never blocks).

        By tier, fastest first (:class:`~tiercheck.engine.health.TierHealth`): the newest
        committed version and its age, the saves sent to the tier since then that did not
        commit, how long ago the oldest of them was saved, whether that is more than
        ``behind_saves`` / ``behind_seconds`` (``behind``), and the latest failure. Empty
        before the checkpointer opens. For a trainer's loop or a monitor::

            if ckpt.health().behind:
                ...  # the newest restorable version is falling behind training
        """
        engine = self._engine
        if engine is None:
            return Health()
        return engine.health()

    def fence(self, timeout: float | None = None) -> None:
        """Block until every snapshot this checkpointer is still copying is staged.

        The fence of overlapped saves (``overlap=True``), for every save at once; returns at
        once when none is in flight (always, for blocking saves). Callable from any thread,
        including hooks (:func:`~tiercheck.fence_before_step`); never raises a copy's own
        failure, only :class:`TimeoutError` when ``timeout`` passes first. It confirms the
        copies it waited for: their versions fail if the state changed since ``save`` (see
        :mod:`tiercheck.engine.save.staging`), which it compares here, where the caller's in-place
        changes made before it are all finished.
        """
        timeout = check_timeout(timeout)
        engine = self._engine
        if engine is not None:
            engine.fence(timeout)

    async def fence_async(self, timeout: float | None = None) -> None:
        """:meth:`fence` without blocking the event loop: it waits in a worker thread."""
        await asyncio.to_thread(self.fence, timeout)

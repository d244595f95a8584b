"""The checkpointer: save often, cheaply, to every tier; restore from the fastest survivor.

Lifecycle of one save (the order things happen in)
--------------------------------------------------
1. ``await ckpt.save(version, state)`` -- on the caller's side, the only blocking part:
   the state is flattened (no pickle; a state shaped like the previous one reuses its layout,
   see :mod:`tiercheck.codec.encode.plan`) and its tensors are copied into host memory -- straight
   into the local tier's shared memory where that tier can hand it out, else into a reused
   staging buffer. If the previous save is still being encoded, the ``on_busy`` policy decides:
   ``"wait"`` for it, or ``"skip"`` this one (counted). It returns a :class:`SaveHandle`;
   training may change its tensors at once. With ``overlap=True`` it returns once the copy is
   started, and the state may change once the copy is done (:meth:`SaveHandle.staged`, the
   fence; see :mod:`tiercheck.engine.save.staging`); the version is stored only once the caller's
   side confirmed the state unchanged until the copy was done.
2. Background, in save order: the raw payload is hashed; the local blob is published; the
   state is encoded for the other tiers (a delta against the newest base, byte planes, zstd).
3. Background, per tier, in version order: the blob is written; the manifest logs it (its
   ``durable`` record).
4. Background, per tier: the ranks exchange what was written (a side channel, never the
   training's own process group); a version is *committed* in a tier once every rank's blob of
   it, and of its base, is written there. For tiers that outlive the cluster a ``COMMIT`` record
   listing every blob is written last. ``handle.result_async(tier)`` resolves; retention then trims
   the tier (never a base a kept delta needs, never a version still in flight).

Restore: every rank inventories what it can reach, the ranks agree on the newest version every
one of them can rebuild, each reads it from its fastest source, verifying checksums and falling
back to the next tier on any missing or corrupt blob. A restore changes nothing stored: the
first save after it takes the versions newer than the restored one off the run's timeline (set
aside whole under ``abandoned/`` in durable tiers, dropped from memory tiers; see
:mod:`tiercheck.engine.restore.timeline`), so a later save can never be mixed with a blob of an
abandoned future.

Errors in the background never reach training: they are logged (logger ``"tiercheck"``),
counted in :attr:`Checkpointer.stats`, raised from ``handle.result(tier)``, and the version simply
does not commit in that tier. A tier that keeps not committing is said so loudly: a WARNING
once its newest committed version falls more than ``behind_saves`` saves or ``behind_seconds``
behind, another when it commits again, and :meth:`Checkpointer.health` has the figures. A rank
that pauses for longer than ``peer_timeout`` (a stop signal, swapping, a long collection) costs
the versions whose rounds it missed: the ranks' channels connect anew and the rounds get back
in step (:mod:`tiercheck.consistency.resync`), so commits resume without a restart.

The pipeline runs on a private event loop on its own thread, so it advances while the caller
computes, whether the caller is synchronous (use :class:`SyncCheckpointer`) or async.

Where each step lives
---------------------
This module is the public face (the blocking one is :mod:`tiercheck.sync`); each of its calls
is written once, as steps both faces drive, in ``engine/steps``
(:class:`~tiercheck.engine.steps.CallSteps`), and the one constructor both inherit, with every
option, is in ``engine/core``. The engine behind it is :mod:`tiercheck.engine`: configuration
in ``options`` (:func:`~tiercheck.engine.options.resolve_options`), the parts put together in
``engine`` (:class:`~tiercheck.engine.engine.Engine`), step 1 in ``schedule`` and ``stage``, step
2 in ``encode``, steps 3 and 4 in ``tier`` (one :class:`~tiercheck.engine.commit.tier.TierPipeline`
per tier), ``lane`` and ``commit``; restore in ``restore``, ``read`` and ``elastic``; the first save
after a restore in ``timeline``; the checks on opening in ``claim``; closing in ``shutdown``; the
flush on SIGTERM in ``preempt`` (its handler in ``sigterm``). The walk file by file:
``docs/architecture.md``.
"""

from __future__ import annotations

from typing import Any

from tiercheck.engine.core import CheckpointerCore
from tiercheck.engine.options import TierPolicy
from tiercheck.engine.results import (
    OWN_STORAGE_BYTES,
    CheckpointerStats,
    Restored,
    SaveHandle,
    SaveStats,
    TierSaveStats,
)

__all__ = [
    "OWN_STORAGE_BYTES",
    "Checkpointer",
    "CheckpointerStats",
    "Restored",
    "SaveHandle",
    "SaveStats",
    "TierPolicy",
    "TierSaveStats",
]


class Checkpointer(CheckpointerCore):
    """Tiered, asynchronous checkpointing of one rank's training state.

    ``save`` blocks only while the state is copied to host memory; the rest happens in the
    background (see the module docstring for the order of events). ``restore`` returns the
    newest version every rank can rebuild, from the fastest tier that has it.

    Constructed with ``job_id`` and keyword options (``persistent=``, ``tiers=``,
    ``base_every=``, ``keep=``, ...): see ``__init__``. :class:`~tiercheck.SyncCheckpointer`
    takes exactly the same.
    """

    async def open(self) -> Checkpointer:
        """Open tiers, manifest and coordination (done on first use if not called)."""
        # An opened checkpointer answers with itself here, closed or not (as it always did);
        # every other call refuses a closed one.
        if self._engine is None or not self._engine.opened:
            await self._adrive(self._open_steps())
        return self

    async def __aenter__(self) -> Checkpointer:
        return await self.open()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        # On an exception the other ranks may be failing too: no agreement, a bounded flush.
        await self._adrive(self._close_steps("collective" if exc_type is None else "bounded"))

    async def prepare(self, state: Any, *, version: int = 0) -> int:
        """Ready the memory the first save of ``state`` will be copied into, ahead of it.

        A new job's first save finds no memory ready: the local tier sizes, backs and faults
        in room for the snapshot inside the training step (about 12x the copy at 1 GiB; after
        a restore this is done in the background already). Called once the state has the
        shape it will have at that save, ``prepare`` walks it as a save would (each
        ``Stateful`` object's ``state_dict()`` is called, and the save then reuses the layout
        found) and readies the room in the background; it copies nothing, and does not wait
        for the room. Returns the bytes readied: 0 where no tier copies the state into its own
        memory (a GPU state is staged through pinned buffers), or where a save has already
        reserved.

        Call it where the state is final: after the model and optimizer exist *and* the
        optimizer has stepped once (``torch.optim`` optimizers create their moments at their
        first step: before it, the state is smaller than at the first save, and the room
        readied does not fit it; the first save then allocates as it would have). ``version``:
        the first save's (its number is written in the blob's header, whose length may differ
        by a few bytes). Not collective: each rank prepares its own.
        """
        return await self._adrive(self._prepare_steps(state, version))

    async def save(self, version: int, state: Any) -> SaveHandle:
        """Snapshot ``state`` as ``version`` and return once training may modify it again
        (with ``overlap=True``: once the copy is started; see :meth:`SaveHandle.staged`).
        ``Stateful`` objects in it are saved as their ``state_dict()``; DTensors as their local
        shard and layout."""
        return await self._adrive(self._save_steps(version, state))

    async def restore(
        self, state: Any = None, *, version: int | None = None, strict: bool = True
    ) -> Restored | None:
        """Restore the newest version every rank can rebuild (or exactly ``version``).

        Every rank must call it (it is collective). Returns ``None`` when nothing is stored (a
        fresh start). When versions are stored but none can be restored (corrupt everywhere,
        unreadable, a tier that cannot be listed) it raises
        :class:`~tiercheck.errors.RestoreError` listing, per version, rank and tier, why each
        was rejected -- and deletes nothing. Blobs that fail verification are set aside under
        ``quarantine/`` in their tier. Versions newer than the one restored are removed only
        after it was restored whole.

        With ``state`` given, tensors are copied into the caller's own tensors (optimizers keep
        their references) and the filled object is returned as ``Restored.state``. First the
        state is compared with the version: with ``strict=True`` structure, keys, shapes and
        dtypes must match; with ``strict=False`` keys present on one side only are allowed
        (the version's are added, the state's are left alone). Any mismatch raises
        :class:`~tiercheck.errors.StateMismatch` listing the paths, before anything is written
        into the state or removed from storage.

        ``Stateful`` objects in ``state`` (``state_dict``/``load_state_dict``: a module, an
        optimizer, :mod:`tiercheck.adapters`) get their restored value through
        ``load_state_dict`` (see :mod:`tiercheck.engine.stateful`); DTensors are filled shard by
        shard after their layout was checked. Without ``state``, stored DTensors come back as
        DTensors where their mesh can be rebuilt from the default process group, else as their local
        shards (see :func:`tiercheck.codec.format.dtensor.materialize`).

        A ``version`` that is not an int in ``[0, 10**12)`` (a string, a bool, a float) is a
        :class:`~tiercheck.errors.VersionError`, before anything is opened or exchanged.
        """
        return await self._adrive(self._restore_steps(state, version, strict))

    async def wait(self) -> dict[str, int | None]:
        """Wait until every save so far is committed or failed in each of its tiers.

        Returns the newest version committed in each tier by then (``None`` for a tier that
        holds none): ``(await ckpt.wait())["persistent"]`` is the newest durable version.
        """
        return await self._adrive(self._wait_steps())

    async def versions(self) -> dict[str, list[int]]:
        """Versions committed in each tier, as known to this rank."""
        return await self._adrive(self._versions_steps())

    async def aclose(self, *, flush: bool = True, failed: bool = False) -> None:
        """Finish the saves in flight, then release everything; every rank must call it.

        The normal end of a job, collective: once every rank's saves are done, the ranks
        agree on it, stop their peer servers (the last use of the job's key-value store) and
        agree again, so that no rank leaves while another still needs the store or a peer.
        A rank or store that is gone is logged once and never makes this raise or hang
        beyond ``peer_timeout`` per exchange and ``close_timeout`` per local step.
        ``flush=False`` waits for nothing and agrees with no one: pending saves are abandoned.
        ``failed=True`` is the close of a rank leaving because of an error, as when it leaves
        ``async with`` on an exception: no agreement (the other ranks may be failing too), the
        saves in flight get ``close_timeout`` seconds, memory tiers first.
        """
        await self._adrive(self._close_call_steps(flush, failed))


# The shared base under its former name (kept importable from here).
_CheckpointerCore = CheckpointerCore

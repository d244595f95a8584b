"""Lightning integration: save and resume a ``lightning.pytorch.Trainer`` through tiercheck.

Two objects, both required::

    io = TiercheckCheckpointIO("run-1", persistent="s3://bucket/ckpt")
    trainer = L.Trainer(plugins=[io], callbacks=[TiercheckCallback(every_n_train_steps=50)])
    trainer.fit(model, datamodule, ckpt_path=io.resume_path())   # None on the first launch

* :class:`TiercheckCheckpointIO` is the ``CheckpointIO`` plugin: every checkpoint the trainer
  writes (``trainer.save_checkpoint``, ``ModelCheckpoint``, :class:`TiercheckCallback`) becomes
  the tiercheck version ``checkpoint["global_step"]``, and every ``ckpt_path`` it is asked to
  load is resolved to a version and restored.
* :class:`TiercheckCallback` links the trainer to the plugin, adds the global RNG states to each
  checkpoint and restores them when training starts (Lightning itself saves none), and
  optionally saves every N optimizer steps. Under DDP and ``ModelParallelStrategy`` it also
  makes every rank save (below).

Checkpoint names (``filepath`` when saving, ``ckpt_path`` when loading):

* ``"tiercheck:latest"`` (:data:`LATEST`) -- load the newest version every rank can rebuild.
  Torn versions (a process killed mid-save, a corrupt blob) are never chosen.
* ``"tiercheck:resume"`` (:data:`RESUME`, what :meth:`TiercheckCheckpointIO.resume_path`
  returns) -- the same, or nothing at all when nothing is restorable: the trainer then starts
  fresh, as with ``ckpt_path=None``.
* ``"tiercheck:<step>"`` -- exactly that version. Saving under such a name writes no file.
* any other path -- saving stores the version and writes a small *pointer file* at the path
  (JSON naming the job and the version; atomic on local filesystems) so that Lightning's
  bookkeeping works unchanged: ``ModelCheckpoint`` top-k and ``save_last`` (including links),
  ``ckpt_path="last"`` and ``"best"``. Loading reads the pointer and restores its version. A
  file that is not a pointer (an ordinary ``.ckpt``) is loaded with Lightning's
  ``TorchCheckpointIO``, so a run can move over to tiercheck from a stock checkpoint.

Loading restores exactly the version named and changes nothing stored. During ``fit`` the run
then continues from it: when it is older than the newest, its next save sets the newer versions
aside (in durable storage; ``tiercheck ls`` shows them) as it saves those steps again. Loading
for ``validate``/``test``/``predict`` saves nothing, so it leaves every version as it was.

Retention: ``remove_checkpoint`` (``ModelCheckpoint``'s top-k rotation) deletes the pointer file
only; the version's data stays under tiercheck's own retention (the checkpointer's ``keep``),
which never evicts a version whose save is still in flight nor a base that a kept delta needs.
Since the pointer is written before ``save_checkpoint`` returns and the blobs are never touched
by ``remove_checkpoint``, removal cannot race an in-flight save. A pointer whose version
retention has since evicted fails to load with :class:`~tiercheck.errors.RestoreError`.

Several processes (``strategy="ddp"``): a tiercheck save and restore are collective, every rank
storing its own part (its RNG states, its loader position, and its copy of the replicated model
and optimizers), while Lightning hands a checkpoint to the ``CheckpointIO`` on global rank zero
only. So at ``setup`` the callback makes the DDP strategy hand each checkpoint to the plugin on
every rank (``trainer.save_checkpoint`` and ``ModelCheckpoint`` already run on every rank);
pointer files are written, and removed, by global rank zero only, so ``ModelCheckpoint`` paths
must be on storage every rank can read, as Lightning requires for its own checkpoints. Loading
is collective the same way: every rank restores the one version they agree on. The checkpointer
opens on first use, inside ``fit`` (after the process group exists); :meth:`resume_path` opens
nothing and can be called before.

``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in the module's ``configure_model``): the
strategy writes and reads ``torch.distributed.checkpoint`` folders itself, calling no
``CheckpointIO``. At ``setup`` the callback makes it hand each checkpoint to the plugin on every
rank instead -- the checkpoint's ``state_dict`` and ``optimizer_states`` are the strategy's own
(``get_model_state_dict`` / ``get_optimizer_state_dict``, sharded), so each rank stores its own
shards as DTensor leaves (local shard plus layout) -- and load through the plugin on every rank:
the restored shards are put back on each parameter's own mesh and placements (a shard that does
not fit them is a :class:`~tiercheck.errors.StateMismatch`) and loaded with
``set_model_state_dict`` / ``set_optimizer_state_dict`` (an optimizer that has not stepped yet
is fine); its teardown also closes the plugin, as other strategies' do. Resuming needs the
sharding the checkpoint was saved with (same world size and mesh).

Covered: single-process training (``SingleDeviceStrategy``: one CPU, GPU or other device),
``DDPStrategy`` (``strategy="ddp"``) started by ``torchrun`` (or another launcher that starts
every process) or by Lightning itself, on CPUs (gloo) or GPUs, and ``ModelParallelStrategy``
with its default ``save_distributed_checkpoint=True`` (tested in CI: FSDP2 over the
data-parallel mesh, 2 CPU ranks under ``torchrun``; tensor-parallel layouts take the same path
but are not tested). Not covered, refused with :class:`~tiercheck.errors.ConfigError` at
``setup``: strategies that write their own checkpoints (FSDP, DeepSpeed, XLA; a ``DDPStrategy``
or ``ModelParallelStrategy`` subclass that overrides a checkpoint hook),
``ModelParallelStrategy(save_distributed_checkpoint=False)`` (it gathers the whole state on
rank zero), DDP started by ``spawn``/``fork`` (``"ddp_spawn"``, ``"ddp_notebook"``...),
optimizers that shard their state (``ZeroRedundancyOptimizer``); also ``AsyncCheckpointIO``
wrapping (the plugin is already non-blocking), weights-only checkpoints (they cannot be resumed
from), ``storage_options``, and the standalone ``pytorch_lightning`` package (this is built on
``lightning``).
"""

from __future__ import annotations

import json
import logging
import weakref
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tiercheck import atomic_write_file
from tiercheck.checkpointer import Restored, SaveHandle
from tiercheck.codec.decode.statetree import own_copy
from tiercheck.consistency.keys import MAX_VERSION
from tiercheck.errors import ConfigError, FormatError, RestoreError
from tiercheck.integrations._common import (
    LATEST,
    RESUME,
    Session,
    Target,
    capture_rng,
    parse_name,
    restore_rng,
    version_name,
)
from tiercheck.integrations._lightning_strategies import (
    _COVERED,
    _check_ddp,
    _check_model_parallel,
    _close_at_teardown,
    _load_on_every_rank,
    _nothing_to_resume,
    _overridden_hooks,
    _save_on_every_rank,
)
from tiercheck.sync import SyncCheckpointer

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.strategies import (
        DDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
        Strategy,
    )
    from lightning.pytorch.trainer.states import TrainerStatus
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "tiercheck.integrations.lightning needs Lightning: pip install 'tiercheck[lightning]'"
    ) from exc

if TYPE_CHECKING:
    from lightning.fabric.utilities.types import _PATH

__all__ = ["LATEST", "RESUME", "TiercheckCallback", "TiercheckCheckpointIO", "version_name"]

logger = logging.getLogger("tiercheck")

#: Names the format of pointer files; a file without it is not a tiercheck pointer.
POINTER_FORMAT = "tiercheck.lightning-pointer/1"
# The parts of a Lightning checkpoint that hold nearly all its bytes.
_BULK = frozenset({"state_dict", "optimizer_states"})
# A pointer is a few dozen bytes; anything larger is an ordinary checkpoint, not read as JSON.
_POINTER_MAX_BYTES = 4096


class TiercheckCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that stores checkpoints as tiercheck versions.

    Pass it in ``Trainer(plugins=[...])`` together with a :class:`TiercheckCallback` in
    ``callbacks``. The version of a checkpoint is its ``global_step``; see the module docstring
    for the checkpoint names it understands.

    ``save_checkpoint`` returns once the state is copied to host memory; encoding and writing
    to the tiers continue in the background (:attr:`last_save` is the handle of the newest
    save). The checkpointer is closed -- finishing every save in flight, in every tier -- when
    the trainer tears down (end of ``fit``, ``validate``...), and built again on next use. A
    save made while the trainer is not running (``trainer.save_checkpoint`` after ``fit``)
    has no teardown to follow it, so it returns only once written to every tier.

    Args:
        job_id: the tiercheck job (names everything stored).
        **options: any other :class:`~tiercheck.SyncCheckpointer` argument (``persistent``,
            ``local_root``, ``keep``, ``base_every``, ``allow_pickle``...).
    """

    def __init__(self, job_id: str, **options: Any) -> None:
        super().__init__()
        self._session = Session(job_id, options)
        self._trainer: weakref.ref[pl.Trainer] | None = None

    # --- public extras ----------------------------------------------------------------------

    @property
    def job_id(self) -> str:
        """The tiercheck job."""
        return self._session.job_id

    @property
    def checkpointer(self) -> SyncCheckpointer:
        """The underlying checkpointer (opened on first use; under DDP opening is collective,
        so touch it on every rank, after the process group exists)."""
        return self._session.checkpointer

    @property
    def last_save(self) -> SaveHandle | None:
        """The handle of the newest save: ``last_save.result("persistent")`` waits until durable."""
        return self._session.last_save

    @property
    def restored(self) -> Restored | None:
        """What the newest load restored (version, source tier...), ``None`` before one."""
        return self._session.restored

    def resume_path(self) -> str | None:
        """The ``ckpt_path`` that resumes this job: :data:`RESUME`, or ``None`` when nothing of
        the job is stored, so that one training script serves the first launch and every
        restart: ``trainer.fit(model, ckpt_path=io.resume_path())``.

        Opens nothing and needs no process group, so it can be called before ``fit`` under
        ``torchrun`` or Lightning's own launcher: it only looks whether the job's persistent
        folder or this node's memory holds anything (see
        :meth:`~tiercheck.integrations._common.Session.holds_anything`). The version is chosen
        when ``fit`` loads :data:`RESUME`, by every rank together: the newest version every
        rank can rebuild, or a fresh start when none is restorable.
        """
        return RESUME if self._session.holds_anything() else None

    # --- CheckpointIO -----------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Store ``checkpoint`` as version ``checkpoint["global_step"]``; write a pointer at
        ``path`` unless it is a ``tiercheck:`` name. Returns after the snapshot copy."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} does not take storage_options (got {storage_options!r})"
            )
        trainer = self._linked_trainer()
        if trainer is None:
            raise ConfigError(
                "TiercheckCheckpointIO needs a TiercheckCallback in Trainer(callbacks=[...]): "
                "without it the RNG states are not saved and resumes are not exact"
            )
        if "optimizer_states" not in checkpoint:
            raise ConfigError(
                "weights-only checkpoints cannot be resumed from and are not stored in tiercheck; "
                "save them with Lightning's default CheckpointIO (or export a version later)"
            )
        sharded = [
            type(opt).__name__
            for opt in trainer.optimizers
            if hasattr(getattr(opt, "_optimizer", opt), "consolidate_state_dict")
        ]
        if sharded:
            raise ConfigError(
                f"{_COVERED}, with optimizers whose state each rank holds whole; "
                f"{', '.join(sharded)} shards its state across ranks"
            )
        version = checkpoint["global_step"]
        named = parse_name(path)
        if named in ("latest", "resume"):
            raise ConfigError(f"{path!r} names what to load; save under 'tiercheck:<step>'")
        if named is not None and named != version:
            raise ConfigError(
                f"{path!r} names version {named}, but the trainer is at step {version}"
            )
        if self._session.save(version, lambda: checkpoint) is None:
            logger.debug("tiercheck: step %s is stored already; %s points to it", version, path)
        # One pointer per checkpoint, as Lightning writes one file: global rank zero's.
        if named is None and trainer.is_global_zero:
            self._write_pointer(path, version)
        if trainer.state.status != TrainerStatus.RUNNING:
            # No teardown will follow to finish this save: finish it now.
            self._session.close()

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore the version ``path`` names (see the module docstring) and return it.

        Collective under DDP: Lightning loads on every rank, and every rank restores the same
        version (pointer files are read by every rank). For :data:`RESUME` with nothing
        restorable it returns an empty checkpoint, which Lightning loads as nothing at all.

        Tensors come back on the CPU, whatever ``map_location`` says: Lightning copies them into
        the model's and optimizers' own tensors on their devices. ``weights_only`` needs no
        enforcing: tiercheck checkpoints hold no pickled objects unless the checkpointer was
        built with ``allow_pickle=True``.
        """
        target: Target | None = parse_name(path)
        if target is None:
            target = self._read_pointer(path)
            if target is None:
                loaded: dict[str, Any] = TorchCheckpointIO().load_checkpoint(
                    path, map_location=map_location, weights_only=weights_only
                )
                return loaded
        restored = self._restore(target)
        if restored is None and target == "resume":
            logger.info("tiercheck: job %r has nothing to resume; starting fresh", self.job_id)
            return _nothing_to_resume()
        if restored is None:
            raise RestoreError(
                f"job {self.job_id!r} has no restorable version for {path!r}; for a script that "
                "also starts fresh, pass ckpt_path=io.resume_path() (None when there is nothing)"
            )
        state = restored.state
        if not isinstance(state, dict) or "state_dict" not in state:
            raise FormatError(
                f"version {restored.version} of job {self.job_id!r} is not a Lightning checkpoint"
            )
        # The weights and optimizer states (nearly all the bytes) go to load_state_dict calls,
        # which handle views; the rest (loops, callbacks, loaders...) reaches code that may not.
        return {key: value if key in _BULK else own_copy(value) for key, value in state.items()}

    def remove_checkpoint(self, path: _PATH) -> None:
        """Delete the pointer file at ``path``; the version itself is left to tiercheck retention.

        Nothing of an in-flight save is touched, so removal never races one.
        """
        if parse_name(path) is not None:
            return
        fs, fspath = fsspec.core.url_to_fs(str(path))
        if fs.exists(fspath):
            fs.rm(fspath)
        logger.debug("tiercheck: removed %s; its version stays until retention evicts it", path)

    def teardown(self) -> None:
        """Finish every save in flight (every tier) and close the checkpointer."""
        self._session.close()

    # --- internals --------------------------------------------------------------------------

    def _link(self, trainer: pl.Trainer) -> None:
        self._trainer = weakref.ref(trainer)

    def _linked_trainer(self) -> pl.Trainer | None:
        return None if self._trainer is None else self._trainer()

    def _restore(self, target: Target) -> Restored | None:
        return self._session.restore(target)

    def _write_pointer(self, path: _PATH, version: int) -> None:
        data = json.dumps(
            {"format": POINTER_FORMAT, "job_id": self.job_id, "version": version}
        ).encode()
        fs, fspath = fsspec.core.url_to_fs(str(path))
        if isinstance(fs, LocalFileSystem):
            atomic_write_file(fspath, data)
        else:
            # Object stores publish a single put whole.
            fs.makedirs(fs._parent(fspath), exist_ok=True)
            fs.pipe_file(fspath, data)

    def _read_pointer(self, path: _PATH) -> int | None:
        """The version the pointer at ``path`` names; ``None`` if the file is not a pointer."""
        fs, fspath = fsspec.core.url_to_fs(str(path))
        if not fs.exists(fspath):
            raise FileNotFoundError(f"no checkpoint at {path!r}")
        if fs.size(fspath) > _POINTER_MAX_BYTES:
            return None
        try:
            pointer = json.loads(fs.cat_file(fspath))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not isinstance(pointer, dict) or pointer.get("format") != POINTER_FORMAT:
            return None
        if pointer.get("job_id") != self.job_id:
            raise ConfigError(
                f"{path!r} points into job {pointer.get('job_id')!r}; this plugin is for job "
                f"{self.job_id!r}"
            )
        version = pointer.get("version")
        if (
            isinstance(version, bool)
            or not isinstance(version, int)
            or not 0 <= version <= MAX_VERSION
        ):
            raise FormatError(f"pointer {path!r} names no valid version: {version!r}")
        return version


class TiercheckCallback(pl.Callback):
    """The callback that makes :class:`TiercheckCheckpointIO` resumes exact.

    * At ``setup`` it finds the plugin in the trainer's strategy and links the two (the plugin
      needs the trainer to tell a resume from an evaluation load); it refuses strategies the
      plugin does not cover, and makes a DDP or ``ModelParallelStrategy`` strategy hand
      checkpoints to the plugin on every rank (see the module docstring).
    * Its checkpoint state is the global RNG states (Python, numpy, torch, CUDA) of the rank,
      taken when each checkpoint is written; after a resume they are set again at
      ``on_train_start``, after the sanity check and just before the first training batch.
    * With ``every_n_train_steps=N`` it saves every N optimizer steps as ``tiercheck:<step>``
      (no file written; the save returns after the copy to host memory).

    Args:
        every_n_train_steps: save every this many optimizer steps (``None``: leave saving to
            ``ModelCheckpoint`` or explicit ``trainer.save_checkpoint`` calls).
    """

    def __init__(self, every_n_train_steps: int | None = None) -> None:
        super().__init__()
        if every_n_train_steps is not None and (
            isinstance(every_n_train_steps, bool)
            or not isinstance(every_n_train_steps, int)
            or every_n_train_steps < 1
        ):
            raise ConfigError(
                f"every_n_train_steps must be a positive int or None, got {every_n_train_steps!r}"
            )
        self.every_n_train_steps = every_n_train_steps
        self._last_saved_step: int | None = None
        self._pending_rng: dict[str, Any] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Link the trainer to its :class:`TiercheckCheckpointIO`; refuse what is not covered;
        under DDP and ``ModelParallelStrategy``, make every rank save (and, for the latter,
        load and close) through it."""
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, TiercheckCheckpointIO):
            raise ConfigError(
                "TiercheckCallback needs Trainer(plugins=[TiercheckCheckpointIO(...)]) and no "
                f"wrapper around it; the strategy's CheckpointIO is {type(io).__name__}"
            )
        strategy = trainer.strategy
        if isinstance(strategy, SingleDeviceStrategy) and trainer.world_size == 1:
            pass
        elif isinstance(strategy, DDPStrategy):
            _check_ddp(strategy)
            _save_on_every_rank(strategy)
        elif isinstance(strategy, ModelParallelStrategy):
            _check_model_parallel(strategy)
            _save_on_every_rank(strategy)
            _load_on_every_rank(strategy)
            _close_at_teardown(strategy)
        else:
            raise ConfigError(
                f"{_COVERED}; got {type(strategy).__name__} with world_size={trainer.world_size}"
                + (
                    ", which writes its own sharded checkpoints"
                    if _overridden_hooks(strategy, Strategy)
                    else ""
                )
            )
        io._link(trainer)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Save ``tiercheck:<step>`` when the optimizer step count reaches a multiple of N."""
        n = self.every_n_train_steps
        step = trainer.global_step
        # Under gradient accumulation several batches end on one step: save it once.
        if n is None or step == 0 or step % n or step == self._last_saved_step:
            return
        self._last_saved_step = step
        trainer.save_checkpoint(version_name(step))

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Training failed: the teardown that follows closes without waiting for other ranks."""
        io = trainer.strategy.checkpoint_io
        if isinstance(io, TiercheckCheckpointIO):
            io._session.failed = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a resume, set the RNG states saved with the checkpoint."""
        if self._pending_rng is not None:
            restore_rng(self._pending_rng)
            self._pending_rng = None

    def state_dict(self) -> dict[str, Any]:
        """The global RNG states, taken now (Lightning calls this while writing a checkpoint)."""
        return {"rng": capture_rng()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the RNG states of a loaded checkpoint for ``on_train_start``."""
        self._pending_rng = state_dict.get("rng")

"""torchtitan integration: a checkpoint manager that saves and resumes a torchtitan job through
tiercheck.

Select it from a config function (as torchtitan's own torchft experiment selects its manager)::

    from tiercheck.integrations.torchtitan import TiercheckCheckpointManager

    def my_config() -> Trainer.Config:
        config = ...  # the job's Trainer.Config
        config.checkpoint = TiercheckCheckpointManager.Config(
            enable=True, job_id="llama3-8b-run-1", persistent="s3://bucket/ckpt", interval=50
        )
        return config

then launch as usual (``torchrun ... -m torchtitan.train --module my_module --config
my_config``); every field is also a command-line option (``--checkpoint.interval 10``).

Each save stores one tiercheck version, numbered by the step, holding what torchtitan's own
manager saves: the model parts (``ModelWrapper``), the optimizers, the LR schedulers, the
dataloader and the train state (step, tokens seen). It lands in the node's shared memory first,
then in the peer and durable tiers in the background. ``load()`` restores the newest version
every rank can rebuild, from the fastest tier that holds it (``load_step``: exactly that one);
nothing stored yet is a fresh start, as with torchtitan's manager.

torchtitan's options, as this manager reads them:

* ``interval``, ``enable_first_step_checkpoint``: when to save (the last step always saves);
  ``load_only``: never save;
* ``keep_latest_k``: the versions each tier keeps (``0``: keep all); left at torchtitan's
  default (10), tiercheck's per-tier defaults apply; tiercheck's ``keep`` wins over both;
* ``load_step``, ``exclude_from_loading``: which version, and which parts of the state are left
  as they are (the rest is restored, ``strict=False``);
* ``last_save_model_only``, ``export_dtype``: the last save stays a whole version (so the run
  can resume from it); a model-only copy is an export (``tiercheck export URL OUT --format dcp
  --dtype bf16``, or ``--format hf``);
* ``folder`` is not used: where versions go is ``persistent`` (an fsspec URL; default
  ``{dump_folder}/{folder}`` as a local path) and ``local_root``;
* ``initial_load_path``, ``initial_load_in_hf``, ``last_save_in_hf``,
  ``create_seed_checkpoint``: not covered; set, they are a
  :class:`~tiercheck.errors.ConfigError` when the manager is built.

tiercheck's own options: ``job_id`` (required), ``persistent``, ``local_root``,
``storage_options``, ``base_every`` and ``keep`` (unset: tiercheck's defaults), ``overlap``
(the save returns before the snapshot is copied; the trainer's ``maybe_wait_for_staging()``,
called right before every ``optimizers.step()``, is the fence) and ``elastic`` (a job saved
on another number of ranks is resharded in place on this one; see
:meth:`tiercheck.Checkpointer.restore`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

from tiercheck.errors import ConfigError
from tiercheck.integrations._common import Session

try:
    from torchtitan.components.checkpointer.base import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )
except ImportError as exc:  # pragma: no cover - exercised only without torchtitan
    raise ImportError(
        "tiercheck.integrations.torchtitan needs torchtitan (PyPI torchtitan 0.3.0); see "
        "docs/integrations.md for an install that keeps your torch build"
    ) from exc

__all__ = ["TiercheckCheckpointManager"]

logger = logging.getLogger("tiercheck")

#: torchtitan's default keep_latest_k: left as it is, tiercheck's per-tier defaults apply.
_TORCHTITAN_KEEP_DEFAULT = 10


class TiercheckCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]
    """A torchtitan checkpoint manager whose versions live in tiercheck's tiers (see the
    module docstring for the options and what they mean).

    Built by the trainer from :class:`Config` (``config.checkpoint.build(...)``) with its
    model parts, optimizers, LR schedulers, dataloader and ``states`` (the train state).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint options plus tiercheck's (see the module docstring)."""

        job_id: str = ""
        persistent: str | None = None
        local_root: str | None = None
        storage_options: dict[str, str] = dataclasses.field(default_factory=dict)
        base_every: int | None = None
        keep: int | None = None
        overlap: bool = True
        elastic: bool = False
        # The per-step saves must see the optimizer's own state: never the model only.
        last_save_model_only: bool = False

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[Any],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = bool(config.enable)
        self.save_future = None
        self._session: Session | None = None
        if not self.enable:
            return
        unsupported = [
            name
            for name in (
                "initial_load_path",
                "initial_load_in_hf",
                "last_save_in_hf",
                "create_seed_checkpoint",
            )
            if getattr(config, name)
        ]
        if unsupported:
            raise ConfigError(
                f"TiercheckCheckpointManager does not cover checkpoint.{unsupported[0]}: "
                "start from a seed checkpoint with torchtitan's own manager, and export a "
                "model-only or Hugging Face copy with `tiercheck export URL OUT --format dcp` "
                "or `--format hf`"
            )
        if not config.job_id:
            raise ConfigError(
                "TiercheckCheckpointManager needs checkpoint.job_id: the name everything the "
                "job stores sits under (set it in the config or as --checkpoint.job-id)"
            )
        self.config = config
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        persistent = config.persistent or os.path.abspath(os.path.join(base_folder, config.folder))
        options: dict[str, Any] = {
            "persistent": persistent,
            "overlap": config.overlap,
            "elastic": config.elastic,
        }
        if config.base_every is not None:
            options["base_every"] = config.base_every
        if config.local_root:
            options["local_root"] = config.local_root
        if config.storage_options:
            options["storage_options"] = dict(config.storage_options)
        if config.keep is not None:
            options["keep"] = config.keep
        elif config.keep_latest_k != _TORCHTITAN_KEEP_DEFAULT:
            # 0 is torchtitan's "keep all": as many as tiercheck's counters can say.
            options["keep"] = config.keep_latest_k or 2**31 - 1
        self._session = Session(config.job_id, options)

    @property
    def session(self) -> Session:
        """The job's checkpointer as this manager drives it (opened on first use)."""
        if self._session is None:
            raise ConfigError("the checkpoint manager is not enabled")
        return self._session

    def _should_save(self, step: int, last_step: bool) -> bool:
        config = self.config
        if config.load_only:
            return False
        if step == 1 and config.enable_first_step_checkpoint:
            return True
        return bool(last_step) or (config.interval > 0 and step % config.interval == 0)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.session.save(curr_step, lambda: self.states)
        return True

    def _maybe_wait_for_staging(self) -> None:
        # Called right before optimizers.step(): the overlapped copy must be done by then.
        if self._session is not None and self._session.last_save is not None:
            self._session.checkpointer.fence()

    def _wait_for_saving(self) -> None:
        # save_future is never set: tiercheck's saves are waited for by wait() and close().
        self.save_future = None

    def _load(self, step: int = -1) -> bool:
        excluded = set(self.config.exclude_from_loading)
        target = {key: value for key, value in self.states.items() if key not in excluded}
        restored = self.session.restore("latest" if step < 0 else step, target, strict=not excluded)
        if restored is None:
            logger.info("tiercheck: job %r holds no version yet; a fresh start", self.config.job_id)
            return False
        logger.info(
            "tiercheck: restored step %s of job %r from the %r tier",
            restored.version,
            self.config.job_id,
            restored.source_tier,
        )
        return True

    def wait(self) -> dict[str, int | None]:
        """Block until every save so far is committed or failed in each of its tiers; the
        newest version committed in each tier by then."""
        return self.session.checkpointer.wait()

    def _close(self) -> None:
        session = self._session
        if session is None:
            return
        # torchtitan's train() closes the trainer from its exception handler too: a close
        # while an exception is being handled is the bounded close of a failing rank.
        session.close(failed=sys.exc_info()[0] is not None)

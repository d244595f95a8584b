"""Hugging Face integration: save and resume a ``transformers.Trainer`` through tiercheck.

::

    trainer = TiercheckTrainer(
        model=model, args=args, train_dataset=train,
        tiercheck_job="gpt2-run-1",
        tiercheck_options={"persistent": "s3://bucket/ckpt"},
    )
    trainer.train(resume_from_checkpoint=True)   # newest whole version; a fresh start if none

:class:`TiercheckTrainer` (or :class:`TiercheckTrainerMixin` in front of another ``Trainer``
subclass) replaces the writer behind ``save_steps``/``save_strategy``: each save stores one
tiercheck version, numbered by ``state.global_step``, holding the model's ``state_dict``, the
optimizer, the LR scheduler, the gradient scaler, the RNG states (Python, numpy, torch, CUDA) and
the ``TrainerState``. No ``checkpoint-<step>`` folder is written; the save returns once the state
is copied to host memory and the tiers are written in the background.

``resume_from_checkpoint`` values:

* ``True``, ``"tiercheck:latest"`` or ``"tiercheck:resume"`` -- the newest version every rank
  can rebuild, from the fastest tier holding it; versions torn by a crash or corrupt on every
  tier are never chosen. Unlike stock ``Trainer``, a job with nothing restorable starts fresh
  (logged), so one script serves the first launch and every restart.
* ``"tiercheck:<step>"`` or a path ending in ``checkpoint-<step>`` (the folder need not exist)
  -- exactly version ``<step>``; newer versions are dropped, as the run continues from there.
* a real checkpoint folder written by stock ``Trainer`` (it holds ``trainer_state.json``) --
  loaded the stock way, so a run can move over to tiercheck.

The rest of ``TrainingArguments`` keeps its meaning: ``save_steps`` and ``save_strategy`` decide
when to save; ``save_total_limit`` becomes the number of versions each tier keeps (unless
``tiercheck_options`` sets ``keep``); ``ignore_data_skip=False`` (the default) replays the data
order exactly, so a resumed run ends bit-identical to an uninterrupted one.

Several processes (``torchrun`` or ``accelerate launch``, DDP): ``Trainer`` calls
``_save_checkpoint`` on every rank, and so every rank stores its own part of each version: its
RNG states and its copy of the replicated model, optimizer and scheduler (stock ``Trainer``
writes the weights and optimizer from the main process only, the RNG file per process). A save
and a restore are collective; ``accelerate`` has initialized the process group by the time the
``Trainer`` exists, so the checkpointer opens with every rank, and ``resume_from_checkpoint``
resolves to one version that every rank restores (each rank reads its own copy, from the
fastest tier holding it). The data order is replayed by ``Trainer`` itself (its seeded sampler,
sharded per rank, and the batches of the resumed epoch skipped).

Covered: one process on one device (or several GPUs through ``DataParallel``), and DDP over
several processes on CPUs (gloo) or CUDA GPUs. Not covered (refused with
:class:`~tiercheck.errors.ConfigError`): DeepSpeed, FSDP (``TrainingArguments.fsdp`` is refused
even on CPUs, where accelerate 1.x ignores it and trains with DDP: its ``AcceleratorState``
turns the FSDP plugin on only for GPU-like backends), tensor/context parallelism
(``parallelism_config``), other accelerate backends (XLA/TPU, Megatron-LM, SageMaker model
parallel, other accelerators' DDP), ``load_best_model_at_end``, ``save_only_model``,
hyperparameter search. Checkpoints are not pushed to the Hub (``trainer.push_to_hub()`` after
training still works).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

from tiercheck.catalog.hf import MODEL_CONFIG_KEY
from tiercheck.checkpointer import Restored, SaveHandle
from tiercheck.consistency.keys import MAX_VERSION
from tiercheck.errors import ConfigError, FormatError
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
from tiercheck.sync import SyncCheckpointer

try:
    import transformers
    from transformers.trainer_callback import ExportableState
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "tiercheck.integrations.hf needs transformers and accelerate: pip install 'tiercheck[hf]'"
    ) from exc

__all__ = ["LATEST", "RESUME", "TiercheckTrainer", "TiercheckTrainerMixin", "version_name"]

logger = logging.getLogger("tiercheck")

# The file stock Trainer.train reads the TrainerState from on resume.
_TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT_DIR = re.compile(r"checkpoint-([0-9]+)")  # whole name, ASCII digits
_NO_HP_SEARCH = "tiercheck's Trainer integration does not cover hyperparameter search"
_STATE_KEYS = ("model", "optimizer", "scheduler", "scaler", "rng", "trainer_state")
# accelerate's DistributedType values for one process (NO) and plain DDP on CPUs or CUDA GPUs.
_COVERED_BACKENDS = frozenset({"NO", "MULTI_CPU", "MULTI_GPU"})
# TrainingArguments.parallel_mode values: one device, DataParallel in one process, DDP.
_COVERED_MODES = frozenset({"not_parallel", "not_distributed", "distributed"})


def _config_json(model: Any) -> str | None:
    """The model's config as ``save_pretrained`` writes ``config.json``; ``None`` for a model
    without one (a plain ``torch.nn.Module``)."""
    to_json = getattr(getattr(model, "config", None), "to_json_string", None)
    text = to_json() if callable(to_json) else None
    return text if isinstance(text, str) else None


def _launched_world() -> int:
    """The number of processes the launcher started (torchrun's ``WORLD_SIZE``; 1 without)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


class TiercheckTrainerMixin:
    """Routes a ``transformers.Trainer``'s checkpoints through tiercheck.

    Put it first among the bases of a ``Trainer`` subclass (``class T(TiercheckTrainerMixin,
    SFTTrainer)``) or use :class:`TiercheckTrainer`. It overrides ``train`` (to resolve
    ``resume_from_checkpoint``), ``_save_checkpoint`` and the ``_load_*`` hooks of resuming;
    see the module docstring for the values it accepts and what it covers.

    Args:
        tiercheck_job: the tiercheck job (names everything stored).
        tiercheck_options: any other :class:`~tiercheck.SyncCheckpointer` argument
            (``persistent``, ``local_root``, ``keep``, ``base_every``...).
        *args, **kwargs: passed on to the ``Trainer``.
    """

    # Attributes of the Trainer this mixin reads (annotated for the type checker).
    args: Any
    state: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any
    control: Any
    callback_handler: Any
    hp_search_backend: Any
    is_deepspeed_enabled: bool
    is_fsdp_enabled: bool

    def __init__(
        self,
        *args: Any,
        tiercheck_job: str,
        tiercheck_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        parent: Any = super()
        parent.__init__(*args, **kwargs)
        self._check_covered()
        options = dict(tiercheck_options or {})
        if self.args.save_total_limit is not None and "keep" not in options:
            options["keep"] = self.args.save_total_limit
        self._tiercheck = Session(tiercheck_job, options)
        self._tiercheck_state: dict[str, Any] | None = None

    def _check_covered(self) -> None:
        args = self.args
        kind = getattr(self.accelerator, "distributed_type", "NO")
        backend = str(getattr(kind, "value", kind))
        mode = str(getattr(args.parallel_mode, "value", args.parallel_mode))
        refused = {
            "DeepSpeed": self.is_deepspeed_enabled,
            # Asked for, not only enabled: on CPUs accelerate ignores the FSDP plugin and trains
            # with plain DDP, so a script tried on CPUs would be refused only on GPUs.
            "FSDP (TrainingArguments.fsdp or accelerate's FSDP plugin)": self.is_fsdp_enabled
            or bool(getattr(args, "fsdp", None)),
            "tensor or context parallelism (parallelism_config)": (
                getattr(self.accelerator, "parallelism_config", None) is not None
            ),
            f"accelerate's {backend} backend": not self.is_deepspeed_enabled
            and not self.is_fsdp_enabled
            and backend not in _COVERED_BACKENDS,
            f"parallel mode {mode!r}": mode not in _COVERED_MODES,
            "load_best_model_at_end": args.load_best_model_at_end,
            "save_only_model": args.save_only_model,
        }
        launched = _launched_world()
        if launched > 1 and int(getattr(args, "world_size", 1)) == 1:
            # Under torchrun on CPUs without use_cpu=True the Trainer runs each process alone
            # (NOT_PARALLEL): every process would train and save as if it were the only one.
            raise ConfigError(
                f"the launcher started {launched} processes (WORLD_SIZE), but the Trainer runs "
                "each one alone (TrainingArguments.parallel_mode is "
                f"{mode!r}), so they would not train together; on CPUs pass "
                "TrainingArguments(use_cpu=True) for DDP over the processes"
            )
        bad = [name for name, on in refused.items() if on]
        if bad:
            raise ConfigError(
                f"tiercheck's Trainer integration does not cover {', '.join(bad)}; it covers one "
                "process, and DDP over several processes on CPUs or CUDA GPUs (torchrun)"
            )

    # --- public extras ----------------------------------------------------------------------

    @property
    def tiercheck_checkpointer(self) -> SyncCheckpointer:
        """The underlying checkpointer (opened on first use, closed at the end of ``train``;
        under DDP opening is collective, so touch it on every rank)."""
        return self._tiercheck.checkpointer

    @property
    def tiercheck_last_save(self) -> SaveHandle | None:
        """The handle of the newest save: ``.result("persistent")`` waits until it is durable."""
        return self._tiercheck.last_save

    @property
    def tiercheck_restored(self) -> Restored | None:
        """What the newest resume restored (version, source tier...), ``None`` before one."""
        return self._tiercheck.restored

    # --- training ---------------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | os.PathLike[str] | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``, resuming through tiercheck (see the module docstring for values).

        The checkpointer is closed when training ends, after every save in flight has been
        written to every tier.
        """
        if trial is not None:
            raise ConfigError(
                "tiercheck's Trainer integration does not cover hyperparameter search"
            )
        parent: Any = super()
        try:
            target = _resolve(resume_from_checkpoint)
            if isinstance(target, _StockFolder):
                return parent.train(
                    resume_from_checkpoint=target.path,
                    ignore_keys_for_eval=ignore_keys_for_eval,
                    **kwargs,
                )
            restored = None if target is None else self._tiercheck.restore(target)
            if restored is None:
                if target is not None:
                    logger.info(
                        "tiercheck: job %r has nothing to resume; starting fresh",
                        self._tiercheck.job_id,
                    )
                return parent.train(ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            state = restored.state
            if not isinstance(state, dict) or set(state) - {MODEL_CONFIG_KEY} != set(_STATE_KEYS):
                raise FormatError(
                    f"version {restored.version} of job {self._tiercheck.job_id!r} was not "
                    "saved by the Trainer integration"
                )
            with tempfile.TemporaryDirectory(prefix="tiercheck-resume-") as folder:
                # Trainer.train reads the TrainerState from this file; everything else comes
                # through the _load_* hooks below, from the restored state.
                with open(os.path.join(folder, _TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                    f.write(state["trainer_state"])
                self._tiercheck_state = state
                return parent.train(
                    resume_from_checkpoint=folder,
                    ignore_keys_for_eval=ignore_keys_for_eval,
                    **kwargs,
                )
        except BaseException:
            # Leaving on an error: the other ranks may be failing too; wait for no one.
            self._tiercheck.failed = True
            raise
        finally:
            self._tiercheck_state = None
            self._tiercheck.close()

    # --- saving -----------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        """Store the training state as version ``state.global_step`` (replaces the folder)."""
        if trial is not None or self.hp_search_backend is not None:
            raise ConfigError(
                "tiercheck's Trainer integration does not cover hyperparameter search"
            )
        parent: Any = super()
        parent.store_flos()  # as stock _save_checkpoint does: the FLOs count is in the state
        self._tiercheck.save(self.state.global_step, self._training_state)

    def _training_state(self) -> dict[str, Any]:
        # As stock _save_checkpoint does: bring the stateful callbacks' state up to date.
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, ExportableState):
                name = cb.__class__.__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
        scaler = getattr(self.accelerator, "scaler", None)
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.lr_scheduler.state_dict(),
            "scaler": None if scaler is None else scaler.state_dict(),
            "rng": capture_rng(),
            # The TrainerState as the JSON text Trainer writes to trainer_state.json.
            "trainer_state": json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True)
            + "\n",
            # The model's config.json, for `tiercheck export --format hf` (a version saved
            # before it was kept has none; resuming does not need it).
            MODEL_CONFIG_KEY: _config_json(self.model),
        }

    # --- resuming (called by Trainer.train with the folder made above) ----------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        state = self._tiercheck_state
        if state is None:
            parent: Any = super()
            parent._load_from_checkpoint(resume_from_checkpoint, model)
            return
        (self.model if model is None else model).load_state_dict(state["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        state = self._tiercheck_state
        if state is None:
            parent: Any = super()
            parent._load_optimizer_and_scheduler(checkpoint)
            return
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        state = self._tiercheck_state
        if state is None:
            parent: Any = super()
            parent._load_scaler(checkpoint)
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and state["scaler"] is not None:
            scaler.load_state_dict(state["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        state = self._tiercheck_state
        if state is None:
            parent: Any = super()
            parent._load_rng_state(checkpoint)
            return
        restore_rng(state["rng"])


class TiercheckTrainer(TiercheckTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with checkpoints in tiercheck; see :class:`TiercheckTrainerMixin`.

    Args:
        tiercheck_job: the tiercheck job (names everything stored).
        tiercheck_options: any other :class:`~tiercheck.SyncCheckpointer` argument.
        *args, **kwargs: ``Trainer`` arguments (``model``, ``args``, ``train_dataset``...).
    """


@dataclasses.dataclass(frozen=True)
class _StockFolder:
    """A checkpoint folder written by stock ``Trainer``."""

    path: str


def _resolve(value: str | os.PathLike[str] | bool | None) -> Target | _StockFolder | None:
    """What ``resume_from_checkpoint`` asks for: a version, ``"latest"``, a stock folder, or
    ``None`` (no resume)."""
    if value is None or value is False:
        return None
    if value is True:
        return "latest"
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"resume_from_checkpoint must be a bool or a path, got {value!r}")
    path = os.fspath(value)
    named = parse_name(path)
    if named is not None:
        return named
    if os.path.isfile(os.path.join(path, _TRAINER_STATE_NAME)):
        return _StockFolder(path)
    match = _CHECKPOINT_DIR.fullmatch(os.path.basename(os.path.normpath(path)))
    if match is None or int(match.group(1)) > MAX_VERSION:
        raise ConfigError(
            f"resume_from_checkpoint={path!r} names no version: use True, {LATEST!r}, "
            "'tiercheck:<step>' or a path ending in 'checkpoint-<step>'"
        )
    return int(match.group(1))

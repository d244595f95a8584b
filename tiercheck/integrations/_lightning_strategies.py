"""How :mod:`tiercheck.integrations.lightning` makes Lightning's strategies checkpoint on every
rank: the checks of what a strategy may override, and the patches of one trainer's strategy
object (save and load through the plugin on every rank; FSDP2 shards put back on their
parameters' meshes; the plugin closed at teardown). Private to the integration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tiercheck.codec.format.dtensor import is_dtensor, place_like
from tiercheck.errors import ConfigError, StateMismatch

try:
    import lightning
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "tiercheck.integrations.lightning needs Lightning: pip install 'tiercheck[lightning]'"
    ) from exc

if TYPE_CHECKING:
    from lightning.fabric.utilities.types import _PATH


# The strategy methods through which checkpoints are made, written and read. A strategy class
# that overrides any of them (FSDP, DeepSpeed, XLA...) writes its own kind of checkpoint.
_CHECKPOINT_HOOKS = (
    "save_checkpoint",
    "load_checkpoint",
    "remove_checkpoint",
    "lightning_module_state_dict",
    "optimizer_state",
    "load_model_state_dict",
    "load_optimizer_state_dict",
)
_COVERED = (
    "tiercheck's Lightning integration covers SingleDeviceStrategy (one process), "
    "DDPStrategy (strategy='ddp', started by torchrun or by Lightning) and ModelParallelStrategy "
    "(FSDP2 via fully_shard in configure_model, each rank storing its own shards)"
)


def _overridden_hooks(strategy: Strategy, base: type) -> list[str]:
    """The checkpoint hooks that ``strategy``'s class implements differently from ``base``."""
    cls = type(strategy)
    return [name for name in _CHECKPOINT_HOOKS if getattr(cls, name) is not getattr(base, name)]


def _check_ddp(strategy: DDPStrategy) -> None:
    """Refuse DDP variants whose checkpoints or processes the integration does not cover."""
    overridden = _overridden_hooks(strategy, DDPStrategy)
    if overridden:
        raise ConfigError(
            f"{_COVERED}; {type(strategy).__name__} makes or reads checkpoints its own way "
            f"({', '.join(overridden)})"
        )
    start = getattr(strategy, "_start_method", "popen")
    if start != "popen":
        # There fit trains in processes forked or spawned by the one that called it, and what
        # they restore and save never reaches that one; neither path is tested, so refused.
        raise ConfigError(
            f"{_COVERED}; DDP started by {start!r} (ddp_spawn, ddp_fork, ddp_notebook) is not "
            "covered: use strategy='ddp' and launch with torchrun, or let Lightning start the "
            "processes"
        )


def _check_model_parallel(strategy: ModelParallelStrategy) -> None:
    """Refuse ``ModelParallelStrategy`` set-ups whose checkpoints the integration does not cover."""
    overridden = _overridden_hooks(strategy, ModelParallelStrategy)
    if overridden:
        raise ConfigError(
            f"{_COVERED}; {type(strategy).__name__} makes or reads checkpoints its own way "
            f"({', '.join(overridden)})"
        )
    if not getattr(strategy, "_save_distributed_checkpoint", True):
        # Then the model and optimizer states are gathered whole on rank zero and the other
        # ranks hand over empty ones: nothing a rank could restore its own shards from.
        raise ConfigError(
            f"{_COVERED}; ModelParallelStrategy(save_distributed_checkpoint=False) gathers the "
            "whole state on rank zero: leave it True (the default), each rank stores its shards"
        )


def _save_on_every_rank(strategy: DDPStrategy | ModelParallelStrategy) -> None:
    """Make ``strategy`` hand each checkpoint to its ``CheckpointIO`` on every rank.

    ``Strategy.save_checkpoint`` calls the ``CheckpointIO`` on global rank zero only (the other
    ranks hold the same replicated state), and ``ModelParallelStrategy.save_checkpoint`` writes
    a ``torch.distributed.checkpoint`` folder instead of calling it; a tiercheck save is
    collective and each rank stores its own part (under ``ModelParallelStrategy`` the
    checkpoint's ``state_dict`` and ``optimizer_states`` hold this rank's shards, as DTensors).
    ``trainer.save_checkpoint`` already runs on every rank and ends with a barrier.
    """
    if "save_checkpoint" in vars(strategy):
        return  # done at an earlier setup of this trainer

    def save_checkpoint(
        checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        strategy.checkpoint_io.save_checkpoint(
            checkpoint, filepath, storage_options=storage_options
        )

    # On the instance: this strategy object belongs to the trainer being set up.
    vars(strategy)["save_checkpoint"] = save_checkpoint


def _load_on_every_rank(strategy: ModelParallelStrategy) -> None:
    """Make ``strategy`` load checkpoints through its ``CheckpointIO`` and fill its shards.

    ``ModelParallelStrategy.load_checkpoint`` reads a ``torch.distributed.checkpoint`` folder
    and loads the model and optimizers itself (its ``load_model_state_dict`` and
    ``load_optimizer_state_dict`` do nothing). In its place every rank restores the version
    through the plugin, then puts the restored shards into the model and each optimizer with
    ``set_model_state_dict`` / ``set_optimizer_state_dict`` -- an optimizer that has not stepped
    yet is initialized by them -- and returns the rest of the checkpoint to Lightning.
    """
    if "load_checkpoint" in vars(strategy):
        return  # done at an earlier setup of this trainer

    def load_checkpoint(checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = strategy.checkpoint_io.load_checkpoint(
            checkpoint_path, weights_only=weights_only
        )
        if not checkpoint:
            return checkpoint  # nothing to resume: Lightning restores nothing
        module = strategy.lightning_module
        assert module is not None
        _fill_model_parallel(
            module,
            [getattr(opt, "_optimizer", opt) for opt in strategy.optimizers],
            checkpoint.pop("state_dict"),
            checkpoint.pop("optimizer_states", []),
            strict=module.strict_loading,
        )
        return checkpoint

    vars(strategy)["load_checkpoint"] = load_checkpoint


def _close_at_teardown(strategy: ModelParallelStrategy) -> None:
    """Make ``strategy``'s teardown finish the saves in flight and close the checkpointer.

    ``Strategy.teardown`` tears its ``CheckpointIO`` down; ``ModelParallelStrategy.teardown``
    does not call it, and saves still in flight at the end of ``fit`` would never complete.
    """
    if "teardown" in vars(strategy):
        return  # done at an earlier setup of this trainer
    own_teardown = strategy.teardown

    def teardown() -> None:
        try:
            own_teardown()
        finally:
            strategy.checkpoint_io.teardown()

    vars(strategy)["teardown"] = teardown


def _fill_model_parallel(
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    model_state: dict[str, Any],
    optimizer_states: list[Any],
    *,
    strict: bool,
) -> None:
    """Load restored model and optimizer states (this rank's shards) into a sharded module.

    A restore without a target gives each sharded tensor as a DTensor on a mesh rebuilt from the
    default group, or as its local shard: each is put back on its parameter's own mesh and
    placements first, after checking that it fits them (see :func:`_placed`).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if len(optimizer_states) != len(optimizers):
        raise StateMismatch(
            f"the checkpoint holds {len(optimizer_states)} optimizer state(s); the model has "
            f"{len(optimizers)} optimizer(s)"
        )
    live = get_model_state_dict(module)
    model_state = {
        name: _placed(live[name], value, name) if name in live else value
        for name, value in model_state.items()
    }
    set_model_state_dict(module, model_state, options=StateDictOptions(strict=strict))
    params = dict(module.named_parameters())
    for opt, state in zip(optimizers, optimizer_states, strict=True):
        per_param = state.get("state") if isinstance(state, dict) else None
        if isinstance(per_param, dict):
            for name, entry in per_param.items():
                param = params.get(name)
                if param is not None and isinstance(entry, dict):
                    for key, value in list(entry.items()):
                        entry[key] = _placed(param, value, f"{name}.{key}")
        set_optimizer_state_dict(module, opt, state)


def _placed(target: Any, value: Any, where: str) -> Any:
    """``value`` (restored) laid out like the live ``target``; a restored DTensor must have the
    target's global shape and placements (:class:`~tiercheck.errors.StateMismatch` otherwise),
    a restored local shard the target's local shape."""
    if (
        is_dtensor(target)
        and is_dtensor(value)
        and value.dim() > 0
        and (value.shape != target.shape or tuple(value.placements) != tuple(target.placements))
    ):
        raise StateMismatch(
            f"the checkpoint holds {where} as a DTensor of shape {tuple(value.shape)} placed "
            f"{tuple(value.placements)}; the model's is {tuple(target.shape)} placed "
            f"{tuple(target.placements)}: resume with the sharding the checkpoint was saved with"
        )
    try:
        return place_like(target, value, where)
    except ValueError as exc:
        raise StateMismatch(
            f"{exc}: resume with the sharding the checkpoint was saved with"
        ) from exc


class _NothingToResume(dict[str, Any]):
    """An empty checkpoint: what loading :data:`RESUME` gives when nothing is restorable.

    Lightning reads one key of a loaded checkpoint unconditionally (its version, to migrate old
    checkpoints) and then restores each part only if the checkpoint is truthy: this one holds
    the version and is falsy, so nothing is restored and training starts fresh, exactly as
    with ``ckpt_path=None``. (The decision can only be made while loading: it needs every
    rank, and the ranks exist together only inside ``fit``.)
    """

    def __bool__(self) -> bool:
        return False


def _nothing_to_resume() -> dict[str, Any]:
    return _NothingToResume({"pytorch-lightning_version": lightning.__version__})

"""The Lightning plugin and callback in one process: names, pointers, retention, refusals."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import pytest
import torch

pytest.importorskip("lightning", reason="the Lightning integration needs the 'lightning' extra")

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

from tiercheck import ConfigError, RestoreError
from tiercheck.integrations.lightning import (
    LATEST,
    RESUME,
    TiercheckCallback,
    TiercheckCheckpointIO,
)

from .lightning_train import Batches, Net

pytestmark = [
    # Lightning 2.6 calls torch.utils._pytree.LeafSpec(), deprecated in recent torch; harmless.
    pytest.mark.filterwarnings(r"ignore:.*LeafSpec.*:FutureWarning"),
]


class EvalNet(Net):
    """The training script's model, with a validation step."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


class StartStep(L.Callback):
    """Records the global step when training starts."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.steps.append(trainer.global_step)


def _io(tmp_path: Path, job: str = "job") -> TiercheckCheckpointIO:
    return TiercheckCheckpointIO(
        job, local_root=tmp_path / "shm", persistent=(tmp_path / "durable").as_uri()
    )


def _trainer(max_steps: int, plugins: list[Any], callbacks: list[Any]) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=plugins,
        callbacks=callbacks,
    )


def _pointer(path: Path) -> dict[str, Any]:
    pointer = json.loads(path.read_text())
    assert isinstance(pointer, dict)
    return pointer


# The second ModelCheckpoint on the same folder warns that it is not empty: that is the point.
@pytest.mark.filterwarnings(r"ignore:Checkpoint directory .* exists and is not empty:UserWarning")
@pytest.mark.parametrize("save_last", [True, "link"])
def test_model_checkpoint_writes_pointers_and_last_resumes(tmp_path: Path, save_last: Any) -> None:
    folder = tmp_path / "ckpts"
    io = _io(tmp_path)

    def checkpoint() -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=folder,
            filename="{step}",
            every_n_train_steps=4,
            save_top_k=2,
            monitor="step",
            mode="max",
            save_last=save_last,
        )

    trainer = _trainer(12, [io], [TiercheckCallback(), checkpoint()])
    trainer.fit(Net(), train_dataloaders=Batches())
    # Top-2 rotation removed step=4's pointer through remove_checkpoint.
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step=12.ckpt", "step=8.ckpt"]
    assert _pointer(folder / "step=8.ckpt")["version"] == 8
    assert _pointer(folder / "last.ckpt") == _pointer(folder / "step=12.ckpt")
    assert (folder / "last.ckpt").is_symlink() == (save_last == "link")
    assert _pointer(folder / "last.ckpt")["job_id"] == "job"

    start = StartStep()
    again = _io(tmp_path)
    resumed = _trainer(16, [again], [TiercheckCallback(), checkpoint(), start])
    resumed.fit(Net(), train_dataloaders=Batches(), ckpt_path="last")
    assert start.steps == [12]
    assert again.restored is not None
    assert again.restored.version == 12
    assert resumed.global_step == 16


def test_evaluation_loads_any_version_and_drops_nothing(tmp_path: Path) -> None:
    io = _io(tmp_path)
    folder = tmp_path / "ckpts"
    saver = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    trainer = _trainer(12, [io], [TiercheckCallback(), saver])
    model = EvalNet()
    trainer.fit(model, train_dataloaders=Batches(), val_dataloaders=Batches())
    trainer.validate(model, dataloaders=Batches(), ckpt_path=folder / "step=8.ckpt")
    assert io.restored is not None
    assert io.restored.version == 8
    # Nothing was dropped: the newest version still loads, for evaluation and by name.
    trainer.validate(model, dataloaders=Batches(), ckpt_path=folder / "step=12.ckpt")
    trainer.validate(model, dataloaders=Batches(), ckpt_path=LATEST)
    assert io.restored is not None
    assert io.restored.version == 12


class SaveThenRemove(L.Callback):
    """At one step, saves to a path and removes it at once, while the save is in flight."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            trainer.strategy.remove_checkpoint(self.path)


def test_remove_checkpoint_leaves_an_in_flight_save_alone(tmp_path: Path) -> None:
    io = _io(tmp_path)
    path = tmp_path / "extra.ckpt"
    trainer = _trainer(5, [io], [TiercheckCallback(every_n_train_steps=2), SaveThenRemove(5, path)])
    trainer.fit(Net(), train_dataloaders=Batches())
    assert not path.exists()
    handle = io.last_save
    assert handle is not None
    assert handle.version == 5
    handle.result(timeout=0)  # fit's teardown finished it: committed in every tier
    loaded = io.load_checkpoint("tiercheck:5")
    assert loaded["global_step"] == 5
    io.teardown()


def test_a_save_after_fit_is_durable_when_it_returns(tmp_path: Path) -> None:
    io = _io(tmp_path)
    trainer = _trainer(5, [io], [TiercheckCallback(every_n_train_steps=2)])
    trainer.fit(Net(), train_dataloaders=Batches())
    trainer.save_checkpoint(tmp_path / "final.ckpt")
    handle = io.last_save
    assert handle is not None
    assert handle.version == 5
    assert handle.committed("local")
    assert handle.committed("persistent")


def test_stock_checkpoint_moves_over_to_tiercheck(tmp_path: Path) -> None:
    stock = _trainer(4, [], [])
    stock.fit(Net(), train_dataloaders=Batches())
    stock.save_checkpoint(tmp_path / "stock.ckpt")

    io = _io(tmp_path)
    start = StartStep()
    trainer = _trainer(8, [io], [TiercheckCallback(every_n_train_steps=2), start])
    trainer.fit(Net(), train_dataloaders=Batches(), ckpt_path=tmp_path / "stock.ckpt")
    assert start.steps == [4]
    assert io.last_save is not None
    assert io.last_save.version == 8


class GeneratorBatches(Batches):
    """A loader whose state holds a torch.Generator state, as torchdata's loaders' does."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(7)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.gen.set_state(state["gen"])


def test_loaded_states_outside_weights_and_optimizers_own_their_tensors(tmp_path: Path) -> None:
    io = _io(tmp_path)
    trainer = _trainer(4, [io], [TiercheckCallback(every_n_train_steps=4)])
    trainer.fit(Net(), train_dataloaders=GeneratorBatches())
    loaded = io.load_checkpoint("tiercheck:4")
    gen_state = loaded["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["gen"]
    # Generator.set_state reads from the start of the storage: a view at an offset breaks it.
    assert gen_state.storage_offset() == 0
    assert gen_state.untyped_storage().nbytes() == gen_state.numel()
    assert torch.equal(gen_state, torch.Generator().manual_seed(7).get_state())
    io.teardown()


def test_resume_path_is_none_on_a_fresh_job_and_latest_refuses(tmp_path: Path) -> None:
    io = _io(tmp_path)
    assert io.resume_path() is None
    trainer = _trainer(4, [io], [TiercheckCallback()])
    with pytest.raises(RestoreError):
        trainer.fit(Net(), train_dataloaders=Batches(), ckpt_path=LATEST)


def test_plugin_without_callback_refuses_to_save(tmp_path: Path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2)
    trainer = _trainer(4, [_io(tmp_path)], [saver])
    with pytest.raises(ConfigError):
        trainer.fit(Net(), train_dataloaders=Batches())


def test_callback_without_plugin_is_refused(tmp_path: Path) -> None:
    trainer = _trainer(4, [], [TiercheckCallback(every_n_train_steps=2)])
    with pytest.raises(ConfigError):
        trainer.fit(Net(), train_dataloaders=Batches())


def test_weights_only_checkpoints_are_refused(tmp_path: Path) -> None:
    trainer = _trainer(2, [_io(tmp_path)], [TiercheckCallback()])
    trainer.fit(Net(), train_dataloaders=Batches())
    with pytest.raises(ConfigError):
        trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)


def test_a_name_must_match_the_step(tmp_path: Path) -> None:
    trainer = _trainer(2, [_io(tmp_path)], [TiercheckCallback()])
    trainer.fit(Net(), train_dataloaders=Batches())
    with pytest.raises(ConfigError):
        trainer.save_checkpoint("tiercheck:7")
    with pytest.raises(ConfigError):
        trainer.save_checkpoint(LATEST)


@pytest.mark.parametrize("job", ["victim::x", "a/b", " ", ""])
def test_a_job_id_outside_the_grammar_is_refused_when_the_plugin_is_built(
    tmp_path: Path, job: str
) -> None:
    with pytest.raises(ConfigError, match="job_id must be"):
        _io(tmp_path, job)
    assert not (tmp_path / "durable").exists()


def test_a_pointer_of_another_job_is_refused(tmp_path: Path) -> None:
    trainer = _trainer(2, [_io(tmp_path, "one")], [TiercheckCallback()])
    trainer.fit(Net(), train_dataloaders=Batches())
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    with pytest.raises(ConfigError):
        _io(tmp_path, "two").load_checkpoint(tmp_path / "one.ckpt")


@pytest.mark.parametrize("every", [0, -3, True, 2.5])
def test_every_n_train_steps_must_be_positive(every: Any) -> None:
    with pytest.raises(ConfigError):
        TiercheckCallback(every_n_train_steps=every)


def test_resume_path_resumes_the_newest_version(tmp_path: Path) -> None:
    io = _io(tmp_path)
    trainer = _trainer(4, [io], [TiercheckCallback(every_n_train_steps=2)])
    trainer.fit(Net(), train_dataloaders=Batches())

    again = _io(tmp_path)
    path = again.resume_path()
    assert path == RESUME  # decided when fit loads it, by every rank together
    assert again.restored is None
    start = StartStep()
    resumed = _trainer(8, [again], [TiercheckCallback(every_n_train_steps=2), start])
    resumed.fit(Net(), train_dataloaders=Batches(), ckpt_path=path)
    assert start.steps == [4]
    assert again.restored is not None
    assert again.restored.version == 4


def _fresh_weights(root: Path, resume: bool) -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    model = Net()
    io = _io(root)
    start = StartStep()
    trainer = _trainer(4, [io], [TiercheckCallback(every_n_train_steps=2), start])
    trainer.fit(model, train_dataloaders=Batches(), ckpt_path=RESUME if resume else None)
    assert start.steps == [0]
    assert io.restored is None
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_resume_with_nothing_restorable_starts_fresh(tmp_path: Path) -> None:
    # A job opened once (so it has a job record) that never saved: killed before its first save.
    opened = _io(tmp_path / "opened")
    assert opened.checkpointer.versions()["local"] == []
    opened.teardown()
    assert opened.resume_path() == RESUME

    resumed = _fresh_weights(tmp_path / "opened", resume=True)
    fresh = _fresh_weights(tmp_path / "new", resume=False)
    assert set(resumed) == set(fresh)
    for name, value in resumed.items():  # exactly as ckpt_path=None
        assert torch.equal(value, fresh[name]), name


def _setup(strategy: Any, tmp_path: Path) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        plugins=[_io(tmp_path)],
    )
    TiercheckCallback().setup(trainer, Net(), "fit")
    return trainer


def test_ddp_saves_on_every_rank(tmp_path: Path) -> None:
    trainer = _setup("ddp", tmp_path)
    strategy = trainer.strategy
    assert isinstance(strategy, DDPStrategy)
    # Lightning's own save_checkpoint calls the CheckpointIO on global rank zero only.
    assert "save_checkpoint" in vars(strategy)
    calls: list[Any] = []
    io = strategy.checkpoint_io
    io.save_checkpoint = lambda *args, **kwargs: calls.append(args)  # type: ignore[method-assign]
    with patch.object(DDPStrategy, "is_global_zero", new=False):
        strategy.save_checkpoint({"global_step": 3}, "tiercheck:3")
    assert calls == [({"global_step": 3}, "tiercheck:3")]


def test_model_parallel_saves_loads_and_closes_on_every_rank(tmp_path: Path) -> None:
    trainer = _setup(ModelParallelStrategy(), tmp_path)
    strategy = trainer.strategy
    assert isinstance(strategy, ModelParallelStrategy)
    # Its own save_checkpoint and load_checkpoint write and read torch.distributed.checkpoint
    # folders, and its own teardown leaves the CheckpointIO open.
    assert {"save_checkpoint", "load_checkpoint", "teardown"} <= set(vars(strategy))
    calls: list[Any] = []
    io = strategy.checkpoint_io
    io.save_checkpoint = lambda *args, **kwargs: calls.append(args)  # type: ignore[method-assign]
    with patch.object(ModelParallelStrategy, "is_global_zero", new=False):
        strategy.save_checkpoint({"global_step": 3}, "tiercheck:3")
    assert calls == [({"global_step": 3}, "tiercheck:3")]
    io.teardown = lambda: calls.append("teardown")  # type: ignore[method-assign]
    strategy.teardown()
    assert calls[-1] == "teardown"


class OwnCheckpoints(DDPStrategy):
    """A DDP strategy writing checkpoints its own way, as DeepSpeed's does."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        raise AssertionError("never called")


class OwnModelParallel(ModelParallelStrategy):
    """A model-parallel strategy reading checkpoints its own way."""

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Any = None) -> dict[str, Any]:
        raise AssertionError("never called")


@pytest.mark.parametrize(
    "strategy",
    [
        "ddp_spawn",
        "ddp_fork",
        OwnCheckpoints(),
        ModelParallelStrategy(save_distributed_checkpoint=False),
        OwnModelParallel(),
    ],
    ids=["ddp_spawn", "ddp_fork", "ddp_subclass", "model_parallel_full", "model_parallel_subclass"],
)
def test_strategies_not_covered_are_refused_naming_what_is(strategy: Any, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"covers SingleDeviceStrategy .*DDPStrategy .* and ModelParallelStrategy"
    ):
        _setup(strategy, tmp_path)


def test_fsdp_v1_is_refused_naming_what_is_covered(tmp_path: Path) -> None:
    # Lightning runs FSDPStrategy on GPUs only ("requires a GPU accelerator"), so the trainer
    # is what the callback reads of one: the strategy, its plugin and the world size.
    strategy = FSDPStrategy()
    strategy.checkpoint_io = _io(tmp_path)
    trainer = SimpleNamespace(strategy=strategy, world_size=2)
    with pytest.raises(
        ConfigError,
        match=r"and ModelParallelStrategy .*; got FSDPStrategy .*its own sharded checkpoints",
    ):
        TiercheckCallback().setup(trainer, Net(), "fit")  # type: ignore[arg-type]


class ShardedAdamW(torch.optim.AdamW):
    """An optimizer that, like ZeroRedundancyOptimizer, keeps its state across ranks."""

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the state on rank ``to`` (Lightning calls it before every checkpoint)."""


class ShardedNet(Net):
    def configure_optimizers(self) -> Any:
        return ShardedAdamW(self.parameters(), lr=1e-2)


def test_optimizers_that_shard_their_state_are_refused(tmp_path: Path) -> None:
    trainer = _trainer(2, [_io(tmp_path)], [TiercheckCallback(every_n_train_steps=2)])
    with pytest.raises(ConfigError, match="ShardedAdamW shards its state"):
        trainer.fit(ShardedNet(), train_dataloaders=Batches())

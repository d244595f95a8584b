"""Lightning ``ModelParallelStrategy`` (FSDP2) on 2 CPU processes (gloo) through tiercheck.

Run by tests/integrations/test_lightning_fsdp2.py as
``python -m torch.distributed.run --nproc-per-node=2 lightning_fsdp2_train.py ...``. It trains
the tiny MLP of ``lightning_train.py`` (dropout, AdamW, a per-step LR schedule), each linear
layer and the whole net sharded with ``fully_shard`` over the data-parallel mesh in
``configure_model``, each rank on its own share of the data and with its own dropout stream
(seeded per rank), saving every ``EVERY`` steps with ``TiercheckCallback``: each rank stores
its own shards of the weights and of AdamW's state. Every launch passes
``ckpt_path=io.resume_path()``: a fresh job starts from scratch, a restarted one resumes.

FSDP2 reduce-scatters every step's gradients in the same groups (one per ``fully_shard``
unit), whether its wrapper was created at step 0 or at a resume, so unlike DDP nothing needs
arranging for the comparison with an uninterrupted run to be exact.

Events go to ``<out>/events-r<rank>.jsonl`` (see ``_events.py``); the final weights, gathered
whole (``full_tensor``), to ``<out>/final-r<rank>.safetensors``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _events import Commits, Events
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_train import Batches, Net
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard

from tiercheck.integrations.lightning import TiercheckCallback, TiercheckCheckpointIO

STEPS, EVERY = 30, 3


class ShardedNet(Net):
    """``Net`` with its linear layers, then the whole net, sharded by FSDP2."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


class Report(L.Callback):
    """Seeds each rank's dropout stream, reports progress, and slows steps so kills land mid-run."""

    def __init__(self, io: TiercheckCheckpointIO, events: Events, delay: float) -> None:
        self.io, self.events, self.delay = io, events, delay
        self.commits = Commits(events, lambda: io.last_save)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Each rank its own stream; after a resume TiercheckCallback sets the saved states
        # again at on_train_start, which comes later.
        torch.manual_seed(1000 + trainer.global_rank)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.events.resumed(trainer.global_step, self.io.restored)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.commits.poll()
        time.sleep(self.delay)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--memory", required=True)
    parser.add_argument("--durable", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--launch", required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    # Lightning 2.6 calls torch.utils._pytree.LeafSpec(), deprecated in recent torch; harmless.
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)

    events = Events(args.out, args.launch)
    events("start")
    L.seed_everything(0, verbose=False)
    model = ShardedNet()
    io = TiercheckCheckpointIO(
        args.job, local_root=args.memory, persistent=args.durable, base_every=4, peer_timeout=60
    )
    report = Report(io, events, args.delay)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[io],
        callbacks=[TiercheckCallback(every_n_train_steps=EVERY), report],
    )
    batches = Batches(rank=events.rank, world=2)
    trainer.fit(model, train_dataloaders=batches, ckpt_path=io.resume_path())
    report.commits.poll()  # fit's teardown waited for every save in flight
    # Collective: every rank gathers every parameter, in the same order.
    weights = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    save_file(weights, str(args.out / f"final-r{events.rank}.safetensors"))
    events("done")


if __name__ == "__main__":
    main()

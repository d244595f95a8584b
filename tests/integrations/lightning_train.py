"""A small, deterministic Lightning run that checkpoints through tiercheck; killed by the tests.

Run by tests/integrations/test_lightning.py in a subprocess. It trains a tiny MLP with dropout
(so the result depends on the RNG), AdamW and a per-step LR schedule on generated data, for
``STEPS`` optimizer steps over several epochs of ``BATCHES`` batches, saving every ``EVERY``
steps with ``TiercheckCallback``. With ``--resume`` it starts from ``io.resume_path()``.

It prints, one per line: ``start <global_step>`` when training starts (the restored step after
a resume), ``committed <step>`` when a save is committed in the local tier, ``done`` at the end,
after writing the final weights to ``--out`` (safetensors).

Exactness needs a data order that is a function of the epoch and a loader that knows its
position (Lightning only fast-forwards mid-epoch for a loader with ``state_dict``), which
``Batches`` provides; the rest (model, optimizer, scheduler, loops, RNG) comes back through
the integration.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from safetensors.torch import save_file

from tiercheck import SaveHandle
from tiercheck.integrations.lightning import TiercheckCallback, TiercheckCheckpointIO

STEPS, EVERY, BATCHES, BATCH, WIDTH = 40, 3, 12, 8, 16


class Net(L.LightningModule):
    """A two-layer MLP with dropout, AdamW and a StepLR schedule stepped every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 32),
            torch.nn.GELU(),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(32, 1),
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Batches:
    """Batches of a fixed generated dataset, in an order drawn per epoch from its own seed.

    Resumable: ``state_dict`` records the epoch and how many batches of it were handed out, and
    iteration after ``load_state_dict`` continues from there. With ``world > 1`` it serves rank
    ``rank``'s share of each epoch's order (every ``world``-th sample), as a distributed sampler
    would.
    """

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(BATCHES * BATCH, WIDTH, generator=gen)
        self.y = torch.randn(BATCHES * BATCH, 1, generator=gen)
        self.rank, self.world = rank, world
        self.epoch = 0
        self.served = 0

    def __len__(self) -> int:
        return math.ceil(len(self.x) / self.world / BATCH)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.served >= len(self):  # the previous epoch was finished
            self.epoch += 1
            self.served = 0
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))
        order = order[self.rank :: self.world]
        while self.served < len(self):
            idx = order[self.served * BATCH : (self.served + 1) * BATCH]
            self.served += 1
            yield self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "served": self.served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.served = state["epoch"], state["served"]


class Report(L.Callback):
    """Prints the start step and each save committed locally; slows steps so kills land mid-run."""

    def __init__(self, io: TiercheckCheckpointIO, delay: float) -> None:
        self.io, self.delay = io, delay
        self.pending: list[SaveHandle] = []
        self.seen: SaveHandle | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        print("start", trainer.global_step, flush=True)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.report()
        time.sleep(self.delay)

    def report(self) -> None:
        handle = self.io.last_save
        if handle is not None and handle is not self.seen:
            self.seen = handle
            self.pending.append(handle)
        for h in [h for h in self.pending if h.committed("local")]:
            print("committed", h.version, flush=True)
            self.pending.remove(h)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--local", required=True)
    parser.add_argument("--durable", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    # Lightning 2.6 calls torch.utils._pytree.LeafSpec(), deprecated in recent torch; harmless.
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)

    L.seed_everything(0, verbose=False)
    model = Net()
    io = TiercheckCheckpointIO(
        args.job, local_root=args.local, persistent=args.durable, base_every=4
    )
    report = Report(io, args.delay)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[io],
        callbacks=[TiercheckCallback(every_n_train_steps=EVERY), report],
    )
    ckpt_path = io.resume_path() if args.resume else None
    trainer.fit(model, train_dataloaders=Batches(), ckpt_path=ckpt_path)
    report.report()  # fit's teardown waited for every save in flight
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
    print("done", flush=True)


if __name__ == "__main__":
    main()

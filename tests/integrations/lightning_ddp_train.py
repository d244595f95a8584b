"""Lightning DDP on 2 CPU processes (gloo) through tiercheck; run by torchrun, killed by tests.

Run by tests/integrations/test_ddp_kills.py as
``python -m torch.distributed.run --nproc-per-node=2 lightning_ddp_train.py ...``. It trains the
tiny MLP of ``lightning_train.py`` (dropout, AdamW, a per-step LR schedule) with
``strategy="ddp"``, each rank on its own share of the data and with its own dropout stream
(seeded per rank), saving every ``EVERY`` steps with ``TiercheckCallback``. Every launch passes
``ckpt_path=io.resume_path()``: a fresh job starts from scratch, a restarted one resumes.

Gradients are all-reduced one parameter at a time. A DDP wrapper reduces its first step in one
bucket holding every gradient and later steps in buckets rebuilt from the order gradients
became ready, so a wrapper created at a resume reduces that step in other groups than the
uninterrupted run did. With two ranks that cannot change a sum (a + b is b + a, bit for bit);
with more, the all-reduce adds in an order that depends on the grouping and may round
differently whatever the checkpoint holds. ``bucket_cap_mb=0`` with
``find_unused_parameters=True`` (which keeps DDP from starting with one bucket) gives every
parameter a bucket of its own from the first step on, so the reduction is the same at every
step for any number of ranks, and the comparison with the uninterrupted run is exact by
construction, not by the luck of two ranks.

Events go to ``<out>/events-r<rank>.jsonl`` (see ``_events.py``); the final weights to
``<out>/final-r<rank>.safetensors``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _events import Commits, Events
from lightning.pytorch.strategies import DDPStrategy
from lightning_train import Batches, Net
from safetensors.torch import save_file

from tiercheck.integrations.lightning import TiercheckCallback, TiercheckCheckpointIO

STEPS, EVERY = 30, 3


class Report(L.Callback):
    """Seeds each rank's dropout stream, reports progress, and slows steps so kills land mid-run.

    With ``resumed_weights`` (a function of the module), writes the weights training starts
    from to ``<out>/resumed-r<rank>.safetensors``.
    """

    def __init__(
        self, io: TiercheckCheckpointIO, events: Events, delay: float, resumed_weights: Any = None
    ) -> None:
        self.io, self.events, self.delay = io, events, delay
        self.commits = Commits(events, lambda: io.last_save)
        self.resumed_weights = resumed_weights

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Each rank its own stream; after a resume TiercheckCallback sets the saved states
        # again at on_train_start, which comes later.
        torch.manual_seed(1000 + trainer.global_rank)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.events.resumed(trainer.global_step, self.io.restored)
        if self.resumed_weights is not None:
            path = self.events.out / f"resumed-r{self.events.rank}.safetensors"
            save_file(self.resumed_weights(pl_module), str(path))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.commits.poll()
        time.sleep(self.delay)


def main() -> None:
    train(Net, DDPStrategy(bucket_cap_mb=0, find_unused_parameters=True), lambda v: v)


def train(make_model: Any, strategy: Any, full: Any) -> None:
    """Fit a ``make_model()`` on the ranks torchrun started (2 in the tests) with ``strategy``
    through tiercheck, then write each rank's final weights (``full`` turns a state value into
    the whole tensor).

    ``--steps`` ends training earlier; ``--elastic`` opens the job with ``elastic=True`` and
    ``per_rank="wrap"`` (a job saved by another number of ranks is resharded; each rank's own
    state comes from old rank ``rank % N``) and writes the weights training starts from.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--memory", required=True)
    parser.add_argument("--durable", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--launch", required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--elastic", action="store_true")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "2"))
    # Lightning 2.6 calls torch.utils._pytree.LeafSpec(), deprecated in recent torch; harmless.
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)

    events = Events(args.out, args.launch)
    events("start")
    L.seed_everything(0, verbose=False)
    model = make_model()
    elastic: dict[str, Any] = {"elastic": True, "per_rank": "wrap"} if args.elastic else {}
    io = TiercheckCheckpointIO(
        args.job,
        local_root=args.memory,
        persistent=args.durable,
        base_every=4,
        peer_timeout=60,
        **elastic,
    )

    def whole(module: L.LightningModule) -> dict[str, torch.Tensor]:
        return {k: full(v).detach().clone() for k, v in module.state_dict().items()}

    report = Report(io, events, args.delay, whole if args.elastic else None)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[io],
        callbacks=[TiercheckCallback(every_n_train_steps=EVERY), report],
    )
    batches = Batches(rank=events.rank, world=world)
    trainer.fit(model, train_dataloaders=batches, ckpt_path=io.resume_path())
    report.commits.poll()  # fit's teardown waited for every save in flight
    save_file(whole(model), str(args.out / f"final-r{events.rank}.safetensors"))
    events("done")
    # Leave no process group to the interpreter's exit: torch's C++ threads torn down there can
    # abort the process ("terminate called without an active exception") after all went well.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # Even without a process group, torch's C++ threads torn down at interpreter exit abort a
    # launch now and then (seen about 1 in 10, with and without tiercheck); everything is
    # written and flushed by now, so leave as the FSDP2 workers of tests/distributed do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

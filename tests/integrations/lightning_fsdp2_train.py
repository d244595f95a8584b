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

import os
import sys

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_ddp_train import train
from lightning_train import Net
from torch.distributed.fsdp import fully_shard


class ShardedNet(Net):
    """``Net`` with its linear layers, then the whole net, sharded by FSDP2."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def main() -> None:
    # The DDP script's run, with FSDP2; every rank gathers every parameter at the end (collective).
    world = int(os.environ.get("WORLD_SIZE", "2"))
    train(
        ShardedNet,
        ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        lambda v: v.full_tensor(),
    )


if __name__ == "__main__":
    main()
    # torch's C++ threads torn down at interpreter exit abort a launch now and then
    # ("terminate called without an active exception"; seen with and without tiercheck);
    # everything is written and flushed by now, so leave as tests/distributed's workers do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""Hugging Face Trainer with DDP on 2 CPU processes (gloo) through tiercheck; run by torchrun,
killed by tests.

Run by tests/integrations/test_hf_ddp.py as
``python -m torch.distributed.run --nproc-per-node=2 hf_ddp_train.py ...``. It trains the 2-layer
GPT-2 of ``hf_train.py`` (built from a config, nothing downloaded; dropout, AdamW, warmup/decay)
with ``TiercheckTrainer``: accelerate shards each epoch's shuffled order between the ranks, each
rank draws its own dropout stream (seeded per rank), and every rank saves every ``SAVE_STEPS``.
Every launch calls ``train(resume_from_checkpoint=True)``: a fresh job starts from scratch, a
restarted one resumes.

Gradients are all-reduced one parameter at a time (``ddp_bucket_cap_mb=0`` with
``ddp_find_unused_parameters=True``): a DDP wrapper otherwise reduces its first step in one
bucket and later steps in rebuilt buckets, so the wrapper created at a resume would reduce that
step in other groups than the uninterrupted run did, which with more than two ranks can round
the sums differently whatever the checkpoint holds (see ``lightning_ddp_train.py``).

Events go to ``<out>/events-r<rank>.jsonl`` (see ``_events.py``); the final weights to
``<out>/final-r<rank>.safetensors``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _events import Commits, Events
from hf_train import SEQ, VOCAB, Tokens
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from tiercheck.integrations.hf import TiercheckTrainer

STEPS, SAVE_STEPS, BATCH = 30, 3, 4


class Report(TrainerCallback):
    """Seeds each rank's dropout stream, reports progress, and slows steps so kills land mid-run."""

    def __init__(self, events: Events, delay: float, dump: bool = False) -> None:
        self.events, self.delay, self.dump = events, delay, dump
        self.trainer: TiercheckTrainer | None = None
        self.commits: Commits | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.trainer is not None
        # Each rank its own stream; after a resume Trainer sets the saved states again when
        # the resumed epoch's first batch comes, which is later.
        torch.manual_seed(1000 + self.events.rank)
        self.events.resumed(state.global_step, self.trainer.tiercheck_restored)
        if self.dump:  # the weights training starts from
            path = self.events.out / f"resumed-r{self.events.rank}.safetensors"
            save_file(weights_of(self.trainer.model), str(path))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.delay)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.poll()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.poll()

    def poll(self) -> None:
        assert self.commits is not None
        self.commits.poll()


def weights_of(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights (one copy of each: GPT-2 ties its output layer to its embedding)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--memory", required=True)
    parser.add_argument("--durable", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--launch", required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    # Train fewer steps; open the job elastic (resharded onto another number of ranks, each
    # rank's own state from old rank rank % N) and write the weights training starts from.
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--elastic", action="store_true")
    args = parser.parse_args()

    events = Events(args.out, args.launch)
    events("start")
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        n_positions=SEQ,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=str(args.out / "trainer"),
        use_cpu=True,
        max_steps=args.steps,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        warmup_steps=5,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        save_total_limit=2,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        ddp_bucket_cap_mb=0,
        ddp_find_unused_parameters=True,
    )
    report = Report(events, args.delay, dump=args.elastic)
    trainer = TiercheckTrainer(
        model=model,
        args=training,
        train_dataset=Tokens(),
        callbacks=[report],
        tiercheck_job=args.job,
        tiercheck_options={
            "local_root": args.memory,
            "persistent": args.durable,
            "base_every": 4,
            "peer_timeout": 60,
            **({"elastic": True, "per_rank": "wrap"} if args.elastic else {}),
        },
    )
    report.trainer = trainer
    report.commits = Commits(events, lambda: trainer.tiercheck_last_save)
    trainer.train(resume_from_checkpoint=True)
    report.commits.poll()  # train() waited for every save in flight
    save_file(weights_of(model), str(args.out / f"final-r{events.rank}.safetensors"))
    events("done")


if __name__ == "__main__":
    main()
    # torch's C++ threads torn down at interpreter exit abort a launch now and then
    # ("terminate called without an active exception"; seen with and without tiercheck);
    # everything is written and flushed by now, so leave as tests/distributed's workers do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""A small, deterministic Hugging Face Trainer run through tiercheck; killed by the tests.

Run by tests/integrations/test_hf_kills.py in a subprocess. It trains a 2-layer GPT-2 built from
a ``GPT2Config`` (no download) on generated token sequences, with dropout, AdamW and a linear
warmup/decay schedule, for ``STEPS`` optimizer steps over several shuffled epochs, saving every
``SAVE_STEPS`` through ``TiercheckTrainer``. With ``--resume`` it calls
``train(resume_from_checkpoint=True)``.

It prints, one per line: ``start <global_step>`` when training starts (the restored step after
a resume), ``committed <step>`` when a save is committed in the local tier, ``done`` at the end,
after writing the final weights to ``--out`` (safetensors).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from tiercheck import SaveHandle
from tiercheck.integrations.hf import TiercheckTrainer

STEPS, SAVE_STEPS, BATCH, SAMPLES, SEQ, VOCAB = 30, 3, 4, 40, 16, 96


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Generated token sequences; the labels are the inputs (causal LM)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=gen)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Report(TrainerCallback):
    """Prints the start step and each save committed locally; slows steps so kills land mid-run."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.trainer: TiercheckTrainer | None = None
        self.pending: list[SaveHandle] = []
        self.seen: SaveHandle | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print("start", state.global_step, flush=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.delay)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.report()

    def report(self) -> None:
        assert self.trainer is not None
        handle = self.trainer.tiercheck_last_save
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
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()

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
        output_dir=args.workdir,
        use_cpu=True,
        max_steps=STEPS,
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
    )
    report = Report(args.delay)
    trainer = TiercheckTrainer(
        model=model,
        args=training,
        train_dataset=Tokens(),
        callbacks=[report],
        tiercheck_job=args.job,
        tiercheck_options={"local_root": args.local, "persistent": args.durable, "base_every": 4},
    )
    report.trainer = trainer
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    report.report()  # train() waited for every save in flight
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
    print("done", flush=True)


if __name__ == "__main__":
    main()

"""The Trainer integration in one process: resume values, retention, refusals, moving over."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the Trainer integration needs the 'hf' extra")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (the 'hf' extra)")

import torch
from accelerate.utils import DistributedType
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.training_args import ParallelMode

from tiercheck import ConfigError, RestoreError
from tiercheck.integrations.hf import LATEST, RESUME, TiercheckTrainer, TiercheckTrainerMixin

from .hf_train import SEQ, VOCAB, Tokens


class StartStep(TrainerCallback):
    """Records the global step when training starts."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.append(state.global_step)


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=16,
        n_positions=SEQ,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def _args(tmp_path: Path, **overrides: Any) -> TrainingArguments:
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "output"),
        "use_cpu": True,
        "max_steps": 9,
        "per_device_train_batch_size": 4,
        "save_strategy": "steps",
        "save_steps": 3,
        "logging_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
        **overrides,
    }
    return TrainingArguments(**settings)


def _trainer(
    tmp_path: Path, job: str = "job", **overrides: Any
) -> tuple[TiercheckTrainer, StartStep]:
    start = StartStep()
    options = overrides.pop("tiercheck_options", {})
    eval_dataset = overrides.pop("eval_dataset", None)
    trainer = TiercheckTrainer(
        model=_model(),
        args=_args(tmp_path, **overrides),
        train_dataset=Tokens(),
        eval_dataset=eval_dataset,
        callbacks=[start],
        tiercheck_job=job,
        tiercheck_options={
            "local_root": tmp_path / f"shm-{job}",
            "persistent": (tmp_path / "durable").as_uri(),
            "persist": "all",
            **options,
        },
    )
    return trainer, start


def test_resume_from_a_checkpoint_folder_name(tmp_path: Path) -> None:
    first, _ = _trainer(tmp_path, max_steps=12)
    first.train()
    assert first.tiercheck_last_save is not None
    assert first.tiercheck_last_save.version == 12
    assert not (tmp_path / "output" / "checkpoint-9").exists()  # names only: no folder

    again, start = _trainer(tmp_path, max_steps=12)
    again.train(resume_from_checkpoint=tmp_path / "output" / "checkpoint-9")
    assert start.steps == [9]
    assert again.tiercheck_restored is not None
    assert again.tiercheck_restored.version == 9
    assert again.state.global_step == 12


def test_resume_true_is_the_newest_whole_version(tmp_path: Path) -> None:
    first, _ = _trainer(tmp_path)
    first.train()
    again, start = _trainer(tmp_path, max_steps=12)
    again.train(resume_from_checkpoint=True)
    assert start.steps == [9]


def test_resume_on_a_fresh_job_starts_fresh(tmp_path: Path) -> None:
    for job, value in (("a", True), ("b", LATEST), ("c", RESUME)):
        trainer, start = _trainer(tmp_path, job=job, max_steps=3)
        trainer.train(resume_from_checkpoint=value)
        assert start.steps == [0]


def test_a_job_id_outside_the_grammar_is_refused_when_the_trainer_is_built(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="job_id must be"):
        _trainer(tmp_path, job="victim::x")
    assert not (tmp_path / "durable").exists()


def test_resume_from_a_version_that_is_not_stored_fails(tmp_path: Path) -> None:
    first, _ = _trainer(tmp_path, max_steps=6)
    first.train()
    again, _ = _trainer(tmp_path)
    with pytest.raises(RestoreError):
        again.train(resume_from_checkpoint="tiercheck:4")


@pytest.mark.parametrize(
    "value",
    [
        "somewhere/else",
        "tiercheck:newest",
        3,
        "out/checkpoint-\u0661\u0662",  # Arabic-Indic digits are not a step
        "out/checkpoint-12\n",
        "tiercheck:12\n",
    ],
)
def test_resume_values_that_name_no_version_are_refused(tmp_path: Path, value: Any) -> None:
    trainer, _ = _trainer(tmp_path)
    with pytest.raises(ConfigError):
        trainer.train(resume_from_checkpoint=value)


def test_stock_checkpoint_moves_over_to_tiercheck(tmp_path: Path) -> None:
    stock = Trainer(model=_model(), args=_args(tmp_path, max_steps=3), train_dataset=Tokens())
    stock.train()
    folder = tmp_path / "output" / "checkpoint-3"
    assert (folder / "trainer_state.json").is_file()

    trainer, start = _trainer(tmp_path, max_steps=6)
    trainer.train(resume_from_checkpoint=folder)
    assert start.steps == [3]
    assert trainer.tiercheck_last_save is not None
    assert trainer.tiercheck_last_save.version == 6


def test_save_total_limit_is_each_tiers_keep(tmp_path: Path) -> None:
    trainer, _ = _trainer(tmp_path, save_total_limit=2)
    policies = trainer.tiercheck_checkpointer.policies
    assert {name: p.keep for name, p in policies.items()} == {"local": 2, "persistent": 2}
    trainer.tiercheck_checkpointer.close()

    explicit, _ = _trainer(tmp_path, save_total_limit=2, tiercheck_options={"keep": 5})
    assert explicit.tiercheck_checkpointer.policies["local"].keep == 5
    explicit.tiercheck_checkpointer.close()


def test_export_hf_is_a_model_folder_from_pretrained_loads(tmp_path: Path) -> None:
    """A version the Trainer integration saved, exported as a Hugging Face folder in bf16 and
    in shards small enough to need an index: from_pretrained loads it, with its config, and
    every weight is the trained one cast to bf16."""
    from tiercheck.cli import EXIT_OK, main

    trainer, _ = _trainer(tmp_path, max_steps=6)
    trainer.train()
    out = tmp_path / "exported"
    argv = ["export", str(tmp_path / "durable"), str(out), "--format", "hf", "--dtype", "bf16"]
    assert main([*argv, "--max-shard-size", "4KB"]) == EXIT_OK
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert (out / "model.safetensors.index.json").is_file()
    assert (out / "config.json").is_file()
    loaded = GPT2LMHeadModel.from_pretrained(out)
    assert loaded.config.n_embd == trainer.model.config.n_embd
    got = loaded.state_dict()
    for name, weight in trainer.model.state_dict().items():
        assert torch.equal(got[name].to(torch.bfloat16), weight.to(torch.bfloat16)), name
    # Resuming reads a version that carries the config like one that does not.
    again, start = _trainer(tmp_path, max_steps=9)
    again.train(resume_from_checkpoint=True)
    assert start.steps == [6]


def test_save_total_limit_bounds_what_is_stored(tmp_path: Path) -> None:
    trainer, _ = _trainer(tmp_path, max_steps=15, save_total_limit=2)
    trainer.train()
    local = sorted(p.name for p in (tmp_path / "shm-job" / "blobs").glob("v*"))
    assert local == ["v000000000012", "v000000000015"]


@pytest.mark.parametrize(
    "overrides",
    [
        {"save_only_model": True},
        {
            "load_best_model_at_end": True,
            "eval_strategy": "steps",
            "eval_steps": 3,
            "eval_dataset": Tokens(),
        },
    ],
)
def test_configurations_not_covered_are_refused(tmp_path: Path, overrides: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        _trainer(tmp_path, **overrides)


def _covered(
    backend: str = "NO",
    mode: str = "not_parallel",
    parallelism: object = None,
    *,
    deepspeed: bool = False,
    fsdp: bool = False,
) -> SimpleNamespace:
    """What ``_check_covered`` reads of a Trainer, for a configuration that cannot run here."""
    args = SimpleNamespace(
        parallel_mode=ParallelMode(mode), load_best_model_at_end=False, save_only_model=False
    )
    accelerator = SimpleNamespace(
        distributed_type=DistributedType(backend), parallelism_config=parallelism
    )
    return SimpleNamespace(
        args=args, accelerator=accelerator, is_deepspeed_enabled=deepspeed, is_fsdp_enabled=fsdp
    )


@pytest.mark.parametrize(
    ("backend", "mode"),
    [("NO", "not_parallel"), ("NO", "not_distributed"), ("MULTI_CPU", "distributed"),
     ("MULTI_GPU", "distributed")],
)  # fmt: skip
def test_one_process_and_ddp_are_covered(backend: str, mode: str) -> None:
    TiercheckTrainerMixin._check_covered(_covered(backend, mode))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "trainer",
    [
        _covered("XLA", "tpu"),
        _covered("MEGATRON_LM", "distributed"),
        _covered("MULTI_XPU", "distributed"),
        _covered("NO", "sagemaker_model_parallel"),
        _covered("MULTI_GPU", "distributed", parallelism=object()),
        _covered("FSDP", "distributed", fsdp=True),
        _covered("DEEPSPEED", "distributed", deepspeed=True),
    ],
    ids=["xla", "megatron", "xpu", "sagemaker_mp", "parallelism_config", "fsdp", "deepspeed"],
)
def test_other_parallelism_is_refused_naming_what_is_covered(trainer: SimpleNamespace) -> None:
    with pytest.raises(ConfigError, match="it covers one process, and DDP"):
        TiercheckTrainerMixin._check_covered(trainer)  # type: ignore[arg-type]


def test_fsdp_is_refused_on_cpus_too(tmp_path: Path) -> None:
    # Under torchrun on CPUs, accelerate (1.x) ignores TrainingArguments.fsdp: its
    # AcceleratorState turns the FSDP plugin on only for GPU-like backends, so the Trainer
    # reports MULTI_CPU, is_fsdp_enabled False, and trains with DDP. Asking for FSDP is still
    # refused, so that a script tried on CPUs is not refused only once it reaches GPUs.
    trainer = _covered("MULTI_CPU", "distributed")
    trainer.args = _args(tmp_path, fsdp=True)
    assert trainer.args.fsdp_plugin_args is not None  # what would reach accelerate
    with pytest.raises(ConfigError, match=r"cover FSDP .*it covers one process, and DDP"):
        TiercheckTrainerMixin._check_covered(trainer)  # type: ignore[arg-type]


def test_processes_that_would_each_train_alone_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under torchrun on CPUs without use_cpu=True, transformers runs every process NOT_PARALLEL
    # (world size 1): each would train and save alone. Seen with the docs' example.
    trainer = _covered("NO", "not_parallel")
    trainer.args = _args(tmp_path)
    assert trainer.args.world_size == 1
    TiercheckTrainerMixin._check_covered(trainer)  # type: ignore[arg-type]  # one process: fine
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"started 2 processes.*use_cpu=True"):
        TiercheckTrainerMixin._check_covered(trainer)  # type: ignore[arg-type]

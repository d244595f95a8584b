"""Config functions of the torchtitan tests (``--module titan_config --config NAME``).

The llama3 debug model (dim 256, 6 layers, vocab 2048), FSDP over the ranks, in float32 with
SDPA attention (FlexAttention has no CPU backward; torchtitan refuses ``"sdpa"`` by name for
language models, so each layer's attention is swapped after the build), the ``c4_test`` loader
over a small local dataset (``TT_ASSETS``: see make_assets.py), deterministic, seed 42.
"""

from __future__ import annotations

import os

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

ASSETS = os.environ.get("TT_ASSETS", "assets")


def llama3_cpu() -> Trainer.Config:
    """The job without checkpoints (torchtitan's own manager, disabled)."""
    spec = model_registry("debugmodel", attn_backend="flex")
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=os.path.join(ASSETS, "tokenizer"),
        dump_folder=os.environ.get("TT_DUMP", "./outputs"),
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ),
        training=TrainingConfig(
            local_batch_size=2,
            seq_len=256,
            steps=6,
            dtype="float32",
            mixed_precision_param="float32",
            disable_cuda_graphs=True,
        ),
        dataloader=HuggingFaceTextDataLoader.Config(
            dataset="c4_test", dataset_path=os.path.join(ASSETS, "dataset")
        ),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=int(os.environ.get("WORLD_SIZE", "2")),
            # The default "spmd_types" backend fails under fully_shard on torch 2.13.
            spmd_backend="partial_dtensor",
        ),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        validator=Validator.Config(enable=False),
        debug=DebugConfig(seed=42, deterministic=True),
    )


def llama3_cpu_tiercheck() -> Trainer.Config:
    """The same job, saving every step through tiercheck (``TT_JOB``, ``TT_PERSISTENT``,
    ``TT_LOCAL_ROOT``)."""
    from tiercheck.integrations.torchtitan import TiercheckCheckpointManager

    config = llama3_cpu()
    config.checkpoint = TiercheckCheckpointManager.Config(
        enable=True,
        job_id=os.environ["TT_JOB"],
        persistent=os.environ["TT_PERSISTENT"],
        local_root=os.environ["TT_LOCAL_ROOT"],
        interval=1,
    )
    return config

"""A stored version as a Hugging Face model folder (``tiercheck export --format hf``).

The folder is what ``save_pretrained`` writes and ``from_pretrained`` loads: the model's
tensors as safetensors files of at most ``max_shard`` bytes each -- ``model.safetensors`` when
one is enough, else ``model-00001-of-0000N.safetensors`` and so on with
``model.safetensors.index.json`` mapping every tensor to its file -- and ``config.json`` where
the state holds the model's config (the Trainer integration saves it, as ``model_config``).

Which tensors are the model's: the entry ``model`` of the state when it is a mapping (what the
Trainer integration and most loops save: ``{"model": model.state_dict(), ...}``), else the
state itself when it is a mapping of names to tensors (a bare ``model.state_dict()``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tiercheck.errors import StateMismatch

__all__ = ["MODEL_CONFIG_KEY", "hf_model", "write_hf"]

#: The entry of a state that holds the model's config as JSON text (the Trainer integration's).
MODEL_CONFIG_KEY = "model_config"

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def hf_model(
    state: Any, *, dtype: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], str | None, list[str]]:
    """The model's tensors in ``state`` by name (floating-point ones cast to ``dtype``), its
    config as JSON text if the state holds it, and notes on what was left out. Raises
    :class:`~tiercheck.errors.StateMismatch` for a state with no model in it."""
    notes: list[str] = []
    config: str | None = None
    if isinstance(state, Mapping) and isinstance(state.get("model"), Mapping):
        model: Mapping[Any, Any] = state["model"]
        prefix = "model."
        found = state.get(MODEL_CONFIG_KEY)
        config = found if isinstance(found, str) else None
    elif isinstance(state, Mapping) and any(isinstance(v, torch.Tensor) for v in state.values()):
        model, prefix = state, ""
    else:
        raise StateMismatch(
            "the version holds no model to export as a Hugging Face folder: expected a state "
            "with a 'model' entry mapping names to tensors ({'model': model.state_dict(), ...}) "
            "or a bare mapping of names to tensors; export it with --format pt or safetensors"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.items():
        if not isinstance(value, torch.Tensor):
            notes.append(f"{prefix}{name}: not a tensor ({type(value).__name__}); left out")
            continue
        cast = value.to(dtype) if dtype is not None and value.is_floating_point() else value
        tensors[str(name)] = cast.contiguous()
    if not tensors:
        raise StateMismatch("the version's model holds no tensors; nothing to export")
    if config is None:
        notes.append(
            "the version holds no model config (the Trainer integration saves it): "
            "from_pretrained needs config.json beside the weights -- write it with "
            "model.config.save_pretrained(OUT)"
        )
    return tensors, config, notes


def write_hf(
    tensors: Mapping[str, torch.Tensor], config: str | None, folder: Path, *, max_shard: int
) -> None:
    """Write ``tensors`` (and ``config``) into the empty ``folder`` as Hugging Face lays a
    model out, in files of at most ``max_shard`` bytes of tensors (a larger tensor alone)."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and filled + size > max_shard:
            shards.append({})
            filled = 0
        shards[-1][name] = tensor
        filled += size
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / _SINGLE), metadata=meta)
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / name), metadata=meta)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if config is not None:
        (folder / "config.json").write_text(config)

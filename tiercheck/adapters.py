"""Ready ``Stateful`` objects for the common parts of a training state.

Put them in the state handed to ``save`` and ``restore`` (see :mod:`tiercheck.engine.stateful`)::

    from tiercheck.adapters import ModelAndOptimizer, RNGState

    state = {"app": ModelAndOptimizer(model, opt), "rng": RNGState()}
    ckpt.save(step, state)
    ...
    ckpt.restore(state)   # fills the model, the optimizer (fresh or not) and the RNGs

* :class:`ModelAndOptimizer` goes through ``torch.distributed.checkpoint.state_dict``'s
  ``get_state_dict`` / ``set_state_dict``: the same code for a plain module, DDP and FSDP2
  (whose state holds DTensors, stored as local shards), and an optimizer that has not stepped
  yet is initialized by ``set_state_dict`` before it is filled. The optimizer's state is keyed
  by parameter name, not by position.
* :class:`RNGState` holds the generators of Python's ``random``, numpy's legacy global
  generator (when numpy is importable), torch's CPU generator and, where CUDA is available, each
  CUDA device's generator -- as tensors and plain values, never pickled.

Both import nothing heavy until used.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from typing import Any

import torch

from tiercheck.codec.format.dtensor import place_like

__all__ = ["ModelAndOptimizer", "RNGState"]

logger = logging.getLogger("tiercheck")


class ModelAndOptimizer:
    """A model and its optimizer(s) as one ``Stateful``: ``{"model": ..., "optim": ...}``.

    ``state_dict()`` is ``get_state_dict(model, optimizers, options=options)`` and
    ``load_state_dict()`` is ``set_state_dict(...)`` of ``torch.distributed.checkpoint.state_dict``
    (``options`` is a ``StateDictOptions``; the default keeps each rank's own shards). Works
    without ``torch.distributed`` initialized (a single-process model) too.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
        *,
        options: Any = None,
    ) -> None:
        self.model = model
        self.optimizers = (
            optimizers if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
        )
        self.options = options

    def _optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        if isinstance(self.optimizers, torch.optim.Optimizer):
            return (self.optimizers,)
        return tuple(self.optimizers)

    def state_dict(self) -> dict[str, Any]:
        """``{"model": model state, "optim": optimizer state}`` (DTensors where sharded).

        An optimizer that has not stepped yet is saved without per-parameter state and left as
        it was: ``get_state_dict`` initializes it with a zero-gradient step, after which its
        step counter would be 1 and its next real step would differ from a run that never
        saved.
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict

        fresh = [opt for opt in self._optimizers() if not opt.state]
        model_state, optim_state = get_state_dict(self.model, self.optimizers, options=self.options)
        if fresh:
            fresh_ids = {
                id(p) for opt in fresh for group in opt.param_groups for p in group["params"]
            }
            for opt in fresh:
                opt.state.clear()  # undo the initialization (its gradients are None again)
            names = {
                name
                for name, param in _params_by_name(self.model).items()
                if id(param) in fresh_ids
            }
            optim_state = _without(optim_state, names)
        return {"model": model_state, "optim": optim_state}

    def tiercheck_restore_target(self) -> dict[str, Any]:
        """What a restore in place fills: :meth:`state_dict`, except that an optimizer that has
        not stepped yet contributes an empty dict.

        ``get_state_dict`` initializes such an optimizer by running a step with zero gradients,
        which advances its step counter; a fresh start (nothing stored) must not change it.
        """
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        model_state = get_model_state_dict(self.model, options=self.options)
        if not all(opt.state for opt in self._optimizers()):
            return {"model": model_state, "optim": {}}
        optim_state = get_optimizer_state_dict(self.model, self.optimizers, options=self.options)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load both parts (what :meth:`state_dict` returned, as restored).

        Optimizer state restored for a sharded parameter is put on that parameter's own mesh
        and placements first (a restore without the optimizer's state to fill gives the local
        shard, or a DTensor on a mesh rebuilt from the default group).
        """
        from torch.distributed.checkpoint.state_dict import set_state_dict

        optim_state = state_dict["optim"]
        per_param = optim_state.get("state") if isinstance(optim_state, dict) else None
        if isinstance(per_param, dict):
            params = _params_by_name(self.model)
            for name, entry in per_param.items():
                param = params.get(name)
                if param is not None and isinstance(entry, dict):
                    for key, value in list(entry.items()):
                        entry[key] = place_like(param, value, f"{name}.{key}")
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=optim_state,
            options=self.options,
        )


def _without(optim_state: Any, names: set[str]) -> Any:
    """``optim_state`` (nested, or flattened by ``flatten_optimizer_state_dict``) without the
    per-parameter state of the parameters ``names``."""
    if "state" in optim_state:
        per_param = optim_state["state"]
        return {**optim_state, "state": {k: v for k, v in per_param.items() if k not in names}}
    prefixes = tuple(f"state.{name}." for name in names)
    return {k: v for k, v in optim_state.items() if not k.startswith(prefixes)}


def _params_by_name(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters by name, with and without the ``module.`` prefix of DDP wrappers."""
    out: dict[str, torch.nn.Parameter] = {}
    for name, param in model.named_parameters():
        out[name] = param
        out.setdefault(name.replace("module.", ""), param)
    return out


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional for this adapter
        return None
    return numpy


class RNGState:
    """The random generators of this process as one ``Stateful``.

    ``state_dict()`` holds ``"python"`` (``random.getstate()`` as a version, an ``int64``
    tensor of the Mersenne Twister's 625 words and the cached Gaussian), ``"numpy"`` (the legacy
    global generator: its name, an ``uint32`` tensor key and plain values; only if numpy is
    importable), ``"torch"`` (``torch.get_rng_state()``) and ``"cuda"`` (one state per device;
    only where CUDA is available). ``load_state_dict()`` sets each generator it finds; a part
    saved where this process has no counterpart (CUDA states restored without CUDA, or on fewer
    devices) is skipped with a warning.
    """

    def state_dict(self) -> dict[str, Any]:
        """The current states (see the class docstring)."""
        version, words, gauss = random.getstate()
        out: dict[str, Any] = {
            "python": {
                "version": version,
                "state": torch.tensor(words, dtype=torch.int64),
                "gauss": gauss,
            },
            "torch": torch.get_rng_state(),
        }
        np = _numpy()
        if np is not None:
            name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
            out["numpy"] = {
                "bit_generator": str(name),
                "key": torch.from_numpy(np.asarray(key, dtype=np.uint32).copy()),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        if torch.cuda.is_available():
            out["cuda"] = list(torch.cuda.get_rng_state_all())
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set every generator whose state ``state_dict`` holds."""
        python = state_dict.get("python")
        if python is not None:
            words = tuple(int(w) for w in python["state"].tolist())
            random.setstate((int(python["version"]), words, python["gauss"]))
        if "torch" in state_dict:
            # set_rng_state reads the storage from its start: hand it a tensor of its own.
            torch.set_rng_state(state_dict["torch"].clone())
        saved_np = state_dict.get("numpy")
        if saved_np is not None:
            np = _numpy()
            if np is None:
                logger.warning("tiercheck: numpy's RNG state was saved; numpy is not importable")
            else:
                np.random.set_state(
                    (
                        saved_np["bit_generator"],
                        saved_np["key"].numpy().astype(np.uint32),
                        int(saved_np["pos"]),
                        int(saved_np["has_gauss"]),
                        float(saved_np["cached_gaussian"]),
                    )
                )
        cuda = state_dict.get("cuda")
        if cuda:
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if available < len(cuda):
                logger.warning(
                    "tiercheck: %d CUDA RNG states were saved; this process has %d CUDA "
                    "devices, so only those are set",
                    len(cuda),
                    available,
                )
            for device, state in enumerate(cuda[:available]):
                torch.cuda.set_rng_state(state.clone(), device)

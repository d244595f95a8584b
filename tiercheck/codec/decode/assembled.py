"""A state put together from other ranks' blobs: a layout and its tensors, like a decoded blob.

What an elastic restore (:mod:`tiercheck.engine.restore.elastic`) and a whole-state export
(:mod:`tiercheck.catalog.export`) build with :func:`~tiercheck.codec.reshard.reshard.assemble`; it
answers ``version``, ``layout`` and ``tensors()`` as a :class:`~tiercheck.codec.RawState` does,
so the same code turns either into a state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiercheck.codec.encode.flatten import Layout

__all__ = ["Resharded"]


@dataclass(frozen=True)
class Resharded:
    """What one rank of a new world holds of ``version``: a layout and its tensors."""

    version: int
    layout: Layout
    parts: tuple[torch.Tensor, ...]
    #: How many ranks saved the version.
    old_world: int

    def tensors(self) -> list[torch.Tensor]:
        """The tensors, in ``layout`` order."""
        return list(self.parts)

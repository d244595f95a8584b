"""The chaos soak's "training": a tiny deterministic job whose every state the oracle recomputes.

Each rank holds a few tensors (fp32 weights, bf16 moments, a step counter, the state of its own
random generator). One step draws a contribution from ``(step, rank)``, all-reduces it over the
job's ranks (int64: the sum is exact, whatever order the ranks add in), and advances the state
from the previous one with elementwise float ops (each correctly rounded, so bit for bit the
same in every process) and the rank's generator. A restore that returns wrong bytes, an older
version or a stale generator therefore changes every later state, and the final one.

:class:`Reference` replays the same steps for every rank in one process, without any
checkpointing: the uninterrupted run the oracle compares every restore and every end with.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

__all__ = ["CONTRIBUTION", "Model", "Reference", "contribution", "digest"]

#: Elements each rank all-reduces per step (one more carries the "stop" flag, outside the model).
CONTRIBUTION = 64


def contribution(step: int, rank: int) -> torch.Tensor:
    """What ``rank`` adds to the all-reduce of ``step``: a pure function of both."""
    g = torch.Generator().manual_seed(step * 7919 + rank * 104729 + 1)
    return torch.randint(-1000, 1000, (CONTRIBUTION,), generator=g, dtype=torch.int64)


def digest(state: dict[str, Any]) -> str:
    """A hash of every tensor's bytes, by name (what the oracle compares)."""
    h = hashlib.sha256()
    for name in sorted(state):
        value = state[name]
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(str(value.dtype).encode())
            h.update(value.contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()[:32]


class Model:
    """One rank's state and its step rule (``size`` fp32 weights)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.generator = torch.Generator().manual_seed(10_000 + rank)
        self.w = torch.zeros(size, dtype=torch.float32)
        self.m = torch.zeros(max(CONTRIBUTION, size // 4), dtype=torch.bfloat16)
        self.count = torch.zeros(1, dtype=torch.int64)
        self.rng = self.generator.get_state()

    def state(self) -> dict[str, Any]:
        """The live state: what is saved, and what a restore fills in place."""
        return {"w": self.w, "m": self.m, "count": self.count, "rng": self.rng}

    def before_save(self) -> None:
        """Put the generator's state into the saved state."""
        self.rng.copy_(self.generator.get_state())

    def after_restore(self) -> None:
        """Take the generator's state back from the restored state."""
        self.generator.set_state(self.rng.clone())

    def advance(self, reduced: torch.Tensor) -> None:
        """One step, from the all-reduced contributions of every rank."""
        noise = torch.randn(self.w.shape, generator=self.generator)
        self.w.mul_(0.5).add_(noise)
        self.w[:CONTRIBUTION].add_(reduced[:CONTRIBUTION].to(torch.float32).mul_(1e-3))
        head = self.w[: self.m.numel()].to(torch.bfloat16)
        self.m.mul_(0.75).add_(head)
        self.count.add_(1)

    def digest(self) -> str:
        """The digest of the state as saved now."""
        self.before_save()
        return digest(self.state())


class Reference:
    """The uninterrupted run of a ``world``-rank job: the digest of each rank's state after each
    step, computed on demand and remembered."""

    def __init__(self, world: int, size: int) -> None:
        self.world = world
        self.models = [Model(r, size) for r in range(world)]
        self.digests: list[list[str]] = []  # by step, then rank

    def digest(self, step: int, rank: int) -> str:
        """Rank ``rank``'s state after step ``step`` (version ``step``) in the uninterrupted run."""
        while len(self.digests) <= step:
            s = len(self.digests)
            reduced = sum(contribution(s, r) for r in range(self.world))
            assert isinstance(reduced, torch.Tensor)
            for model in self.models:
                model.advance(reduced)
            self.digests.append([m.digest() for m in self.models])
        return self.digests[step][rank]

"""Who is where: ranks, nodes (failure domains), and the ring that places peer replicas.

A *node* is the set of ranks that share host memory and fail together. On a real cluster it is
read from the launcher (``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` / ``NODE_RANK``); tests and the demo
simulate several nodes on one machine by setting ``ranks_per_node`` explicitly (or the
``TIERCHECK_RANKS_PER_NODE`` environment variable), each node then getting its own memory root.
Ranks are assumed to be laid out node by node (ranks ``k*n .. k*n+n-1`` on node ``k``), which is
what torchrun does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tiercheck.errors import ConfigError

__all__ = ["Topology"]


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError as exc:
                raise ConfigError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from exc
    return None


@dataclass(frozen=True, slots=True)
class Topology:
    """The placement of ranks on nodes."""

    rank: int
    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an int, got {value!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(
                "rank must be in [0, world_size); "
                f"got rank={self.rank}, world_size={self.world_size}"
            )
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ConfigError(
                f"ranks_per_node ({self.ranks_per_node}) must divide world_size ({self.world_size})"
            )

    @classmethod
    def detect(
        cls,
        rank: int | None = None,
        world_size: int | None = None,
        ranks_per_node: int | None = None,
    ) -> Topology:
        """Fill what was not given from torch.distributed, then the launcher's environment."""
        if rank is None or world_size is None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank() if rank is None else rank
                world_size = dist.get_world_size() if world_size is None else world_size
        rank = rank if rank is not None else (_env_int("RANK") or 0)
        world_size = world_size if world_size is not None else (_env_int("WORLD_SIZE") or 1)
        if ranks_per_node is None:
            ranks_per_node = _env_int("TIERCHECK_RANKS_PER_NODE", "LOCAL_WORLD_SIZE") or world_size
        for name, value in (
            ("rank", rank),
            ("world_size", world_size),
            ("ranks_per_node", ranks_per_node),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an int, got {value!r}")
        return cls(rank, world_size, min(ranks_per_node, world_size))

    @property
    def num_nodes(self) -> int:
        """How many nodes (failure domains) the job spans."""
        return self.world_size // self.ranks_per_node

    @property
    def node_index(self) -> int:
        """The node this rank is on."""
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        """This rank's index within its node."""
        return self.rank % self.ranks_per_node

    @property
    def node_name(self) -> str:
        """The default name of this rank's node (names its memory root)."""
        return f"node{self.node_index}"

    def node_of(self, rank: int) -> int:
        """The node ``rank`` is on."""
        return rank // self.ranks_per_node

    def replica_targets(self, replicas: int = 1) -> list[int]:
        """Ranks that hold this rank's peer replicas: the same local rank on the next nodes.

        Ring placement: node *i* replicates to nodes *i+1 .. i+replicas*. Never a rank on this
        node; at most ``num_nodes - 1`` replicas exist.
        """
        return [self._shift(k) for k in range(1, min(replicas, self.num_nodes - 1) + 1)]

    def replica_sources(self, replicas: int = 1) -> list[int]:
        """Ranks whose replicas this rank holds (the inverse of :meth:`replica_targets`)."""
        return [self._shift(-k) for k in range(1, min(replicas, self.num_nodes - 1) + 1)]

    def _shift(self, nodes: int) -> int:
        return (self.rank + nodes * self.ranks_per_node) % self.world_size

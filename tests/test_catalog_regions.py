"""Putting DTensors together by region (tiercheck/catalog/regions.py): any mesh, each region
once, the cover checked."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tiercheck.catalog.regions import whole_by_regions
from tiercheck.codec import DTensorShard
from tiercheck.errors import ShardsInconsistent

FULL = torch.arange(24, dtype=torch.float32).reshape(4, 6)


def shard(rows: slice, cols: slice, coord: tuple[int, int]) -> DTensorShard:
    """The box ``rows`` x ``cols`` of FULL, as a rank of a (2, 2) mesh stored it."""
    return DTensorShard(
        local=FULL[rows, cols].clone(),
        shape=(4, 6),
        stride=(6, 1),
        placements=(("shard", 0), ("shard", 1)),
        mesh=(2, 2),
        names=("dp", "tp"),
        device="cpu",
        coord=coord,
        offset=(rows.start, cols.start),
    )


def grid() -> list[DTensorShard]:
    top, bottom, left, right = slice(0, 2), slice(2, 4), slice(0, 3), slice(3, 6)
    return [
        shard(top, left, (0, 0)),
        shard(top, right, (0, 1)),
        shard(bottom, left, (1, 0)),
        shard(bottom, right, (1, 1)),
    ]


def trees(shards: list[DTensorShard], **plain: Any) -> list[Any]:
    return [{"w": s, "step": plain.get(f"step{r}", 7)} for r, s in enumerate(shards)]


def test_a_2d_grid_and_a_replicated_region_come_together_whole() -> None:
    shards = [*grid(), grid()[0]]  # a fifth rank holding rank 0's region again
    warnings: list[str] = []
    state = whole_by_regions(trees(shards), warnings)
    assert torch.equal(state["w"], FULL)
    assert state["step"] == 7
    assert warnings == []


def test_state_outside_dtensors_that_differs_is_rank_0s_with_a_warning() -> None:
    warnings: list[str] = []
    state = whole_by_regions(trees(grid(), step2=8), warnings)
    assert state["step"] == 7
    assert warnings == [
        "state outside DTensors differs between ranks; rank 0's was used: ['step'] (rank 2)"
    ]


def test_shards_that_do_not_fit_together_are_refused() -> None:
    gap = grid()[:3]  # the bottom-right box missing
    with pytest.raises(ShardsInconsistent, match="do not cover"):
        whole_by_regions(trees(gap), [])
    other = grid()[0]
    other.local[0, 0] = -1.0
    with pytest.raises(ShardsInconsistent, match="different values"):
        whole_by_regions(trees([*grid(), other]), [])
    outside = dataclasses.replace(shard(slice(2, 4), slice(3, 6), (1, 1)), offset=(3, 3))
    with pytest.raises(ShardsInconsistent, match="outside the global shape"):
        whole_by_regions(trees([*grid()[:3], outside]), [])

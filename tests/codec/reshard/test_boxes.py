"""Resharding by region into the caller's own DTensors: meshes of two dimensions.

Old ranks' states are laid out over a 2-D mesh as torch lays them (offsets and local shapes from
torch's ``_compute_local_shape_and_global_offset`` on plain data); the caller's state is laid out
over another mesh (2-D or 1-D, another number of ranks). Every new rank's plan, given the
caller's records (:func:`tiercheck.engine.restore.elastic.targets_in`), must rebuild exactly torch's
shard of the same global tensor on the new mesh, reading only the bytes its spans name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate, Shard

from tests.codec._helpers import copy_tensor, random_tensor, tensor_bytes
from tiercheck.codec.decode.rebuild import unflatten
from tiercheck.codec.format.dtensor import DTensorShard
from tiercheck.codec.reshard.reshard import assemble, plan_reshard
from tiercheck.engine.restore.elastic import targets_in
from tiercheck.errors import ReshardError, ShardsInconsistent

from .test_reshard import contiguous_stride, outside_scrambled, save

Placement = list[Any]


def _obj(p: Placement) -> Any:
    return Shard(p[1]) if p[0] == "shard" else Replicate()


def coords(mesh: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every coordinate of ``mesh``, in rank order (row-major, as a DeviceMesh numbers them)."""
    out: list[tuple[int, ...]] = [()]
    for n in mesh:
        out = [(*c, i) for c in out for i in range(n)]
    return out


def shard_on(
    full: torch.Tensor, placements: list[Placement], mesh: tuple[int, ...], rank: int
) -> DTensorShard:
    """Rank ``rank``'s stored DTensor of ``full`` on ``mesh``, placed ``placements``."""
    shape = tuple(full.shape)
    coord = coords(mesh)[rank]
    local_shape, offset = _compute_local_shape_and_global_offset(
        shape, mesh, list(coord), [_obj(p) for p in placements]
    )
    local = full
    for d, (o, n) in enumerate(zip(offset, local_shape, strict=True)):
        local = local.narrow(d, o, n)
    return DTensorShard(
        local=copy_tensor(local),
        shape=shape,
        stride=contiguous_stride(shape),
        placements=tuple(tuple(p) for p in placements),
        mesh=mesh,
        names=tuple(f"d{i}" for i in range(len(mesh))),
        device="cpu",
        coord=coord,
        offset=tuple(offset),
    )


def state_on(
    weights: list[torch.Tensor], placements: list[Placement], mesh: tuple[int, ...], rank: int
) -> Any:
    return {
        "model": {f"w{i}": shard_on(w, placements, mesh, rank) for i, w in enumerate(weights)},
        "step": 7,
        "rng": torch.arange(4, dtype=torch.int64),
    }


MESHES = st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (2, 3), (3, 2), (1, 4), (4, 1)])
PLACEMENTS = st.sampled_from(
    [
        [["shard", 0], ["shard", 0]],
        [["shard", 0], ["shard", 1]],
        [["shard", 1], ["shard", 0]],
        [["replicate"], ["shard", 0]],
        [["shard", 1], ["replicate"]],
        [["replicate"], ["replicate"]],
    ]
)


@settings(max_examples=60, deadline=None)
@given(
    old_mesh=MESHES,
    old_placements=PLACEMENTS,
    new_mesh=st.one_of(MESHES, st.sampled_from([(1,), (2,), (3,)])),
    new_placements=PLACEMENTS,
    rows=st.integers(0, 9),
    cols=st.integers(1, 7),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8]),
    seed=st.integers(0, 2**16),
)
def test_every_new_rank_gets_torchs_shard_on_its_own_mesh(
    *,
    old_mesh: tuple[int, ...],
    old_placements: list[Placement],
    new_mesh: tuple[int, ...],
    new_placements: list[Placement],
    rows: int,
    cols: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    new_placements = new_placements[: len(new_mesh)]
    weights = [random_tensor(dtype, (rows, cols), seed), random_tensor(dtype, (cols + 1, 3), seed)]
    n, m = math.prod(old_mesh), math.prod(new_mesh)
    layouts, tensors = save([state_on(weights, old_placements, old_mesh, s) for s in range(n)])
    for q in range(m):
        targets = targets_in(state_on(weights, new_placements, new_mesh, q))
        plan = plan_reshard(layouts, new_rank=q, new_world=m, targets=targets)
        given_ = {
            s: {i: outside_scrambled(tensors[s][i], plan.spans[s, i]) for i in idx}
            for s, idx in plan.wanted.items()
        }
        got = unflatten(plan.layout, assemble(plan, given_))
        assert got["step"] == 7
        assert tensor_bytes(got["rng"]) == tensor_bytes(torch.arange(4, dtype=torch.int64))
        for i, w in enumerate(weights):
            want = shard_on(w, new_placements, new_mesh, q)
            shard = got["model"][f"w{i}"]
            assert shard.record() == want.record()
            assert tuple(shard.local.shape) == tuple(want.local.shape)
            assert tensor_bytes(shard.local) == tensor_bytes(want.local)


def test_a_replicated_region_is_read_once_from_the_lowest_rank() -> None:
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    mesh, placements = (2, 2), [["replicate"], ["shard", 0]]
    layouts, _ = save([state_on([full], placements, mesh, s) for s in range(4)])
    targets = targets_in(state_on([full], [["shard", 0]], (3,), 1))
    plan = plan_reshard(layouts, new_rank=1, new_world=3, targets=targets)
    # New rank 1 holds rows 2..3, all in old shard row 0..2 (held by old ranks 0 and 2) and
    # row 3..5 (old ranks 1 and 3): read from ranks 0 and 1 only.
    dtensor_pieces = [p for pieces in plan.pieces for p in pieces if p.size != (4,)]
    assert {p.rank for p in dtensor_pieces} == {0, 1}


def _layouts_with(change: Any) -> list[Any]:
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    states = [state_on([full], [["shard", 0], ["shard", 1]], (2, 2), s) for s in range(4)]
    change(states)
    return save(states)[0]


def _target(full_shape: tuple[int, ...] = (6, 4), dtype: torch.dtype = torch.float32) -> Any:
    full = torch.zeros(full_shape, dtype=dtype)
    return targets_in(state_on([full], [["shard", 0]], (2,), 0))


def test_a_target_of_another_shape_or_dtype_is_refused_naming_both() -> None:
    layouts = _layouts_with(lambda states: None)
    for target in (_target((6, 5)), _target(dtype=torch.float64)):
        with pytest.raises(ReshardError, match=r"\['model'\]\['w0'\]; the version stored"):
            plan_reshard(layouts, new_rank=0, new_world=2, targets=target)


def test_without_a_target_a_2d_mesh_is_refused_and_says_how_to_restore_it() -> None:
    layouts = _layouts_with(lambda states: None)
    with pytest.raises(ReshardError, match=r"restore\(state, elastic=True\)") as info:
        plan_reshard(layouts, new_rank=0, new_world=2)
    assert not isinstance(info.value, ShardsInconsistent)


def _move(states: list[Any], rank: int, offset: tuple[int, ...], rows: int = 3) -> None:
    shard = states[rank]["model"]["w0"]
    states[rank]["model"]["w0"] = dataclasses.replace(
        shard, offset=offset, local=copy_tensor(shard.local[:rows])
    )


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda states: _move(states, 3, (3, 0)), "exactly once"),  # overlaps rank 2
        (lambda states: _move(states, 3, (4, 2)), "outside the global shape"),
        (lambda states: _move(states, 1, (0, 0)), "exactly once"),  # a replica; a hole left
        (lambda states: _move(states, 1, (0, 0), rows=2), "at the same offset"),
        (lambda states: states[2]["model"].pop("w0"), "different paths"),
    ],
)
def test_old_shards_that_do_not_tile_are_inconsistent(change: Any, expected: str) -> None:
    layouts = _layouts_with(change)
    with pytest.raises(ShardsInconsistent, match=expected):
        plan_reshard(layouts, new_rank=0, new_world=2, targets=_target())


def test_a_moment_the_fresh_optimizer_lacks_sits_like_its_parameter() -> None:
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    moment = full * 0.5

    def stored(s: int) -> Any:
        state = state_on([full], [["shard", 0], ["shard", 1]], (2, 2), s)
        state["optim"] = {
            "w0": {"exp_avg": shard_on(moment, [["shard", 0], ["shard", 1]], (2, 2), s)}
        }
        return state

    layouts, tensors = save([stored(s) for s in range(4)])
    for q in range(2):
        # The caller's fresh optimizer holds no moment: only the parameter has a target.
        targets = targets_in(state_on([full], [["shard", 1]], (2,), q))
        plan = plan_reshard(layouts, new_rank=q, new_world=2, targets=targets)
        got = unflatten(
            plan.layout, assemble(plan, {s: dict(enumerate(t)) for s, t in enumerate(tensors)})
        )
        want = shard_on(moment, [["shard", 1]], (2,), q)
        assert got["optim"]["w0"]["exp_avg"].record() == want.record()
        assert tensor_bytes(got["optim"]["w0"]["exp_avg"].local) == tensor_bytes(want.local)


def test_a_missing_target_that_cannot_be_told_is_refused_naming_it() -> None:
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    layouts, _ = save(
        [state_on([full, full, full], [["shard", 0], ["shard", 1]], (2, 2), s) for s in range(4)]
    )
    # w0 and w1 were stored alike but sit two ways on the new mesh: where w2 goes is unknown.
    targets = {
        **targets_in({"model": {"w0": shard_on(full, [["shard", 0]], (2,), 0)}}),
        **targets_in({"model": {"w1": shard_on(full, [["shard", 1]], (2,), 0)}}),
    }
    with pytest.raises(ReshardError, match=r"\['model'\]\['w2'\]: it was saved on a mesh"):
        plan_reshard(layouts, new_rank=0, new_world=2, targets=targets)

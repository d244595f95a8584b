"""Elastic restore's core: the blobs of N old ranks -> what new rank q of M would have saved.

Old ranks' states are built as torch lays a global tensor out over N ranks (offsets and local
shapes from torch's own ``_compute_local_shape_and_global_offset``, on plain data), flattened,
planned and assembled for every new rank of M; the new shards must be exactly torch's shards of
the same global tensor for M ranks.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Shard as ShardPlacement

import tiercheck
from tests.codec._helpers import copy_tensor, random_tensor, tensor_bytes
from tests.helpers import one_rank_group
from tiercheck.codec import RawState, decode, encode_full, raw_digest, read_meta, snapshot
from tiercheck.codec.decode.rebuild import unflatten
from tiercheck.codec.encode.flatten import Layout, flatten, write_payload
from tiercheck.codec.format.dtensor import DTensorShard
from tiercheck.codec.format.dtypes import supported_dtypes
from tiercheck.codec.reshard.reshard import ReshardPlan, assemble, plan_reshard, torch_chunk
from tiercheck.errors import ConfigError, ReshardError, ShardsInconsistent, StateMismatch

WORLDS = st.integers(1, 6)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(torch.empty(tuple(shape), dtype=torch.uint8).stride())


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes with a last dimension of its element size (the other dimensions kept)."""
    return copy_tensor(t).unsqueeze(-1).view(torch.uint8)


def torch_layout(
    shape: tuple[int, ...], placement: Any, world: int, rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of ``rank`` as torch computes it on a 1-D mesh."""
    return _compute_local_shape_and_global_offset(shape, (world,), [rank], [placement])


def shard_of(
    full: torch.Tensor,
    placement: list[Any],
    world: int,
    rank: int,
    *,
    names: tuple[str, ...] | None = None,
) -> DTensorShard:
    """Old rank ``rank``'s stored DTensor of ``full`` placed ``placement`` on ``world`` ranks."""
    shape = tuple(full.shape)
    obj = Shard(placement[1]) if placement[0] == "shard" else Replicate()
    local_shape, offset = torch_layout(shape, obj, world, rank)
    local = full
    for d, (o, n) in enumerate(zip(offset, local_shape, strict=True)):
        local = local.narrow(d, o, n)
    return DTensorShard(
        local=copy_tensor(local),
        shape=shape,
        stride=contiguous_stride(shape),
        placements=(tuple(placement),),
        mesh=(world,),
        names=names,
        device="cpu",
        coord=(rank,),
        offset=tuple(offset),
    )


def save(states: Sequence[Any]) -> tuple[list[Layout], list[list[torch.Tensor]]]:
    layouts, tensors = [], []
    for state in states:
        layout, ts = flatten(state)
        layouts.append(layout)
        tensors.append([copy_tensor(t) for t in ts])
    return layouts, tensors


def restore(
    layouts: list[Layout],
    tensors: list[list[torch.Tensor]],
    new_rank: int,
    new_world: int,
    per_rank: Any = "refuse",
) -> tuple[ReshardPlan, Any]:
    """Plan and assemble, handing ``assemble`` only the tensors the plan wants, each with
    every byte outside its span (:attr:`ReshardPlan.spans`) scrambled: they must not be used."""
    plan = plan_reshard(layouts, new_rank=new_rank, new_world=new_world, per_rank=per_rank)
    assert set(plan.spans) == set(plan.sources)
    given_ = {
        s: {i: outside_scrambled(tensors[s][i], plan.spans[s, i]) for i in idx}
        for s, idx in plan.wanted.items()
    }
    out = assemble(plan, given_)
    assert [tuple(t.shape) for t in out] == [s.shape for s in plan.layout.specs]
    assert [t.dtype for t in out] == [s.dtype for s in plan.layout.specs]
    assert all(t.is_contiguous() for t in out)
    return plan, unflatten(plan.layout, out)


def outside_scrambled(t: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """A copy of ``t`` whose bytes (C order) outside ``span`` are 0xA5."""
    lo, hi = span
    assert 0 <= lo <= hi <= t.numel() * t.element_size()
    out = copy_tensor(t)
    flat = out.reshape(-1).unsqueeze(-1).view(torch.uint8).reshape(-1)
    flat[:lo] = 0xA5
    flat[hi:] = 0xA5
    return out


def refusal(
    layouts: list[Layout], tensors: list[list[torch.Tensor]], new_rank: int, new_world: int
) -> str | None:
    """The message of the ReshardError restoring ``new_rank`` raises (``None``: it restores)."""
    try:
        restore(layouts, tensors, new_rank, new_world)
    except ReshardError as exc:
        return str(exc)
    return None


def expect_shard(got: DTensorShard, full: torch.Tensor, placement: list[Any], q: int, m: int):
    want = shard_of(full, placement, m, q)
    assert got.mesh == (m,)
    assert got.coord == (q,)
    assert got.offset == want.offset
    assert got.shape == want.shape
    assert got.stride == want.stride
    assert got.placements == want.placements
    assert got.local.dtype == full.dtype
    assert tuple(got.local.shape) == tuple(want.local.shape)
    assert tensor_bytes(got.local) == tensor_bytes(want.local)


# --- torch's rule ----------------------------------------------------------------------------


def test_torch_chunk_is_torchs_rule() -> None:
    for length in range(23):
        for world in range(1, 9):
            for rank in range(world):
                offset, size = torch_chunk(length, world, rank)
                t_size, t_offset = ShardPlacement.local_shard_size_and_offset(length, world, rank)
                assert size == t_size, (length, world, rank)
                local, glob = torch_layout((length,), Shard(0), world, rank)
                assert (size,) == local, (length, world, rank)
                # compute_local_shape_and_global_offset puts an empty shard at the end;
                # local_shard_size_and_offset says min(rank * chunk, length): the same.
                assert (offset,) == glob, (length, world, rank)
                assert offset == t_offset, (length, world, rank)


# --- sharded and replicated DTensors ---------------------------------------------------------

DTYPES = st.sampled_from(supported_dtypes())


@st.composite
def tensor_cases(draw: st.DrawFn) -> tuple[torch.Tensor, list[Any]]:
    dtype = draw(DTYPES)
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
    full = random_tensor(dtype, shape, draw(st.integers(0, 2**16)))
    if shape and draw(st.booleans()):
        placement: list[Any] = ["shard", draw(st.integers(0, len(shape) - 1))]
    else:
        placement = ["replicate"]
    return full, placement


@given(case=tensor_cases(), n=WORLDS, m=WORLDS)
def test_every_new_rank_gets_torchs_shard(
    case: tuple[torch.Tensor, list[Any]], n: int, m: int
) -> None:
    full, placement = case
    plain = torch.arange(3, dtype=torch.int16)
    states = [
        {"w": shard_of(full, placement, n, s), "step": 7, "plain": plain.clone()} for s in range(n)
    ]
    layouts, tensors = save(states)
    pieces = []
    for q in range(m):
        plan, state = restore(layouts, tensors, q, m)
        expect_shard(state["w"], full, placement, q, m)
        assert state["step"] == 7
        assert tensor_bytes(state["plain"]) == tensor_bytes(plain)
        pieces.append(state["w"].local)
        # Only old ranks whose shard overlaps the new one are read for it.
        if placement[0] == "shard" and full.numel():
            d = placement[1]
            lo, size = torch_chunk(full.shape[d], m, q)
            for s in range(n):
                start, length = torch_chunk(full.shape[d], n, s)
                overlaps = length > 0 and size > 0 and start < lo + size and lo < start + length
                w_index = layouts[s].index["['w']"]
                assert (w_index in plan.wanted.get(s, ())) == overlaps, (s, q)
                if overlaps and d == 0:
                    # Of an old shard, exactly the rows the new one overlaps are read.
                    row = full[0].numel() * full.element_size()
                    first, last = max(lo, start), min(lo + size, start + length)
                    span = ((first - start) * row, (last - start) * row)
                    assert plan.spans[s, w_index] == span, (s, q)
    if placement[0] == "shard":
        # Put together as bytes: torch.cat allocates, which warns for complex32.
        whole = torch.cat([as_bytes(p) for p in pieces], dim=placement[1])
        assert torch.equal(whole, as_bytes(full))


def test_replicate_comes_from_old_rank_zero() -> None:
    full = torch.randn(4, 3)
    states = [{"r": shard_of(full, ["replicate"], 3, s)} for s in range(3)]
    layouts, tensors = save(states)
    for m in (1, 2, 5):
        for q in range(m):
            plan, state = restore(layouts, tensors, q, m)
            assert set(plan.wanted) == {0}
            expect_shard(state["r"], full, ["replicate"], q, m)


def test_zero_dim_and_empty_dtensors() -> None:
    scalar = torch.tensor(3.5, dtype=torch.float64)
    empty = torch.empty(0, 4)
    states = [
        {
            "s": shard_of(scalar, ["replicate"], 2, s),
            "e0": shard_of(empty, ["shard", 0], 2, s),
            "e1": shard_of(empty, ["shard", 1], 2, s),
        }
        for s in range(2)
    ]
    layouts, tensors = save(states)
    for q in range(3):
        _, state = restore(layouts, tensors, q, 3)
        expect_shard(state["s"], scalar, ["replicate"], q, 3)
        expect_shard(state["e0"], empty, ["shard", 0], q, 3)
        expect_shard(state["e1"], empty, ["shard", 1], q, 3)


def mixed_state(n: int, s: int, full: torch.Tensor, bias: torch.Tensor) -> Any:
    od: collections.OrderedDict[str, Any] = collections.OrderedDict(
        w=shard_of(full, ["shard", 0], n, s, names=("dp",))
    )
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {
        "model": od,
        "optim": {
            "state": {
                0: {"step": torch.tensor(4.0), "exp_avg": shard_of(full, ["shard", 1], n, s)}
            },
            "param_groups": [{"lr": 0.1, "params": [0], "betas": (0.9, 0.999)}],
        },
        "bias": (bias.clone(), shard_of(bias, ["replicate"], n, s)),
        "np": np.arange(5, dtype=np.float32),
        "name": "run-1",
        "big": 1 << 80,
        "dtype": torch.bfloat16,
    }


@pytest.mark.parametrize(("n", "m"), [(3, 2), (2, 5), (4, 4), (1, 3), (3, 1)])
def test_mixed_state(n: int, m: int) -> None:
    full = torch.randn(7, 5)
    bias = torch.randn(5)
    layouts, tensors = save([mixed_state(n, s, full, bias) for s in range(n)])
    for q in range(m):
        _, state = restore(layouts, tensors, q, m)
        expect_shard(state["model"]["w"], full, ["shard", 0], q, m)
        assert state["model"]["w"].names == ("dp",)
        assert state["model"]._metadata == {"": {"version": 1}}
        assert type(state["model"]) is collections.OrderedDict
        opt = state["optim"]["state"][0]
        expect_shard(opt["exp_avg"], full, ["shard", 1], q, m)
        assert tensor_bytes(opt["step"]) == tensor_bytes(torch.tensor(4.0))
        assert state["optim"]["param_groups"] == [{"lr": 0.1, "params": [0], "betas": (0.9, 0.999)}]
        assert type(state["bias"]) is tuple
        assert tensor_bytes(state["bias"][0]) == tensor_bytes(bias)
        expect_shard(state["bias"][1], bias, ["replicate"], q, m)
        np.testing.assert_array_equal(state["np"], np.arange(5, dtype=np.float32))
        assert (state["name"], state["big"], state["dtype"]) == ("run-1", 1 << 80, torch.bfloat16)


@pytest.mark.parametrize("per_rank", ["refuse", "wrap"])
def test_same_world_gives_back_each_ranks_own_blob(per_rank: str) -> None:
    n = 3
    full = torch.randn(8, 2)
    bias = torch.randn(2)
    states = [mixed_state(n, s, full, bias) for s in range(n)]
    if per_rank == "wrap":
        for s, state in enumerate(states):
            state["loader"] = {"position": 100 * s, "rng": torch.full((3,), s, dtype=torch.uint8)}
    layouts, tensors = save(states)
    for q in range(n):
        plan = plan_reshard(layouts, new_rank=q, new_world=n, per_rank=per_rank)  # type: ignore[arg-type]
        assert plan.layout == layouts[q]
        given_ = {s: {i: tensors[s][i] for i in idx} for s, idx in plan.wanted.items()}
        out = assemble(plan, given_)
        assert [tensor_bytes(t) for t in out] == [tensor_bytes(t) for t in tensors[q]]


# --- per-rank state --------------------------------------------------------------------------


def test_differing_skeleton_values_are_refused_naming_paths_and_ranks() -> None:
    states = [{"step": 5, "loader": {"pos": 10 * s, "epoch": 1}, "name": "a"} for s in range(3)]
    states[2]["name"] = "b"
    layouts, _ = save(states)
    with pytest.raises(ReshardError) as info:
        plan_reshard(layouts, new_rank=0, new_world=2)
    text = str(info.value)
    assert "old ranks 0 and 1 differ at ['loader']['pos']" in text
    assert "old ranks 0 and 2 differ at ['loader']['pos'], ['name']" in text
    assert "['step']" not in text
    assert "['epoch']" not in text
    assert "per_rank='wrap'" in text
    assert isinstance(info.value, StateMismatch)


def test_differing_structure_is_refused() -> None:
    layouts, _ = save([{"a": [1, 2]}, {"a": [1, 2, 3]}, {"b": 1}])
    with pytest.raises(ReshardError, match=r"length 2 against 3") as info:
        plan_reshard(layouts, new_rank=0, new_world=1)
    assert "old ranks 0 and 2 differ at the state (keys ['a'] against ['b'])" in str(info.value)


def test_keys_in_another_order_are_a_difference() -> None:
    layouts, _ = save([{"a": {"x": 1, "y": 2}}, {"a": {"y": 2, "x": 1}}])
    with pytest.raises(ReshardError, match=r"differ at \['a'\] \(the same keys in another order"):
        plan_reshard(layouts, new_rank=0, new_world=1)


def test_plain_tensor_specs_that_differ_are_refused_when_planning() -> None:
    layouts, _ = save([{"t": torch.zeros(3)}, {"t": torch.zeros(4)}])
    with pytest.raises(ReshardError, match=r"old ranks 0 and 1 differ at \['t'\] \(tensor\)"):
        plan_reshard(layouts, new_rank=0, new_world=3)


def test_float_values_compare_by_bits() -> None:
    nan = float("nan")
    layouts, _ = save([{"x": nan, "z": 0.0}, {"x": nan, "z": 0.0}])
    plan_reshard(layouts, new_rank=0, new_world=1)  # NaN equals itself bit for bit
    layouts, _ = save([{"z": 0.0}, {"z": -0.0}])
    with pytest.raises(ReshardError, match=r"\['z'\]"):
        plan_reshard(layouts, new_rank=0, new_world=1)


def test_differing_plain_tensor_values_are_refused_in_assemble() -> None:
    n, m = 4, 2
    states = [{"rng": torch.zeros(4, dtype=torch.uint8), "same": torch.ones(2)} for _ in range(n)]
    states[3]["rng"][1] = 9
    layouts, tensors = save(states)
    refusals = {q: refusal(layouts, tensors, q, m) for q in range(m)}
    # Old rank 3 holds no shards: new rank 3 % 2 reads it, and only it.
    assert refusals[0] is None
    text = refusals[1]
    assert text is not None
    assert "old ranks 0 and 3 hold different values at ['rng']" in text
    assert "['same']" not in text
    assert "per_rank='wrap'" in text


def test_nan_tensors_compare_by_bits() -> None:
    t = torch.tensor([float("nan"), -0.0])
    layouts, tensors = save([{"t": t.clone()}, {"t": t.clone()}])
    _, state = restore(layouts, tensors, 0, 1)
    assert tensor_bytes(state["t"]) == tensor_bytes(t)
    layouts, tensors = save([{"t": t.clone()}, {"t": torch.tensor([float("nan"), 0.0])}])
    with pytest.raises(ReshardError, match=r"\['t'\]"):
        restore(layouts, tensors, 0, 1)


def test_wrap_takes_per_rank_state_from_old_rank_q_mod_n() -> None:
    n = 3
    full = torch.randn(6, 2)
    states = [
        {
            "w": shard_of(full, ["shard", 0], n, s),
            "loader": {"position": 100 * s, "order": list(range(s + 1))},
            "rng": torch.full((4,), s, dtype=torch.uint8),
        }
        for s in range(n)
    ]
    layouts, tensors = save(states)
    with pytest.raises(ReshardError):
        plan_reshard(layouts, new_rank=0, new_world=2)
    for m in (1, 2, 5):
        for q in range(m):
            _, state = restore(layouts, tensors, q, m, per_rank="wrap")
            src = q % n
            assert state["loader"] == {"position": 100 * src, "order": list(range(src + 1))}
            rng = torch.full((4,), src, dtype=torch.uint8)
            assert tensor_bytes(state["rng"]) == tensor_bytes(rng)
            expect_shard(state["w"], full, ["shard", 0], q, m)


@given(
    n=WORLDS,
    m=WORLDS,
    length=st.integers(0, 8),
    kind=st.sampled_from(["none", "shard", "replicate"]),
)
def test_every_old_rank_is_read_and_compared_by_some_new_rank(
    n: int, m: int, length: int, kind: str
) -> None:
    def state(s: int, odd: int | None) -> Any:
        out: dict[str, Any] = {"rng": torch.full((2,), 1 if s == odd else 0, dtype=torch.uint8)}
        if kind != "none":
            full = torch.arange(length * 2, dtype=torch.float32).reshape(length, 2)
            out["w"] = shard_of(full, [kind, 0] if kind == "shard" else [kind], n, s)
        return out

    layouts, tensors = save([state(s, None) for s in range(n)])
    plans = [plan_reshard(layouts, new_rank=q, new_world=m) for q in range(m)]
    assert set().union(*(p.wanted for p in plans)) == set(range(n))
    # Whichever old rank differs, some new rank notices.
    for odd in range(1, n):
        layouts, tensors = save([state(s, odd) for s in range(n)])
        texts = [t for q in range(m) if (t := refusal(layouts, tensors, q, m)) is not None]
        assert texts, odd
        for text in texts:
            assert f"old ranks 0 and {odd} hold different values at ['rng']" in text


# --- layouts that cannot be resharded --------------------------------------------------------


def with_record(n: int, change: Any) -> list[Layout]:
    """Layouts of ``n`` old ranks holding a sharded DTensor whose record ``change`` edits."""
    full = torch.randn(6, 4)
    states = []
    for s in range(n):
        shard = shard_of(full, ["shard", 0], n, s)
        states.append({"w": change(s, shard)})
    return save(states)[0]


def replace(shard: DTensorShard, **fields: Any) -> DTensorShard:
    import dataclasses

    return dataclasses.replace(shard, **fields)


SUPPORTED = "Shard(d) or Replicate()"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda s, sh: replace(sh, placements=(("partial", "sum"),)), "['partial', 'sum']"),
        (
            lambda s, sh: replace(sh, placements=(("strided_shard", 0, 2),)),
            "['strided_shard', 0, 2]",
        ),
        (
            lambda s, sh: replace(
                sh, placements=(("shard", 0), ("replicate",)), mesh=(2, 1), coord=(s, 0)
            ),
            "mesh of shape (2, 1)",
        ),
        # A DTensor on a 1-D mesh smaller than the saving world (tensor parallelism inside a
        # data-parallel group) is a layout tiercheck does not reshard.
        (lambda s, sh: replace(sh, mesh=(1,), coord=(0,)), "mesh of 1 ranks, but 2 ranks saved"),
        (lambda s, sh: replace(sh, placements=(("shard", 5),)), "sharded on dimension 5"),
    ],
)
def test_unsupported_layouts_are_refused(change: Any, expected: str) -> None:
    layouts = with_record(2, change)
    with pytest.raises(ReshardError) as info:
        plan_reshard(layouts, new_rank=0, new_world=3)
    text = str(info.value)
    assert expected in text
    assert "['w']" in text
    assert SUPPORTED in text
    assert "Restore on the number of ranks that saved it" in text


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda s, sh: replace(sh, shape=(6, 5)) if s == 1 else sh, "disagree on its layout"),
        (lambda s, sh: replace(sh, stride=(1, 6)) if s == 1 else sh, "disagree on its layout"),
        (
            lambda s, sh: replace(sh, local=sh.local.double()) if s == 1 else sh,
            "disagree on its layout",
        ),
        # Overlapping shards, a gap, and a shard that does not span a whole dimension.
        (lambda s, sh: replace(sh, offset=(2, 0)) if s == 1 else sh, "do not cover"),
        (lambda s, sh: replace(sh, local=sh.local[:2]) if s == 1 else sh, "up to 5 of 6"),
        (lambda s, sh: replace(sh, local=sh.local[:, :3]) if s == 1 else sh, "not one a 1-D"),
        (lambda s, sh: replace(sh, offset=(5, 0)) if s == 1 else sh, "not one a 1-D"),
        # No rank of a save sits on a mesh larger than the save's world: the record of which
        # world saved the version does not fit the blobs.
        (lambda s, sh: replace(sh, mesh=(3,)), "mesh of 3 ranks, but 2 ranks are recorded"),
    ],
)
def test_inconsistent_old_blobs_are_refused(change: Any, expected: str) -> None:
    layouts = with_record(2, change)
    # ShardsInconsistent: the version cannot be rebuilt on any world, and a restore passes over
    # it to an older one (a ReshardError still, for callers that catch that).
    with pytest.raises(ShardsInconsistent, match=r"\['w'\]") as info:
        plan_reshard(layouts, new_rank=0, new_world=3, per_rank="wrap")
    assert expected in str(info.value)
    assert "restore another version" in str(info.value)


def test_a_dtensor_missing_on_one_old_rank_is_refused() -> None:
    full = torch.randn(4)
    states: list[Any] = [{"w": shard_of(full, ["shard", 0], 2, s)} for s in range(2)]
    states[1] = {"w": states[1]["w"].local}
    layouts, _ = save(states)
    for per_rank in ("refuse", "wrap"):
        with pytest.raises(ReshardError, match=r"DTensors at different paths \(\[\"\['w'\]\"\]\)"):
            plan_reshard(layouts, new_rank=0, new_world=1, per_rank=per_rank)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    layouts, _ = save([{"t": torch.ones(2)}])
    with pytest.raises(ConfigError):
        plan_reshard([], new_rank=0, new_world=1)
    with pytest.raises(ConfigError):
        plan_reshard(layouts, new_rank=2, new_world=2)
    with pytest.raises(ConfigError):
        plan_reshard(layouts, new_rank=0, new_world=0)
    with pytest.raises(ConfigError):
        plan_reshard(layouts, new_rank=0, new_world=1, per_rank="guess")  # type: ignore[arg-type]
    plan = plan_reshard(layouts, new_rank=0, new_world=1)
    with pytest.raises(ValueError, match="needs tensor 0 of old rank 0"):
        assemble(plan, {})
    with pytest.raises(ValueError, match="its layout says"):
        assemble(plan, {0: {0: torch.ones(3)}})


def test_reshard_error_is_public() -> None:
    assert tiercheck.ReshardError is ReshardError
    assert "ReshardError" in tiercheck.__all__
    assert issubclass(ReshardError, StateMismatch)


def test_malformed_dtensor_record_is_a_format_error() -> None:
    layouts, _ = save([{"w": shard_of(torch.ones(2), ["shard", 0], 1, 0)}])
    tree = msgpack.unpackb(layouts[0].skeleton, strict_map_key=False)
    assert isinstance(tree["w"], msgpack.ExtType)
    bad = msgpack.packb({"w": msgpack.ExtType(tree["w"].code, msgpack.packb([0, "x"]))})
    broken = Layout(bad, layouts[0].specs, layouts[0].payload_nbytes)
    with pytest.raises(tiercheck.FormatError):
        plan_reshard([broken], new_rank=0, new_world=1)


# --- a real DTensor --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    with one_rank_group():
        yield


def test_a_real_dtensors_record_reshards_as_torch_lays_it_out(group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    full = torch.randn(5, 3)
    state = {
        "w": distribute_tensor(full, mesh, [Shard(1)]),
        "r": distribute_tensor(full, mesh, [Replicate()]),
    }
    layout, tensors = flatten(state)
    stored = unflatten(layout, tensors)
    assert stored["w"].record() == {
        "shape": [5, 3],
        "stride": [3, 1],
        "placements": [["shard", 1]],
        "mesh": [1],
        "names": ["dp"],
        "device": "cpu",
        "coord": [0],
        "offset": [0, 0],
    }
    assert plan_reshard([layout], new_rank=0, new_world=1).layout == layout
    for m in (2, 3, 4):
        for q in range(m):
            _, new = restore([layout], [[t.clone() for t in tensors]], q, m)
            local, offset = torch_layout((5, 3), Shard(1), m, q)
            assert new["w"].offset == offset
            assert tuple(new["w"].local.shape) == local
            assert new["w"].names == ("dp",)
            assert tensor_bytes(new["w"].local) == tensor_bytes(full[:, offset[1] :][:, : local[1]])
            assert new["r"].offset == (0, 0)
            assert tensor_bytes(new["r"].local) == tensor_bytes(full)


def test_from_blob_headers_to_a_blob_of_the_new_rank() -> None:
    """Plan from headers alone (read_meta), assemble from decoded payloads, and the result is
    a state the new rank could have saved itself: a canonical layout that encodes and decodes."""
    n, m = 3, 2
    full = torch.randn(7, 5)
    bias = torch.randn(5)
    blobs = []
    for s in range(n):
        raw = snapshot(mixed_state(n, s, full, bias), version=4)
        parts, _ = encode_full(raw, rank=s)
        blobs.append(b"".join(bytes(p) for p in parts))
    layouts = [read_meta(blob).layout for blob in blobs]
    for q in range(m):
        plan = plan_reshard(layouts, new_rank=q, new_world=m)
        old = {s: dict(enumerate(decode(blobs[s]).tensors())) for s in plan.wanted}
        given_ = {s: {i: old[s][i] for i in idx} for s, idx in plan.wanted.items()}
        tensors = assemble(plan, given_)
        assert plan.layout.is_canonical()
        assert plan.layout.has_dtensors
        dest = torch.empty(plan.layout.payload_nbytes, dtype=torch.uint8)
        write_payload(plan.layout, tensors, dest)
        mine = RawState(4, plan.layout, dest, raw_digest(dest))
        parts, _ = encode_full(mine, rank=q)
        state = decode(b"".join(bytes(p) for p in parts)).state()
        expect_shard(state["model"]["w"], full, ["shard", 0], q, m)
        expect_shard(state["optim"]["state"][0]["exp_avg"], full, ["shard", 1], q, m)
        assert tensor_bytes(state["bias"][0]) == tensor_bytes(bias)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("key", ["offset", "mesh", "stride"])
def test_a_record_missing_a_field_is_a_format_error(rank: int, key: str) -> None:
    from tiercheck.codec.format import skeleton as sk

    layouts = save([{"w": shard_of(torch.ones(4), ["shard", 0], 2, s)} for s in range(2)])[0]
    tree = sk.read_tree(layouts[rank].skeleton)
    del tree["w"].record[key]
    skeleton = sk.write_tree(tree, lambda d: d)
    layouts[rank] = Layout(skeleton, layouts[rank].specs, layouts[rank].payload_nbytes)
    with pytest.raises(tiercheck.FormatError, match=rf"malformed DTensor record at \['w'\].*{key}"):
        plan_reshard(layouts, new_rank=0, new_world=1)

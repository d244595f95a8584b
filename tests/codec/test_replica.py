"""The replica reference (skeleton extension 13, ``tiercheck.flatten/3``) and its resolution.

A rank that is not its node's first stores :class:`ReplicaRef` in place of replicated state;
:func:`resolve` puts the storing rank's values back at those paths, giving exactly the layout
the rank would have flattened whole.
"""

from __future__ import annotations

import collections
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from tiercheck.codec import decode, encode_full, encode_packed, flatten, read_meta, snapshot
from tiercheck.codec.dtensor import DTensorShard
from tiercheck.codec.flatten import _EXT_REPLICA, Layout, ReplicaRef, replicated_record
from tiercheck.codec.plan import Planner
from tiercheck.codec.rebuild import unflatten
from tiercheck.codec.replica import referenced, resolve, resolve_all, take
from tiercheck.errors import FormatError


def bias(rank: int, world: int, *, mesh: int | None = None) -> DTensorShard:
    return DTensorShard(
        local=torch.arange(5, dtype=torch.float64),
        shape=(5,),
        stride=(1,),
        placements=(("replicate",),),
        mesh=(world if mesh is None else mesh,),
        names=("dp",),
        device="cpu",
        coord=(rank,),
        offset=(0,),
    )


def model() -> collections.OrderedDict[str, Any]:
    od: collections.OrderedDict[str, Any] = collections.OrderedDict(
        w=torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
        steps=(torch.tensor(7), np.arange(3, dtype=np.int16), {"lr": 0.1}),
    )
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return od


def whole(rank: int) -> dict[str, Any]:
    """What rank ``rank`` holds: a replicated model, its own tensor, numbers."""
    return {"model": model(), "own": torch.full((2,), float(rank)), "step": 3, "b": bias(rank, 4)}


def stored(rank: int) -> dict[str, Any]:
    """What rank ``rank`` hands to flatten when rank 0 stores the replicated model."""
    state = whole(rank)
    if rank:
        state["model"] = ReplicaRef(0)
    return state


def flat(rank: int) -> tuple[Layout, list[torch.Tensor]]:
    return flatten(stored(rank), replica=ReplicaRef(0) if rank else None, world_size=4)


def test_a_reference_takes_no_tensor_and_names_flatten_3() -> None:
    layout0, _ = flat(0)
    layout1, tensors1 = flat(1)
    assert not layout0.has_refs
    assert layout1.has_refs
    # Rank 1 keeps its own tensor only: the model and the replicated DTensor are references.
    assert [s.path for s in layout1.specs] == ["['own']"]
    assert len(layout0.specs) == 5
    assert encode_full(snapshot(stored(1), version=0), rank=1)[1].stages == ("tiercheck.flatten/3",)
    # A layout built from its skeleton alone finds the reference by a scan.
    assert Layout(layout1.skeleton, layout1.specs, layout1.payload_nbytes).has_refs
    assert not Layout(layout0.skeleton, layout0.specs, layout0.payload_nbytes).has_refs
    assert referenced(layout1) == {0}
    assert referenced(layout0) == set()
    # Unresolved, a reference comes back as one (what `inspect` shows).
    state = unflatten(layout1, tensors1)
    assert state["model"] == ReplicaRef(0)
    assert state["b"] == ReplicaRef(0, bias(1, 4).record())


def test_resolving_gives_exactly_the_whole_layout() -> None:
    layout0, tensors0 = flat(0)
    layout1, tensors1 = flat(1)
    resolved = resolve(layout1, 1, {0: layout0})
    expected, expected_tensors = flatten(whole(1))
    assert resolved.layout.skeleton == expected.skeleton
    assert resolved.layout.specs == expected.specs
    assert not resolved.layout.has_refs
    got = take(resolved, {0: tensors0, 1: tensors1})
    assert len(got) == len(expected_tensors)
    for a, b in zip(got, expected_tensors, strict=True):
        assert torch.equal(a, b)
    state = unflatten(resolved.layout, got)
    assert state["model"]._metadata == {"": {"version": 1}}
    assert state["b"].coord == (1,)  # this rank's record; the bytes rank 0's
    assert state["own"] is tensors1[0]
    # A layout without references is its own.
    assert resolve(layout0, 0, {}).layout is layout0


def test_resolve_all_resolves_every_rank_of_a_save() -> None:
    layouts = [flat(r)[0] for r in range(4)]
    for r, resolved in enumerate(resolve_all(layouts)):
        assert resolved.layout.skeleton == flatten(whole(r))[0].skeleton


def test_blobs_with_references_round_trip_full_and_as_deltas() -> None:
    state1 = stored(1) | {"b": ReplicaRef(0, bias(1, 4).record())}  # stored as they are
    base = snapshot(state1, version=0)
    parts, meta = encode_full(base, rank=1)
    blob = b"".join(bytes(p) for p in parts)
    assert read_meta(blob).layout.has_refs
    raw = decode(blob)
    assert unflatten(raw.layout, raw.tensors())["model"] == ReplicaRef(0)
    later = dict(state1)
    later["own"] = later["own"] + 1
    parts, meta = encode_packed(snapshot(later, version=1), rank=1, base=base)
    assert meta.stages[0] == "tiercheck.flatten/3"
    raw = decode(b"".join(bytes(p) for p in parts), base=base)
    state = unflatten(raw.layout, raw.tensors())
    assert torch.equal(state["own"], later["own"])
    assert state["b"] == ReplicaRef(0, bias(1, 4).record())


def test_only_dtensors_replicated_over_the_whole_world_become_references() -> None:
    assert replicated_record(bias(0, 4).record(), 4)
    assert not replicated_record(bias(0, 4, mesh=2).record(), 4)
    sharded = bias(0, 4).record() | {"placements": [["shard", 0]]}
    assert not replicated_record(sharded, 4)
    assert not replicated_record({"placements": "x"}, 4)
    state = {"small": bias(1, 4, mesh=2), "all": bias(1, 4)}
    layout, _ = flatten(state, replica=ReplicaRef(0), world_size=4)
    assert [s.path for s in layout.specs] == ["['small']"]
    # The first rank (no replica given) stores both.
    assert len(flatten(state, world_size=4)[0].specs) == 2


def test_the_cached_plan_stores_references_like_flatten() -> None:
    planner = Planner(replica=ReplicaRef(0), world_size=4)
    first = planner.flatten(stored(1))
    again = stored(1)
    again["step"] = 4  # a value changed: the plan re-encodes it around the references
    second = planner.flatten(again)
    assert (first.reused, second.reused) == (False, True)
    for state, got in ((stored(1), first), (again, second)):
        expected, _ = flatten(state, replica=ReplicaRef(0), world_size=4)
        assert got.layout.skeleton == expected.skeleton
        assert got.layout.specs == expected.specs
        assert got.layout.has_refs
    # The replicated DTensor changing its layout is a new structure.
    moved = stored(1)
    moved["b"] = bias(2, 4)
    assert not planner.flatten(moved).reused


def test_references_that_do_not_fit_are_format_errors() -> None:
    layout0, _ = flat(0)
    layout1, _ = flat(1)
    with pytest.raises(FormatError, match=r"refers to rank 0's blob .* not given"):
        resolve(layout1, 1, {})
    other, _ = flatten({"own": torch.ones(2)})
    with pytest.raises(FormatError, match="does not hold"):
        resolve(layout1, 1, {0: other})
    # The storing rank holds a plain tensor where a DTensor is referred to.
    plain = whole(0)
    plain["b"] = torch.arange(5, dtype=torch.float64)
    with pytest.raises(FormatError, match="holds something else"):
        resolve(layout1, 1, {0: flatten(plain)[0]})
    # A storing blob that holds a reference itself.
    with pytest.raises(FormatError, match="holds a reference itself"):
        resolve(layout1, 1, {0: flat(2)[0]})
    bad = msgpack.packb({"x": msgpack.ExtType(_EXT_REPLICA, b"\xc1")})
    with pytest.raises(FormatError, match="malformed replica reference"):
        resolve(Layout.build(bad, []), 1, {0: layout0})

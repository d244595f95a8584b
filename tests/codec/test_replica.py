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
from tiercheck.codec.decode.rebuild import unflatten
from tiercheck.codec.encode.flatten import Layout, ReplicaRef, replicated_record
from tiercheck.codec.encode.plan import Planner
from tiercheck.codec.format.dtensor import DTensorShard
from tiercheck.codec.format.skeleton import EXT_REPLICA
from tiercheck.codec.replica import lean, referenced, resolve, resolve_all, skeleton_steps, take
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
    # A storing blob that refers to itself, or references that go round in a circle.
    with pytest.raises(FormatError, match="rank 0's blob refers to itself"):
        resolve(layout1, 1, {0: flat(2)[0]})
    leans = {r: _lean_of(r, store=1) for r in (0, 2)}  # rank 0 and 2 refer to 1
    with pytest.raises(FormatError, match=r"ranks \[1, 0\] .* go round in a circle"):
        resolve(layout1, 1, {0: leans[0]})
    bad = msgpack.packb({"x": msgpack.ExtType(EXT_REPLICA, b"\xc1")})
    with pytest.raises(FormatError, match="malformed replica reference"):
        resolve(Layout.build(bad, []), 1, {0: layout0})


# --- storing once in all: a node's first rank refers on to rank 0 in durable tiers --------


def _lean_of(rank: int, *, store: int = 0) -> Layout:
    """Rank ``rank``'s whole layout made lean: its model and replicated DTensor refer to
    ``store``."""
    made = lean(flatten(whole(rank))[0], [skeleton_steps(["model"])], store, 4)
    assert made is not None
    return made.layout


def test_a_lean_layout_is_what_a_referring_rank_flattens() -> None:
    full, _ = flatten(whole(2), world_size=4)
    made = lean(full, [skeleton_steps(["model"])], 0, 4)
    assert made is not None
    # Exactly what rank 2 would flatten had it referred to rank 0 itself.
    expected, expected_tensors = flatten(stored(2), replica=ReplicaRef(0), world_size=4)
    assert made.layout.skeleton == expected.skeleton
    assert made.layout.specs == expected.specs
    assert made.layout.has_refs
    assert [full.specs[j].path for j in made.keep] == ["['own']"]
    # The lean payload holds the kept tensors' bytes, padding zero.
    payload = snapshot(whole(2), version=0).payload
    lean_payload = made.payload(full, payload)
    assert lean_payload.numel() == made.layout.payload_nbytes
    views = made.layout.views(lean_payload)
    for a, b in zip(views, expected_tensors, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        lean_payload,
        snapshot(stored(2) | {"b": ReplicaRef(0, bias(2, 4).record())}, version=0).payload,
    )
    # Nothing replicated: nothing to make lean.
    assert lean(flatten({"own": torch.ones(2)})[0], [], 0, 4) is None
    # A DTensor replicated over all ranks is replaced without being named.
    only_dtensor = lean(full, [], 0, 4)
    assert only_dtensor is not None
    assert [full.specs[j].path for j in only_dtensor.keep] == [
        s.path for s in full.specs if s.path != "['b']"
    ]


def test_steps_the_skeleton_does_not_hold_make_nothing_lean() -> None:
    full, _ = flatten(whole(2), world_size=4)
    with pytest.raises(ValueError, match=r"no value at \[\"state\['nope'\]\"\]"):
        lean(full, [skeleton_steps(["nope"])], 0, 4)
    # Deeper steps, tuples, an ordered dict's keys and big integers are found as flattened.
    state = {
        (1, "a"): {"x": [torch.ones(1), torch.zeros(2)]},
        1 << 70: torch.ones(3),
        "od": model(),
    }
    full, _ = flatten(state)
    steps = [skeleton_steps(k) for k in ([(1, "a"), "x", 1], [1 << 70], ["od", "w"])]
    made = lean(full, steps, 0, 1)
    assert made is not None
    kept = [full.specs[j].path for j in made.keep]
    assert kept == ["[(1, 'a')]['x'][0]", "['od']['steps'][0]", "['od']['steps'][1]"]
    assert skeleton_steps([object()]) is None


def test_references_are_followed_through_a_node_first_ranks_lean_blob() -> None:
    """4 ranks on 2 nodes of 2: rank 3 refers to rank 2 (its node's first), whose durable
    blob refers to rank 0: rank 3 resolves to exactly what it would have flattened whole."""
    layout0, tensors0 = flat(0)
    full2, _ = flatten(whole(2), world_size=4)
    made = lean(full2, [skeleton_steps(["model"])], 0, 4)
    assert made is not None
    lean_tensors = made.layout.views(made.payload(full2, snapshot(whole(2), version=0).payload))
    stored3 = whole(3) | {"model": ReplicaRef(2)}
    layout3, tensors3 = flatten(stored3, replica=ReplicaRef(2), world_size=4)
    resolved = resolve(layout3, 3, {2: made.layout, 0: layout0})
    expected, expected_tensors = flatten(whole(3))
    assert resolved.layout.skeleton == expected.skeleton
    assert resolved.layout.specs == expected.specs
    assert {r for r, _ in resolved.sources} == {0, 3}  # nothing comes from rank 2's blob
    got = take(resolved, {0: tensors0, 2: lean_tensors, 3: tensors3})
    for a, b in zip(got, expected_tensors, strict=True):
        assert torch.equal(a, b)
    assert unflatten(resolved.layout, got)["b"].coord == (3,)
    # Rank 2 itself resolves against rank 0; resolve_all does every rank at once.
    layouts = [layout0, flat(1)[0], made.layout, layout3]
    for r, done in enumerate(resolve_all(layouts)):
        assert done.layout.skeleton == flatten(whole(r))[0].skeleton
    # Without rank 0's layout the chain cannot end.
    with pytest.raises(FormatError, match="rank 0's blob of the same version, which was not"):
        resolve(layout3, 3, {2: made.layout})

"""The skeleton format's one home: its tags, the tree of a stored skeleton and the walk over it.

Expected values are written out by hand (paths, tag numbers, the order of leaves), never taken
from the code under test.
"""

from __future__ import annotations

import collections
from typing import Any

import msgpack
import numpy as np
import torch

from tiercheck.codec import flatten, unflatten
from tiercheck.codec.encode.flatten import ReplicaRef
from tiercheck.codec.format import skeleton as sk
from tiercheck.codec.format.dtensor import DTensorShard


def shard() -> DTensorShard:
    return DTensorShard(
        local=torch.arange(2, dtype=torch.float32),
        shape=(4,),
        stride=(1,),
        placements=(("shard", 0),),
        mesh=(2,),
        names=("dp",),
        device="cpu",
        coord=(1,),
        offset=(2,),
    )


def state() -> dict[Any, Any]:
    od: collections.OrderedDict[str, Any] = collections.OrderedDict(w=torch.ones(2), n=1)
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {
        "model": od,
        "pair": (torch.zeros(3), 1 << 70),
        (1, "k"): [np.arange(2, dtype=np.int8), torch.float16, torch.device("cpu")],
        "dt": shard(),
        "ref": ReplicaRef(0),
        "misc": [2.5 + 1j, bytearray(b"ab"), torch.Size([2, 3])],
    }


def test_the_tags_are_the_stored_numbers() -> None:
    # Part of the on-disk format: a renumbered tag would misread every blob written before.
    tags = (
        sk.EXT_TENSOR,
        sk.EXT_TUPLE,
        sk.EXT_ODICT,
        sk.EXT_SIZE,
        sk.EXT_BIGINT,
        sk.EXT_NDARRAY,
        sk.EXT_COMPLEX,
        sk.EXT_DTYPE,
        sk.EXT_DEVICE,
        sk.EXT_BYTEARRAY,
        sk.EXT_PICKLE,
        sk.EXT_DTENSOR,
        sk.EXT_REPLICA,
    )
    assert tags == tuple(range(1, 14))
    assert (sk.INT_MIN, sk.INT_MAX) == (-(2**63), 2**64 - 1)
    assert sk.encode_int(2**64 - 1) == 2**64 - 1
    assert sk.encode_int(2**64) == msgpack.ExtType(5, b"\x00\x00\x00\x00\x00\x00\x00\x00\x01")
    assert sk.encode_int(-(2**63) - 1) == msgpack.ExtType(
        5, b"\xff\xff\xff\xff\xff\xff\xff\x7f\xff"
    )


def test_a_tree_packs_back_to_the_same_bytes_and_lists_its_tags() -> None:
    layout, tensors = flatten(state())
    tree = sk.read_tree(layout.skeleton)
    assert sk.write_tree(tree) == layout.skeleton
    assert sk.write_tree(tree, lambda d: d) == layout.skeleton
    assert type(tree["model"]) is sk.ODict
    assert tree["model"].meta == {"": {"version": 1}}
    assert type(tree["pair"]) is sk.Tuple
    assert sk.Tuple((1, "k")) in tree
    assert type(tree["dt"]) is sk.DTensorNode
    assert tree["dt"].index == 3  # after w, pair[0] and the array
    assert sk.ext_codes(layout.skeleton) == frozenset(range(1, 14)) - {sk.EXT_PICKLE}
    assert sk.ext_codes(b"\xc1") == frozenset()  # malformed: no tags
    # unpack with a hook is the way back (what unflatten walks with).
    rebuilt = unflatten(layout, tensors)
    assert rebuilt["pair"][1] == 1 << 70
    assert rebuilt["misc"][0] == 2.5 + 1j


class Record(sk.Walker[str]):
    """Records every leaf with its steps and the context it was walked under."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[Any, ...], Any, str]] = []

    def leaf(self, node: Any, steps: list[Any], ctx: str) -> Any:
        self.seen.append((tuple(steps), node, ctx))
        return ("leaf", node) if type(node) is int else node


def test_the_walker_visits_every_leaf_with_its_steps_and_rebuilds_the_tree() -> None:
    od = sk.ODict({"a": 1}, {"v": 2})
    tree = {"x": [3, sk.Tuple((4, od))], "y": 5}
    walker = Record()
    out = walker.walk(tree, [], "mine")
    assert walker.seen == [
        (("x", 0), 3, "mine"),
        (("x", 1, 0), 4, "mine"),
        (("x", 1, 1, "a"), 1, "mine"),
        (("x", 1, 1, sk.META, "v"), 2, "mine"),
        (("y",), 5, "mine"),
    ]
    assert out == {
        "x": [
            ("leaf", 3),
            sk.Tuple((("leaf", 4), sk.ODict({"a": ("leaf", 1)}, {"v": ("leaf", 2)}))),
        ],
        "y": ("leaf", 5),
    }
    assert tree == {"x": [3, sk.Tuple((4, od))], "y": 5}  # the input is left alone


def test_an_overridden_walk_intercepts_a_node_before_it_is_entered() -> None:
    class Stop(Record):
        def walk(self, node: Any, steps: list[Any], ctx: str) -> Any:
            if steps == ["x"]:
                return "cut"
            return super().walk(node, steps, ctx)

    walker = Stop()
    assert walker.walk({"x": [1, 2], "y": [3]}, [], "c") == {"x": "cut", "y": [("leaf", 3)]}
    assert [s for s, _, _ in walker.seen] == [("y", 0)]


def test_a_visiting_walker_sees_the_same_leaves_and_builds_nothing() -> None:
    class Visit(Record):
        rebuild = False

    tree = {"x": [3, sk.Tuple((4, sk.ODict({"a": 1}, None)))]}
    walker = Visit()
    assert walker.walk(tree, [], "c") is None
    assert [(s, n) for s, n, _ in walker.seen] == [
        (("x", 0), 3),
        (("x", 1, 0), 4),
        (("x", 1, 1, "a"), 1),
        (("x", 1, 1, sk.META), None),
    ]


def test_leaves_come_in_skeleton_order_keys_included() -> None:
    tree = {sk.Tuple((7, 8)): [9, sk.Tuple((10,))], "z": sk.ODict({"m": 11}, 12)}
    ints = sk.leaves(tree, lambda n: type(n) is int)
    assert ints == [7, 8, 9, 10, 11, 12]
    # Only leaves are offered: a container is entered, never kept whole.
    assert sk.leaves(tree, lambda n: type(n) in (sk.Tuple, sk.ODict, dict, list)) == []


def test_child_and_where_follow_and_name_a_path() -> None:
    tree = {"a": sk.ODict({"b": [1, 2]}, {"m": 3}), ("t",): 4}
    node: Any = tree
    for step in ["a", "b", 1]:
        node = sk.child(node, step)
    assert node == 2
    assert sk.child(sk.child(tree["a"], sk.META), "m") == 3
    assert sk.child(tree, "nope") is sk.MISSING
    assert sk.child(tree, ["unhashable"]) is sk.MISSING
    for node, step in (([1], 1), ([1], True), (5, 0), ({}, sk.META)):
        assert sk.child(node, step) is sk.MISSING
    assert sk.where(["a", sk.META, 0]) == "state['a']._metadata[0]"


def test_differences_name_every_differing_path() -> None:
    a = {"k": [1, 2.0, sk.Tuple((0.0,))], "o": sk.ODict({"x": 1}, None), "d": sk.DTensorNode(0, {})}
    b = {
        "k": [1, 2.0, sk.Tuple((-0.0,))],
        "o": sk.ODict({"x": 1}, {"m": 1}),
        "d": sk.DTensorNode(1, {}),
    }
    assert sk.differences(a, a) == []
    assert sk.differences(a, b) == ["['k'][2][0]", "['o']._metadata", "['d']"]
    assert sk.differences({"a": 1, "b": 2}, {"b": 2, "a": 1}) == [
        "the state (the same keys in another order)"
    ]
    assert sk.differences([1], [1, 2]) == [" (length 1 against 2)"]

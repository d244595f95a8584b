"""Layouts: sizes and offsets computed over arrays match the definition; a header's tensor table
is checked column by column and still names the first bad entry."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercheck.codec import encode_full, encode_packed, read_meta, snapshot
from tiercheck.codec.encode.plan import Planner
from tiercheck.codec.format.blobformat import layout_bytes
from tiercheck.codec.format.layout import ALIGNMENT, Layout, TensorSpec
from tiercheck.codec.format.layout import layout_from_header as _layout_from_obj
from tiercheck.errors import FormatError, UnsupportedFormat

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.complex128, torch.bool]


def by_definition(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> Layout:
    """Each tensor at the next multiple of ALIGNMENT after the one before, in Python ints."""
    specs = []
    end = 0
    for path, dtype, shape in entries:
        offset = -(-end // ALIGNMENT) * ALIGNMENT
        numel = 1
        for d in shape:
            numel *= d
        specs.append(TensorSpec(path, dtype, shape, offset, numel * dtype.itemsize))
        end = offset + numel * dtype.itemsize
    return Layout(b"", tuple(specs), -(-end // ALIGNMENT) * ALIGNMENT)


entry_lists = st.lists(
    st.tuples(
        st.sampled_from(DTYPES),
        st.lists(st.integers(0, 9), max_size=4).map(tuple),
    ),
    max_size=40,
).map(lambda es: [(f"['t{i}']", dtype, shape) for i, (dtype, shape) in enumerate(es)])


@settings(max_examples=200, deadline=None)
@given(entry_lists)
def test_build_places_every_tensor_where_the_definition_does(entries: Any) -> None:
    built = Layout.build(b"", entries)
    assert built == by_definition(entries)
    assert all(type(s.shape) is tuple and type(s.offset) is int for s in built.specs)
    assert built.is_canonical()
    # Read back from the bytes a header holds: the same layout.
    assert _layout_from_obj(msgpack.unpackb(layout_bytes(built))) == built


def test_sizes_past_int64_are_computed_exactly() -> None:
    huge = [("['a']", torch.float64, (1 << 40, 1 << 40)), ("['b']", torch.int8, (3,))]
    assert Layout.build(b"", huge) == by_definition(huge)
    past = [("['a']", torch.int8, (1 << 70,)), ("['b']", torch.int8, (3,))]
    assert Layout.build(b"", past) == by_definition(past)


def test_a_tensor_spec_is_a_named_record() -> None:
    spec = TensorSpec("['w']", torch.float32, (2, 3), 64, 24)
    assert (spec.path, spec.dtype, spec.shape, spec.offset, spec.nbytes) == tuple(spec)
    with pytest.raises(AttributeError):
        spec.offset = 0  # type: ignore[misc]


GOOD = ["['a']", "float32", [2, 3]]


@pytest.mark.parametrize(
    "bad",
    [
        ("not a list", "['a']"),
        ("two fields", ["['a']", "float32"]),
        ("four fields", ["['a']", "float32", [1], 0]),
        ("path not str", [b"['a']", "float32", [1]]),
        ("dtype not str", ["['a']", 7, [1]]),
        ("shape not list", ["['a']", "float32", (1,)]),
        ("dim not int", ["['a']", "float32", [1.0]]),
        ("dim a bool", ["['a']", "float32", [True]]),
        ("dim negative", ["['a']", "float32", [2, -1]]),
    ],
    ids=lambda b: b[0],
)
def test_a_malformed_entry_is_named_wherever_it_stands(bad: tuple[str, Any]) -> None:
    for at in (0, 1, 2):
        table = [GOOD, ["['b']", "int8", []]]
        table.insert(at, bad[1])
        with pytest.raises(FormatError, match="malformed tensor entry"):
            _layout_from_obj([b"\x90", table])


def test_an_unknown_dtype_and_a_repeated_path_are_refused() -> None:
    with pytest.raises(UnsupportedFormat, match="float7"):
        _layout_from_obj([b"\x90", [GOOD, ["['b']", "float7", [1]]]])
    with pytest.raises(FormatError, match="twice"):
        _layout_from_obj([b"\x90", [GOOD, GOOD]])
    with pytest.raises(FormatError, match="malformed layout"):
        _layout_from_obj([b"\x90", {"a": 1}])
    assert _layout_from_obj([b"\x90", []]) == Layout(b"\x90", (), 0)


# --- what a header says its skeleton holds (format 1.2) ---------------------------------------

HOLDS = ("has_arrays", "has_dtensors", "has_refs")

leaves = st.one_of(
    st.integers(0, 9).map(lambda n: torch.arange(n, dtype=torch.float32)),
    st.integers(0, 9).map(lambda n: np.arange(n, dtype=np.int32)),
    st.integers(-5, 5),
    st.text(max_size=3),
)
states = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.dictionaries(st.text("abc", min_size=1, max_size=2), inner, max_size=4),
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
    ),
    max_leaves=12,
).map(lambda tree: {"state": tree, "step": 1})


def walked(layout: Layout) -> dict[str, bool]:
    """What walking the skeleton finds (what a reader of an older blob does)."""
    return {h: getattr(type(layout), h).func(layout) for h in HOLDS}


@settings(max_examples=60, deadline=None)
@given(states)
def test_what_a_header_says_its_skeleton_holds_is_what_a_walk_finds(state: Any) -> None:
    raw = snapshot(state, version=3)
    truth = walked(raw.layout)
    for parts, _ in (encode_full(raw, rank=0), encode_packed(raw, rank=0)):
        layout = read_meta(b"".join(bytes(p) for p in parts)).layout
        assert {h: layout.__dict__[h] for h in HOLDS} == truth  # said, not walked
    # Through the save's cached plan too, its second state with a changed value (the layout
    # then takes the new skeleton and keeps what the first one held).
    planner = Planner()
    planner.flatten(state)
    again = planner.flatten({**state, "step": 2}).layout
    assert {h: again.__dict__[h] for h in HOLDS} == walked(again) == truth

"""Stage tiercheck.flatten/1: skeleton + payload round trips, bit for bit."""

from __future__ import annotations

import collections
import enum
import random
import struct
from typing import Any

import numpy as np
import pytest
import torch

from tiercheck.codec import (
    ALIGNMENT,
    Layout,
    flatten,
    load_into,
    own_copy,
    snapshot,
    supported_dtypes,
    unflatten,
    write_payload,
)
from tiercheck.errors import UnsupportedObject

from ._helpers import assert_same, random_tensor, tensor_bytes


def roundtrip(state: Any, *, allow_pickle: bool = False) -> Any:
    """Flatten, copy into a payload, rebuild over views of the payload."""
    raw = snapshot(state, version=1, allow_pickle=allow_pickle)
    return raw.state(allow_pickle=allow_pickle)


@pytest.mark.parametrize("dtype", supported_dtypes(), ids=str)
def test_every_dtype_round_trips_bit_exact(dtype: torch.dtype) -> None:
    state = {
        "t": random_tensor(dtype, (3, 5), seed=1),
        "scalar": random_tensor(dtype, (), seed=2),
        "empty": random_tensor(dtype, (0, 4), seed=3),
    }
    assert_same(roundtrip(state), state)


def test_dtype_list_covers_the_usual_suspects() -> None:
    names = {str(d) for d in supported_dtypes()}
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16"):
        assert f"torch.{name}" in names
    for name in ("float32", "float64", "complex64", "complex128", "uint16", "uint32", "uint64"):
        assert f"torch.{name}" in names
    assert "torch.float8_e4m3fn" in names
    assert "torch.float8_e5m2" in names


def _bits(dtype: torch.dtype, patterns: list[int]) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    signed = [
        p - (1 << (8 * dtype.itemsize)) if p >= 1 << (8 * dtype.itemsize - 1) else p
        for p in patterns
    ]
    return torch.tensor(signed, dtype=ints).view(dtype)


def test_special_float_bits_survive() -> None:
    state = {
        # quiet NaN with payload, signaling NaN, negative NaN, -0.0, +inf, -inf, subnormals
        "f32": _bits(
            torch.float32,
            [
                0x7FC00123,
                0x7F800001,
                0xFFC00000,
                0x80000000,
                0x7F800000,
                0xFF800000,
                0x00000001,
                0x807FFFFF,
            ],
        ),
        "f64": _bits(
            torch.float64,
            [0x7FF8000000000ABC, 0x7FF0000000000001, 0x8000000000000000, 0x0000000000000001],
        ),
        "f16": _bits(torch.float16, [0x7E01, 0x7C01, 0x8000, 0x0001, 0x7C00]),
        "bf16": _bits(torch.bfloat16, [0x7FC1, 0x7F81, 0x8000, 0x0001, 0xFF80]),
        "py": [
            struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0],
            struct.unpack("<d", bytes.fromhex("0100000000f0ff7f"))[0],
            -0.0,
            float("inf"),
            5e-324,
        ],
        "complex": complex(-0.0, float("nan")),
    }
    assert_same(roundtrip(state), state)


def test_non_contiguous_and_lazy_tensors_round_trip() -> None:
    base = random_tensor(torch.float32, (6, 8), seed=4)
    cplx = random_tensor(torch.complex64, (3, 4), seed=5)
    state = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(3.0).expand(4, 3),
        "negative_view": torch.arange(4.0)._neg_view(),
        "conj": cplx.conj(),
        "channels_last": random_tensor(torch.float16, (2, 3, 4, 5), seed=6).to(
            memory_format=torch.channels_last
        ),
    }
    restored = roundtrip(state)
    for key, value in state.items():
        assert restored[key].is_contiguous()
        assert tensor_bytes(restored[key]) == tensor_bytes(value.resolve_conj().resolve_neg())


def test_views_sharing_storage_are_saved_by_value() -> None:
    shared = random_tensor(torch.float32, (4, 4), seed=7)
    state = {"a": shared, "row": shared[1], "t": shared.t(), "same": shared}
    layout, tensors = flatten(state)
    assert len(layout.specs) == 4
    assert all(t is not None for t in tensors)
    assert tensors[0] is shared
    assert tensors[3] is shared
    restored = roundtrip(state)
    assert_same(restored["row"], shared[1].clone())
    restored["a"].zero_()  # restored tensors are independent of each other
    assert tensor_bytes(restored["same"]) == tensor_bytes(shared)


def test_nested_containers_keep_their_types() -> None:
    od: collections.OrderedDict[str, Any] = collections.OrderedDict(
        [("z", 1), ("a", torch.ones(2))]
    )
    od._metadata = collections.OrderedDict([("", {"version": 2})])  # type: ignore[attr-defined]
    state = {
        "od": od,
        "tuple": (1, (2.5, "x"), [None, True]),
        "int_keys": {0: "zero", -7: b"bytes", 2**70: "big key", (1, "k"): "tuple key"},
        "size": torch.Size([3, 0, 2]),
        "bytearray": bytearray(b"\x00\x01"),
        "big": [2**64, -(2**63) - 1, 2**200, -(2**200)],
        "edge_ints": [2**64 - 1, -(2**63)],
        "unicode": "ünïcödé ✓ \U0001f600",
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "empty": [{}, [], ()],
        "bools": [True, False],
    }
    restored = roundtrip(state)
    assert_same(restored, state)
    assert restored["od"]._metadata == {"": {"version": 2}}


def test_rng_states_round_trip_and_still_work() -> None:
    torch_state = torch.get_rng_state()
    py_state = random.Random(3).getstate()
    legacy = np.random.RandomState(5).get_state()
    generators = {
        name: np.random.Generator(getattr(np.random, name)(9)).bit_generator.state
        for name in ("PCG64", "MT19937", "Philox", "SFC64")
    }
    state = {"torch": torch_state, "python": py_state, "numpy": legacy, "gens": generators}
    restored = roundtrip(state)
    assert_same(restored, state)

    rs = np.random.RandomState()
    rs.set_state(restored["numpy"])
    assert (
        rs.randint(0, 2**31, 5).tolist() == np.random.RandomState(5).randint(0, 2**31, 5).tolist()
    )
    py = random.Random()
    py.setstate(restored["python"])
    assert py.random() == random.Random(3).random()
    for name, st in restored["gens"].items():
        bg = getattr(np.random, name)()
        bg.state = st
        assert bg.random_raw(3).tolist() == getattr(np.random, name)(9).random_raw(3).tolist()
    gen = torch.Generator()
    gen.set_state(restored["torch"])


def test_numpy_arrays_and_scalars_come_back_as_numpy() -> None:
    ro = np.arange(5, dtype=np.int16)
    ro.flags.writeable = False
    state = {
        "f32": np.linspace(0, 1, 7, dtype=np.float32),
        "strided": np.arange(20, dtype=np.float64)[::-3],
        "big_endian": np.arange(4, dtype=">f4"),
        "dates": np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[D]"),
        "text": np.array(["ab", "cde"]),
        "read_only": ro,
        "bools": np.array([[True, False]]),
        "zero_d": np.array(3.5),
        "empty": np.zeros((0, 2), dtype=np.uint32),
        "scalars": [np.float32(1.5), np.int64(-3), np.bool_(True), np.float64("nan")],
    }
    restored = roundtrip(state)
    assert_same(restored, state)
    assert type(restored["scalars"][0]) is np.float32


class _Color(enum.IntEnum):
    RED = 1


class _Opaque:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque)

    __hash__ = object.__hash__


@pytest.mark.parametrize(
    "bad",
    [
        _Opaque(),
        {1, 2},
        _Color.RED,
        collections.defaultdict(list),
        collections.namedtuple("P", "x")(1),
        frozenset(),
        np.array([object()], dtype=object),
        torch.zeros(2, 2).to_sparse(),
        torch.empty(3, device="meta"),
    ],
    ids=lambda x: type(x).__name__,
)
def test_unsupported_objects_raise_typed_error(bad: Any) -> None:
    with pytest.raises(UnsupportedObject):
        flatten({"x": bad})


def test_unsupported_object_error_names_its_path() -> None:
    state = {"optim": {"param_groups": [{"lr": 0.1, "foo": _Opaque()}]}}
    with pytest.raises(UnsupportedObject) as info:
        flatten(state)
    assert "state['optim']['param_groups'][0]['foo']" in str(info.value)
    assert "allow_pickle=True" in str(info.value)


def test_unsupported_dict_key_raises() -> None:
    with pytest.raises(UnsupportedObject):
        flatten({frozenset([1]): 1})


def test_reference_cycle_raises() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(UnsupportedObject):
        flatten({"loop": loop})


def test_allow_pickle_admits_objects_and_loading_needs_it_too() -> None:
    state = {"obj": _Opaque(), "weird_key": {frozenset([1]): 2}, "t": torch.arange(3)}
    raw = snapshot(state, version=1, allow_pickle=True)
    with pytest.raises(UnsupportedObject):
        raw.state()
    restored = raw.state(allow_pickle=True)
    assert isinstance(restored["obj"], _Opaque)
    assert restored["weird_key"] == {frozenset([1]): 2}
    assert torch.equal(restored["t"], torch.arange(3))


def test_layout_is_deterministic_aligned_and_padding_is_zero() -> None:
    state = {"a": torch.ones(3, dtype=torch.uint8), "b": torch.ones(5), "c": torch.ones(0)}
    layout, tensors = flatten(state)
    assert [s.path for s in layout.specs] == ["['a']", "['b']", "['c']"]
    assert all(s.offset % ALIGNMENT == 0 for s in layout.specs)
    assert layout.payload_nbytes % ALIGNMENT == 0
    assert layout == flatten(state)[0]
    assert layout.is_canonical()
    dest = torch.full((layout.payload_nbytes + 10,), 0xAB, dtype=torch.uint8)
    write_payload(layout, tensors, dest)
    for start, end in layout.gaps:
        assert int(dest[start:end].sum()) == 0
    assert bool((dest[layout.payload_nbytes :] == 0xAB).all())  # beyond the payload: untouched
    again = torch.full_like(dest, 0x11)
    write_payload(layout, tensors, again)
    assert torch.equal(dest[: layout.payload_nbytes], again[: layout.payload_nbytes])


def test_layout_views_and_compatibility() -> None:
    layout, tensors = flatten({"w": torch.arange(6.0).reshape(2, 3), "step": 1})
    other, _ = flatten({"w": torch.zeros(2, 3), "step": 2})
    assert layout.compatible(other)
    assert layout.skeleton != other.skeleton
    bigger, _ = flatten({"w": torch.zeros(3, 3), "step": 1})
    assert not layout.compatible(bigger)
    payload = torch.zeros(layout.payload_nbytes, dtype=torch.uint8)
    write_payload(layout, tensors, payload)
    (view,) = layout.views(payload)
    assert view.dtype == torch.float32
    assert view.shape == (2, 3)
    view[0, 0] = 42.0  # a view, not a copy
    assert layout.views(payload)[0][0, 0].item() == 42.0


def test_empty_state_has_empty_payload() -> None:
    layout, tensors = flatten({"step": 3})
    assert layout.payload_nbytes == 0
    assert tensors == []
    assert layout.specs == ()
    assert roundtrip({"step": 3}) == {"step": 3}


def test_write_payload_checks_its_inputs() -> None:
    layout, tensors = flatten({"w": torch.ones(4)})
    with pytest.raises(ValueError, match="tensors"):
        write_payload(layout, [], torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expects"):
        write_payload(layout, [torch.ones(5)], torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bytes"):
        write_payload(layout, tensors, torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        write_payload(layout, tensors, torch.zeros(64))


def test_write_payload_into_a_buffer_view() -> None:
    state = {"w": random_tensor(torch.float64, (10,), seed=9)}
    layout, tensors = flatten(state)
    memory = bytearray(layout.payload_nbytes)
    write_payload(layout, tensors, torch.frombuffer(memory, dtype=torch.uint8))
    assert bytes(memory[:80]) == tensor_bytes(state["w"])


def test_unflatten_checks_tensor_count() -> None:
    layout, _ = flatten({"w": torch.ones(2)})
    with pytest.raises(ValueError, match="tensors"):
        unflatten(layout, [])


def test_layout_build_matches_flatten() -> None:
    layout, _ = flatten({"a": torch.zeros(3, dtype=torch.int8), "b": torch.zeros(2, 2)})
    rebuilt = Layout.build(layout.skeleton, [(s.path, s.dtype, s.shape) for s in layout.specs])
    assert rebuilt == layout


# --- load_into --------------------------------------------------------------------------------


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_load_into_restores_in_place_and_keeps_references() -> None:
    model, opt = _trained()
    saved = snapshot({"model": model.state_dict(), "optim": opt.state_dict()}, version=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    moments = [opt.state[p]["exp_avg"] for p in params]

    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # move away from the saved state

    target = {"model": model.state_dict(), "optim": opt.state_dict()}
    result = load_into(target, saved.state())
    assert result is target
    for p, q in zip(params, model.parameters(), strict=True):
        assert p is q
    for key, value in model.state_dict().items():
        assert tensor_bytes(value) == tensor_bytes(expected[key])
    # Optimizer.state_dict() hands out its live moment tensors: they are restored in place.
    saved_moments = saved.state()["optim"]["state"].values()
    for p, m, value in zip(params, moments, saved_moments, strict=True):
        assert opt.state[p]["exp_avg"] is m
        assert tensor_bytes(m) == tensor_bytes(value["exp_avg"])
    opt.load_state_dict(target["optim"])
    assert tensor_bytes(opt.state[params[0]]["exp_avg"]) == tensor_bytes(moments[0])


def test_load_into_container_rules() -> None:
    keep = torch.zeros(3)
    target: dict[str, Any] = {
        "t": keep,
        "gone": 1,
        "lst": [torch.zeros(2), 5, 6],
        "tup": (torch.zeros(2), "x"),
        "shape_changed": torch.zeros(2),
        "arr": np.zeros(3),
        "kind_changed": [1],
    }
    source: dict[str, Any] = {
        "kind_changed": (1,),
        "t": torch.ones(3),
        "lst": [torch.ones(2)],
        "tup": (torch.ones(2), "y"),
        "shape_changed": torch.ones(4),
        "arr": np.ones(3),
        "new": "hello",
    }
    tup_tensor = target["tup"][0]
    lst_tensor = target["lst"][0]
    arr = target["arr"]
    out = load_into(target, source)
    assert out is target
    assert list(target) == list(source)  # keys follow the source, extra keys are gone
    assert target["t"] is keep
    assert torch.equal(keep, torch.ones(3))
    assert target["lst"][0] is lst_tensor
    assert len(target["lst"]) == 1
    assert target["tup"][0] is tup_tensor
    assert target["tup"][1] == "y"
    assert torch.equal(tup_tensor, torch.ones(2))
    assert target["shape_changed"] is source["shape_changed"]
    assert target["arr"] is arr
    assert arr.tolist() == [1.0, 1.0, 1.0]
    assert target["kind_changed"] == (1,)
    assert target["new"] == "hello"


def test_load_into_leaf_and_tuple_results() -> None:
    assert load_into(1, 2) == 2
    t = torch.zeros(2)
    same = (t, "a")
    assert load_into(same, (torch.ones(2), "a")) is same
    longer = load_into((1,), (1, 2))
    assert longer == (1, 2)
    grown: list[int] = [1]
    assert load_into(grown, [1, 2, 3]) is grown
    assert grown == [1, 2, 3]


def test_load_into_keeps_aliasing_of_the_target() -> None:
    tied = torch.zeros(2, 2)
    target = {"emb": tied, "head": tied}
    load_into(target, {"emb": torch.full((2, 2), 3.0), "head": torch.full((2, 2), 3.0)})
    assert target["emb"] is target["head"] is tied
    assert torch.equal(tied, torch.full((2, 2), 3.0))


def test_own_copy_gives_every_tensor_and_array_its_own_memory() -> None:
    module_state: collections.OrderedDict[str, Any] = collections.OrderedDict(
        w=torch.arange(6.0), b=torch.ones(2)
    )
    module_state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    state = {"model": module_state, "arr": np.arange(4), "rng": [torch.zeros(3, dtype=torch.uint8)]}
    layout, tensors = flatten(state)
    payload = torch.zeros(layout.payload_nbytes, dtype=torch.uint8)
    write_payload(layout, tensors, payload)
    restored = unflatten(layout, layout.views(payload))
    assert restored["model"]["b"].storage_offset() > 0  # a view into the payload

    owned = own_copy(restored)
    payload.fill_(0xFF)  # the copies no longer see the payload
    assert torch.equal(owned["model"]["w"], torch.arange(6.0))
    assert owned["model"]["b"].storage_offset() == 0
    assert type(owned["model"]) is collections.OrderedDict
    assert owned["model"]._metadata == {"": {"version": 1}}
    np.testing.assert_array_equal(owned["arr"], np.arange(4))
    assert torch.equal(owned["rng"][0], torch.zeros(3, dtype=torch.uint8))

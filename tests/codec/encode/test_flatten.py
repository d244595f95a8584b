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
from hypothesis import given
from hypothesis import strategies as st

from tests.codec._helpers import assert_same, random_tensor, tensor_bytes
from tiercheck.codec import (
    ALIGNMENT,
    Layout,
    flatten,
    snapshot,
    supported_dtypes,
    unflatten,
    write_payload,
)
from tiercheck.codec.decode.statetree import check_into, load_into, own_copy
from tiercheck.codec.encode.flatten import MAX_DEPTH, without_data
from tiercheck.errors import StateMismatch, UnsupportedObject


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
    for name, gen_state in restored["gens"].items():
        bg = getattr(np.random, name)()
        bg.state = gen_state
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


def _cycles() -> list[tuple[Any, str]]:
    looped: list[Any] = [1]
    looped.append(looped)
    mapping: dict[str, Any] = {"t": torch.ones(2)}
    mapping["me"] = {"again": mapping}
    through_tuple: list[Any] = []
    through_tuple.append((0, through_tuple))
    ordered = collections.OrderedDict(w=torch.ones(1))
    ordered._metadata = {"": {"owner": ordered}}  # type: ignore[attr-defined]
    return [
        ({"x": looped}, r"state\['x'\]\[1\]: it is state\['x'\] itself"),
        (mapping, r"state\['me'\]\['again'\]: it is state itself"),
        ({"x": through_tuple}, r"state\['x'\]\[0\]\[1\]: it is state\['x'\] itself"),
        ({"o": ordered}, r"_metadata\[''\]\['owner'\]: it is state\['o'\] itself"),
    ]


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_a_reference_cycle_is_refused_whatever_allow_pickle_says(allow_pickle: bool) -> None:
    # Pickled, the inner reference would restore as a copy holding itself: not the state.
    for state, where in _cycles():
        with pytest.raises(UnsupportedObject, match=where):
            flatten(state, allow_pickle=allow_pickle)


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_nesting_deeper_than_the_limit_is_refused(allow_pickle: bool) -> None:
    def nested(depth: int) -> Any:
        state: Any = torch.ones(1)
        for i in range(depth):
            state = {"d": state} if i % 2 else [state]
        return state

    layout, tensors = flatten(nested(MAX_DEPTH), allow_pickle=allow_pickle)
    assert len(tensors) == 1
    assert layout.specs[0].path.count("[") == MAX_DEPTH
    for depth in (MAX_DEPTH + 1, 5000):
        with pytest.raises(UnsupportedObject, match=f"nested more than {MAX_DEPTH} deep"):
            flatten(nested(depth), allow_pickle=allow_pickle)


def _dataless() -> list[tuple[Any, str]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(3)
    return [
        (torch.empty(3, device="meta"), "a tensor on the meta device has a shape but no data"),
        (torch.empty(0, device="meta"), "meta device"),
        (torch.nn.Linear(2, 2, device="meta").weight, "meta device"),
        (torch.empty(2, 2, device="meta").t(), "meta device"),
        (fake, "storage on the meta device"),
    ]


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_a_tensor_without_data_is_refused_whatever_allow_pickle_says(allow_pickle: bool) -> None:
    """Pickled, a meta or fake tensor would restore as something that was never data."""
    for tensor, why in _dataless():
        assert without_data(tensor)
        with pytest.raises(UnsupportedObject, match=why):
            flatten({"opt": [tensor]}, allow_pickle=allow_pickle)
    for real in (torch.ones(2), torch.ones(4)[1:].view(3, 1), torch.nn.Parameter(torch.ones(1))):
        assert without_data(real) == ""


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


def _frozen(obj: Any) -> Any:
    """Everything a restore could change in ``obj``: identities, types, keys, bits."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", id(obj), obj.dtype, tuple(obj.shape), obj.device, tensor_bytes(obj))
    if isinstance(obj, np.ndarray):
        return ("array", id(obj), obj.dtype, obj.shape, obj.tobytes())
    if isinstance(obj, dict):
        return (type(obj), id(obj), [(k, _frozen(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj), id(obj), [_frozen(v) for v in obj])
    return (type(obj), repr(obj))


def test_load_into_container_rules() -> None:
    keep = torch.zeros(3)
    target: dict[str, Any] = {
        "t": keep,
        "lst": [torch.zeros(2), 5, 6],
        "tup": (torch.zeros(2), "x"),
        "arr": np.zeros(3),
        "value_changed": [1],
    }
    source: dict[str, Any] = {
        "value_changed": ["one"],
        "t": torch.ones(3),
        "lst": [torch.ones(2), 7, None],
        "tup": (torch.ones(2), "y"),
        "arr": np.ones(3),
    }
    tup_tensor = target["tup"][0]
    lst = target["lst"]
    lst_tensor = lst[0]
    arr = target["arr"]
    out = load_into(target, source)
    assert out is target
    assert list(target) == list(source)  # keys follow the source
    assert target["t"] is keep
    assert torch.equal(keep, torch.ones(3))
    assert target["lst"] is lst
    assert lst[0] is lst_tensor
    assert lst[1:] == [7, None]
    assert torch.equal(lst_tensor, torch.ones(2))
    assert target["tup"][0] is tup_tensor
    assert target["tup"][1] == "y"
    assert torch.equal(tup_tensor, torch.ones(2))
    assert target["arr"] is arr
    assert arr.tolist() == [1.0, 1.0, 1.0]
    assert target["value_changed"] == ["one"]


def test_load_into_leaf_and_tuple_results() -> None:
    assert load_into(1, 2) == 2
    assert load_into(1, "two") == "two"  # values of any types replace each other
    assert load_into(None, 3.5) == 3.5
    t = torch.zeros(2)
    same = (t, "a")
    assert load_into(same, (torch.ones(2), "a")) is same
    rebuilt = load_into((t, 1), (torch.ones(2), 2))
    assert rebuilt == (t, 2)
    assert rebuilt[0] is t


def test_load_into_keeps_aliasing_of_the_target() -> None:
    tied = torch.zeros(2, 2)
    target = {"emb": tied, "head": tied}
    load_into(target, {"emb": torch.full((2, 2), 3.0), "head": torch.full((2, 2), 3.0)})
    assert target["emb"] is target["head"] is tied
    assert torch.equal(tied, torch.full((2, 2), 3.0))


def test_a_smaller_model_is_refused_and_the_target_is_untouched() -> None:
    torch.manual_seed(0)
    small, big = torch.nn.Linear(4, 4), torch.nn.Linear(8, 8)
    saved = snapshot({"model": small.state_dict(), "step": 3}, version=1)
    target = {"model": big.state_dict(), "step": 0}
    before = _frozen(target)
    weight_bits = tensor_bytes(big.weight)
    expected = [
        "state['model']['weight']: the target holds float32(8, 8), the version float32(4, 4)",
        "state['model']['bias']: the target holds float32(8,), the version float32(4,)",
    ]
    assert check_into(target, saved.state()) == expected
    assert check_into(target, saved.state(), strict=False) == expected  # shapes stay errors
    for strict in (True, False):
        with pytest.raises(StateMismatch) as info:
            load_into(target, saved.state(), strict=strict)
        for line in expected:
            assert line in str(info.value)
        assert "nothing was written" in str(info.value)
        assert "without a state" in str(info.value)
        assert _frozen(target) == before
        assert target["step"] == 0
        assert tensor_bytes(big.weight) == weight_bits


def test_check_into_finds_dtype_and_kind_mismatches_on_both_sides() -> None:
    ro = np.zeros(2)
    ro.setflags(write=False)
    target = {
        "f": torch.zeros(2),
        "n": np.zeros(2, dtype=np.float32),
        "ro": ro,
        "t_vs_int": torch.zeros(2),
        "int_vs_t": 5,
        "dict_vs_list": {"a": 1},
        "list_vs_tuple": [1],
        "arr_vs_t": np.zeros(2),
        "none_vs_dict": None,
    }
    source = {
        "f": torch.zeros(2, dtype=torch.float64),
        "n": np.zeros(2, dtype=np.float64),
        "ro": np.ones(2),
        "t_vs_int": 5,
        "int_vs_t": torch.zeros(2, dtype=torch.int64),
        "dict_vs_list": [1],
        "list_vs_tuple": (1,),
        "arr_vs_t": torch.zeros(2, dtype=torch.float64),
        "none_vs_dict": {},
    }
    assert check_into(target, source) == [
        "state['f']: the target holds float32(2,), the version float64(2,)",
        "state['n']: the target holds float32(2,), the version float64(2,)",
        "state['ro']: the target holds a read-only numpy array float64(2,), which cannot be "
        "restored in place",
        "state['t_vs_int']: the target holds a tensor float32(2,), the version an int value",
        "state['int_vs_t']: the target holds an int value, the version a tensor int64(2,)",
        "state['dict_vs_list']: the target holds a dict of 1 key, the version a list of 1 item",
        "state['list_vs_tuple']: the target holds a list of 1 item, the version a tuple of 1 item",
        "state['arr_vs_t']: the target holds a numpy array float64(2,), the version a tensor "
        "float64(2,)",
        "state['none_vs_dict']: the target holds None, the version a dict of 0 keys",
    ]
    before = _frozen(target)
    with pytest.raises(StateMismatch, match="at 9 places"):
        load_into(target, source, strict=False)
    assert _frozen(target) == before


def test_an_inference_tensor_is_written_only_in_inference_mode() -> None:
    with torch.inference_mode():
        target = {"w": torch.zeros(2)}
    problems = check_into(target, {"w": torch.ones(2)})
    assert problems == [
        "state['w']: the target holds an inference tensor float32(2,), which cannot be written "
        "outside torch.inference_mode()"
    ]
    with pytest.raises(StateMismatch):
        load_into(target, {"w": torch.ones(2)})
    assert torch.equal(target["w"], torch.zeros(2))
    with torch.inference_mode():
        assert load_into(target, {"w": torch.ones(2)}) is target
    assert torch.equal(target["w"], torch.ones(2))


def test_keys_on_one_side_only_strict_and_not() -> None:
    kept = torch.zeros(2)
    target: dict[str, Any] = {"w": torch.zeros(2), "only_target": kept, "nested": {"a": 1}}
    source: dict[str, Any] = {"nested": {"a": 2, "b": 3}, "w": torch.ones(2), "new": np.ones(2)}
    assert check_into(target, source) == [
        "state['nested']: the version holds key 'b' that the target lacks",
        "state: the version holds key 'new' that the target lacks",
        "state: the target holds key 'only_target' that the version lacks",
    ]
    before = _frozen(target)
    with pytest.raises(StateMismatch, match="strict=False") as info:
        load_into(target, source)
    assert "the version holds key 'new' that the target lacks" in str(info.value)
    assert _frozen(target) == before

    assert check_into(target, source, strict=False) == []
    w = target["w"]
    assert load_into(target, source, strict=False) is target
    # The version's keys first, in its order; the target's own keys kept after them.
    assert list(target) == ["nested", "w", "new", "only_target"]
    assert target["nested"] == {"a": 2, "b": 3}
    assert target["w"] is w
    assert torch.equal(w, torch.ones(2))
    assert target["only_target"] is kept
    assert torch.equal(kept, torch.zeros(2))
    np.testing.assert_array_equal(target["new"], np.ones(2))
    assert not np.shares_memory(target["new"], source["new"])  # a copy of its own


def test_lengths_must_match_even_when_not_strict() -> None:
    target = {"a": [1, (torch.zeros(1), 2)], "b": [1, 2, 3]}
    source = {"a": [1, (torch.ones(1), 2, 3)], "b": [1]}
    expected = [
        "state['a'][1]: the target holds a tuple of 2 items, the version a tuple of 3 items",
        "state['b']: the target holds a list of 3 items, the version a list of 1 item",
    ]
    for strict in (True, False):
        assert check_into(target, source, strict=strict) == expected
        before = _frozen(target)
        with pytest.raises(StateMismatch):
            load_into(target, source, strict=strict)
        assert _frozen(target) == before


def test_the_message_lists_at_most_fifty_mismatches() -> None:
    target = {f"k{i}": torch.zeros(1) for i in range(60)}
    source = {f"k{i}": torch.zeros(2) for i in range(60)}
    with pytest.raises(StateMismatch) as info:
        load_into(target, source)
    message = str(info.value)
    assert "state['k49']" in message
    assert "state['k50']" not in message
    assert "... and 10 more" in message
    assert "at 60 places" in message


def test_dict_and_ordered_dict_are_compatible_mappings() -> None:
    model = torch.nn.Linear(3, 2)
    saved = snapshot({"model": model.state_dict()}, version=1).state()
    assert type(saved["model"]) is collections.OrderedDict
    plain = {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}
    assert check_into({"model": plain}, saved) == []
    weight = plain["weight"]
    load_into({"model": plain}, saved)
    assert type(plain) is dict
    assert plain["weight"] is weight
    assert tensor_bytes(weight) == tensor_bytes(model.weight)

    other = torch.nn.Linear(3, 2)
    ordered = other.state_dict()
    load_into(ordered, {"weight": torch.ones(2, 3), "bias": torch.ones(2)})
    assert type(ordered) is collections.OrderedDict
    assert torch.equal(other.weight, torch.ones(2, 3))


def test_a_fresh_optimizer_receives_the_saved_moments_when_not_strict() -> None:
    model, opt = _trained()
    saved = snapshot({"model": model.state_dict(), "optim": opt.state_dict()}, version=1)

    torch.manual_seed(1)
    fresh_model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=0.1)
    target = {"model": fresh_model.state_dict(), "optim": fresh_opt.state_dict()}
    assert target["optim"]["state"] == {}
    problems = check_into(target, saved.state())
    assert len(problems) == len(list(model.parameters()))
    assert problems[0] == "state['optim']['state']: the version holds key 0 that the target lacks"
    with pytest.raises(StateMismatch):
        load_into(target, saved.state())

    result = load_into(target, saved.state(), strict=False)
    assert result is target
    fresh_opt.load_state_dict(result["optim"])
    saved.payload.fill_(0xFF)  # the restored moments do not live in the version's buffer
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert tensor_bytes(p) == tensor_bytes(q)
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert tensor_bytes(fresh_opt.state[q][name]) == tensor_bytes(opt.state[p][name])
    # And both train on identically from here.
    x = torch.randn(2, 4)
    for m, o in ((model, opt), (fresh_model, fresh_opt)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert tensor_bytes(p) == tensor_bytes(q)


def test_the_device_is_not_compared() -> None:
    target = {"w": torch.zeros(2, device="cpu")}
    source = {"w": torch.ones(2, device="cpu")}
    assert check_into(target, source) == []
    assert check_into({"w": torch.zeros(2, dtype=torch.float64)}, source) != []


def test_a_target_on_the_meta_device_cannot_receive_a_version() -> None:
    """Copying into a meta tensor does nothing: such a restore would leave the model empty."""
    source = {"w": torch.ones(2), "m": {"b": torch.ones(3)}}
    target = {
        "w": torch.zeros(2, device="meta"),
        "m": {"b": torch.nn.Linear(3, 3, device="meta").bias},
    }
    problems = check_into(target, source)
    assert len(problems) == 2
    assert all("meta device" in p for p in problems)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_restore_onto_a_gpu_copies_across_devices() -> None:
    w = torch.zeros(3, device="cuda")
    target = {"w": w}
    assert check_into(target, {"w": torch.arange(3.0)}) == []
    assert load_into(target, {"w": torch.arange(3.0)}) is target
    assert target["w"] is w
    assert w.device.type == "cuda"
    assert torch.equal(w.cpu(), torch.arange(3.0))


_small_leaves = st.one_of(
    st.sampled_from([(2,), (3,), (2, 2)]).flatmap(
        lambda shape: st.sampled_from([torch.float32, torch.int64]).map(
            lambda dtype: torch.arange(_numel(shape)).to(dtype).reshape(shape)
        )
    ),
    st.sampled_from([(2,), (3,)]).map(lambda shape: np.arange(_numel(shape), dtype=np.float64)),
    st.none(),
    st.integers(-3, 3),
    st.text(max_size=2),
)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_small_states = st.recursive(
    _small_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=2),
        st.lists(children, max_size=2).map(tuple),
        st.dictionaries(st.sampled_from("abc"), children, max_size=3),
        st.dictionaries(st.sampled_from("abc"), children, max_size=3).map(collections.OrderedDict),
    ),
    max_leaves=6,
)


def _values(obj: Any) -> Any:
    """The values a restore must reproduce (mappings of either type compare equal)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.dtype, tuple(obj.shape), tensor_bytes(obj))
    if isinstance(obj, np.ndarray):
        return ("array", obj.dtype, obj.shape, obj.tobytes())
    if isinstance(obj, dict):
        return ("mapping", [(k, _values(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj), [_values(v) for v in obj])
    return (type(obj), repr(obj))


@given(_small_states)
def test_a_state_always_fits_itself(state: Any) -> None:
    assert check_into(state, state) == []
    assert check_into(state, own_copy(state)) == []
    assert check_into(state, own_copy(state), strict=False) == []


@given(_small_states, _small_states, st.booleans())
def test_load_into_either_raises_untouched_or_restores(
    target: Any, source: Any, strict: bool
) -> None:
    before = _frozen(target)
    problems = check_into(target, source, strict=strict)
    if problems:
        with pytest.raises(StateMismatch):
            load_into(target, source, strict=strict)
        assert _frozen(target) == before
        return
    result = load_into(target, source, strict=strict)
    if strict:
        assert _values(result) == _values(source)
    else:
        _assert_covers(result, source)


def _assert_covers(result: Any, source: Any) -> None:
    """Every value of ``source`` is in ``result`` at its path (keys only in result aside)."""
    if isinstance(source, dict):
        assert isinstance(result, dict)
        for key, value in source.items():
            _assert_covers(result[key], value)
    elif isinstance(source, (list, tuple)):
        assert type(result) is type(source)
        assert len(result) == len(source)
        for r, s in zip(result, source, strict=True):
            _assert_covers(r, s)
    else:
        assert _values(result) == _values(source)


def _revalued(obj: Any) -> Any:
    """A copy of ``obj`` of the same structure with other values in every tensor and array."""
    if isinstance(obj, torch.Tensor):
        return obj + 1
    if isinstance(obj, np.ndarray):
        return obj - 1
    if isinstance(obj, dict):
        copy = own_copy(obj)
        for key, value in obj.items():
            copy[key] = _revalued(value)
        return copy
    if isinstance(obj, (list, tuple)):
        return type(obj)(_revalued(v) for v in obj)
    return obj


@given(_small_states)
def test_load_into_restores_any_matching_state_in_place(target: Any) -> None:
    source = _revalued(target)
    originals = [id(t) for t in _arrays_and_tensors(target)]
    result = load_into(target, source)
    assert _values(result) == _values(source)
    assert [id(t) for t in _arrays_and_tensors(result)] == originals


def _arrays_and_tensors(obj: Any) -> list[Any]:
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _arrays_and_tensors(v)]
    return []


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

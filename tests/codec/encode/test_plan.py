"""The cached plan (tiercheck.codec.encode.plan): reused while the structure repeats, never stale.

Every test compares what the planner produced with a fresh, full :func:`flatten` of the same
state: the layout (skeleton included) must be equal and the payload byte for byte the same,
written into a destination full of garbage (recycled memory holds old bytes).
"""

from __future__ import annotations

import collections
import copy
import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tests.codec._helpers import random_tensor
from tiercheck.codec import flatten, supported_dtypes, write_payload
from tiercheck.codec.encode.plan import CopyProgram, Planner, groupable
from tiercheck.errors import UnsupportedObject


def _fresh(state: Any) -> tuple[Any, bytes]:
    layout, tensors = flatten(state)
    dest = torch.full((layout.payload_nbytes,), 0x5A, dtype=torch.uint8)
    write_payload(layout, tensors, dest)
    return layout, dest.numpy().tobytes()


def _planned(planner: Planner, state: Any) -> tuple[Any, bytes, bool]:
    flat = planner.flatten(state)
    dest = torch.full((flat.layout.payload_nbytes + 64,), 0xA5, dtype=torch.uint8)
    flat.write(dest[: flat.layout.payload_nbytes])
    assert dest[flat.layout.payload_nbytes :].eq(0xA5).all(), "wrote past the payload"
    return flat.layout, dest[: flat.layout.payload_nbytes].numpy().tobytes(), flat.reused


def _assert_like_flatten(planner: Planner, state: Any) -> bool:
    """The planner's result for ``state`` is exactly flatten's; returns whether it reused."""
    layout, payload, reused = _planned(planner, state)
    want_layout, want_payload = _fresh(state)
    assert layout == want_layout
    assert layout.skeleton == want_layout.skeleton
    assert payload == want_payload
    return reused


def _model_state(step: int = 3) -> dict[str, Any]:
    """A small model + AdamW state, as a training loop hands it over."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 3)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": step,
        "rng": torch.get_rng_state(),
        "np_rng": np.random.RandomState(0).get_state(),
        "extra": (1, 2.5, "x", b"y", None, True, torch.float16, torch.Size([2, 3])),
        "scalars": [torch.tensor(1.0), torch.tensor(2, dtype=torch.int64)],
        "empty": torch.zeros(0, 4),
    }


def test_a_repeating_state_reuses_the_plan_and_matches_flatten() -> None:
    planner = Planner()
    state = _model_state()
    assert not _assert_like_flatten(planner, state)
    for step in range(4):
        state = _model_state(step)  # new containers and new tensor objects, same structure
        with torch.no_grad():
            for t in state["model"].values():
                if t.is_floating_point():
                    t.add_(step)
        assert _assert_like_flatten(planner, state)
    assert planner.hits == 4
    assert planner.misses == 1


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        obj = state
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value

    return change


def _delete(path: list[Any]) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        obj = state
        for key in path[:-1]:
            obj = obj[key]
        del obj[path[-1]]

    return change


def _call(fn: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        fn(state)

    return change


def _reorder(state: dict[str, Any]) -> None:
    items = list(state["model"].items())
    state["model"].clear()
    state["model"].update(reversed(items))


def _metadata_value(state: dict[str, Any]) -> None:
    state["model"]._metadata[""]["version"] = 2


def _metadata_gone(state: dict[str, Any]) -> None:
    del state["model"]._metadata


def _bytearray_in_place(state: dict[str, Any]) -> None:
    state["blob"][0] ^= 0xFF


def _inner_tensor_object(state: dict[str, Any]) -> None:
    state["optim"]["state"][0]["exp_avg"] = state["optim"]["state"][0]["exp_avg"].clone() + 1


def _non_contiguous(state: dict[str, Any]) -> None:
    w = state["model"]["0.weight"]
    state["model"]["0.weight"] = w.t().contiguous().t()


def _requires_grad(state: dict[str, Any]) -> None:
    state["model"]["0.bias"] = torch.nn.Parameter(state["model"]["0.bias"].clone())


def _retype_key(new: Any) -> Callable[[dict[str, Any]], None]:
    """Key 1 of the optimizer state becomes ``new`` (equal to 1) at the same place."""

    def change(state: dict[str, Any]) -> None:
        inner = state["optim"]["state"]
        state["optim"]["state"] = {(new if k == 1 else k): v for k, v in inner.items()}

    return change


# Structure changes: the plan must notice (a full flatten and a new plan).
STRUCTURE_CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "dict_gains_a_key": _set(["model", "new.weight"], torch.ones(2)),
    "dict_loses_a_key": _delete(["model", "2.bias"]),
    "dict_key_order_changes": _call(_reorder),
    "int_key_becomes_bool": _call(
        lambda s: s["optim"]["state"].update({True: s["optim"]["state"].pop(1)})
    ),
    "int_key_becomes_float": _call(
        lambda s: s["optim"]["state"].update({1.0: s["optim"]["state"].pop(1)})
    ),
    "equal_key_of_another_type_bool": _retype_key(True),
    "equal_key_of_another_type_float": _retype_key(1.0),
    "tensor_changes_shape": _set(["model", "0.weight"], torch.zeros(3, 3)),
    "tensor_changes_shape_same_numel": _set(["model", "0.weight"], torch.zeros(5, 7)),
    "tensor_changes_dtype": _set(["model", "0.bias"], torch.zeros(7, dtype=torch.float64)),
    "tensor_becomes_a_value": _set(["model", "0.bias"], 7),
    "tensor_becomes_none": _set(["model", "0.bias"], None),
    "value_becomes_a_tensor": _set(["step"], torch.tensor(3)),
    "tensor_becomes_a_container": _set(["model", "0.bias"], {"a": torch.ones(1)}),
    "container_becomes_a_value": _set(["optim", "param_groups"], "none"),
    "list_grows": _call(lambda s: s["scalars"].append(torch.tensor(3.0))),
    "list_shrinks": _call(lambda s: s["scalars"].pop()),
    "tuple_becomes_list": _call(lambda s: s.update(extra=list(s["extra"]))),
    "ordered_dict_becomes_dict": _call(lambda s: s.update(model=dict(s["model"]))),
    "ordered_dict_metadata_goes": _call(_metadata_gone),
    "numpy_array_changes_dtype": _call(
        lambda s: s.update(
            np_rng=(*s["np_rng"][:1], s["np_rng"][1].astype(np.int64), *s["np_rng"][2:])
        )
    ),
    "numpy_array_changes_shape": _call(
        lambda s: s.update(np_rng=(*s["np_rng"][:1], s["np_rng"][1][:10], *s["np_rng"][2:]))
    ),
    "numpy_array_becomes_scalar": _call(
        lambda s: s.update(np_rng=(*s["np_rng"][:1], np.uint32(5), *s["np_rng"][2:]))
    ),
    "tensor_becomes_a_parameter": _call(_requires_grad),
    "root_gains_a_key": _set(["new"], 1),
    "tensor_becomes_sparse": _set(["model", "0.bias"], torch.zeros(7).to_sparse()),
}

# States after these changes are ones a plan does not model (flattened in full every time).
NOT_PLANNED = {"int_key_becomes_float", "equal_key_of_another_type_float"}

# Value changes under the same structure: the plan is reused (the skeleton is re-encoded
# where a value changed) and the result is still exactly flatten's.
VALUE_CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "step_counter": _set(["step"], 4),
    "step_counter_bigint": _set(["step"], 1 << 80),
    "learning_rate": _call(lambda s: s["optim"]["param_groups"][0].update(lr=0.5)),
    "float_minus_zero": _call(lambda s: s["optim"]["param_groups"][0].update(lr=-0.0)),
    "float_nan": _call(lambda s: s["optim"]["param_groups"][0].update(lr=math.nan)),
    "float_becomes_int": _call(lambda s: s["optim"]["param_groups"][0].update(lr=1)),
    "int_becomes_bool": _set(["step"], True),
    "string": _call(lambda s: s.update(extra=("z", *s["extra"][1:]))),
    "torch_size": _call(lambda s: s.update(extra=(*s["extra"][:-1], torch.Size([4])))),
    "bytearray_in_place": _call(_bytearray_in_place),
    "tensor_values": _call(lambda s: s["model"]["0.weight"].add_(1)),
    "tensor_replaced_by_another_of_the_same_shape": _call(_inner_tensor_object),
    "tensor_becomes_non_contiguous": _call(_non_contiguous),
    "numpy_values": _call(lambda s: s["np_rng"][1].__setitem__(0, 7)),
    "rng_state": _set(["rng"], torch.get_rng_state().flip(0).clone()),
    "ordered_dict_metadata_value": _call(_metadata_value),
}


def _base() -> dict[str, Any]:
    state = _model_state()
    state["blob"] = bytearray(b"abc")
    return state


@pytest.mark.parametrize("name", list(STRUCTURE_CHANGES))
def test_a_structure_change_is_noticed(name: str) -> None:
    planner = Planner()
    state = _base()
    _assert_like_flatten(planner, state)
    assert _assert_like_flatten(planner, copy.deepcopy(state))  # same structure: reused
    STRUCTURE_CHANGES[name](state)
    try:
        reused = _assert_like_flatten(planner, state)
    except UnsupportedObject:
        # flatten itself refuses the new state (a sparse tensor): so must the planner, and the
        # stale plan must not have been used instead.
        with pytest.raises(UnsupportedObject):
            flatten(state)
        return
    assert not reused, f"{name}: the stale plan was used"
    # The new structure is planned in turn.
    assert _assert_like_flatten(planner, copy.deepcopy(state)) == (name not in NOT_PLANNED)


@pytest.mark.parametrize("name", list(VALUE_CHANGES))
def test_a_value_change_keeps_the_plan_and_the_bytes_right(name: str) -> None:
    planner = Planner()
    state = _base()
    _assert_like_flatten(planner, state)
    VALUE_CHANGES[name](state)
    assert _assert_like_flatten(planner, state)
    # ... and back again (a value that returns to its first encoding).
    assert _assert_like_flatten(planner, _base())


def test_an_optimizer_gaining_state_after_its_first_step_is_a_structure_change() -> None:
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters())
    planner = Planner()
    assert not _assert_like_flatten(
        planner, {"model": model.state_dict(), "optim": opt.state_dict()}
    )
    assert _assert_like_flatten(planner, {"model": model.state_dict(), "optim": opt.state_dict()})
    model(torch.randn(2, 3)).sum().backward()
    opt.step()  # exp_avg, exp_avg_sq and step appear for every parameter
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    assert not _assert_like_flatten(planner, state)
    opt.step()
    assert _assert_like_flatten(planner, {"model": model.state_dict(), "optim": opt.state_dict()})


def test_a_long_random_sequence_of_changes_never_goes_stale() -> None:
    rng = random.Random(7)
    changes = [*STRUCTURE_CHANGES.items(), *VALUE_CHANGES.items()]
    planner = Planner()
    state = _base()
    _assert_like_flatten(planner, state)
    for _ in range(60):
        if rng.random() < 0.3:
            state = _base()
        name, change = rng.choice(changes)
        if name == "tensor_becomes_sparse":
            continue
        try:
            change(state)
        except (KeyError, IndexError, AttributeError, TypeError):
            continue  # an earlier change removed what this one changes
        _assert_like_flatten(planner, state)


def test_states_a_plan_does_not_model_are_flattened_every_time() -> None:
    planner = Planner(allow_pickle=True)
    states = [
        torch.ones(3),  # the root is not a container
        {("a", 1): torch.ones(3)},  # a tuple key
        {1.5: torch.ones(3)},  # a float key
        {"obj": {1, 2}},  # pickled
    ]
    for state in states:
        for _ in range(2):
            flat = planner.flatten(state)
            assert not flat.reused
            assert flat.program is None
            layout, _ = flatten(state, allow_pickle=True)
            assert flat.layout == layout


def test_a_cycle_is_refused_with_or_without_pickle() -> None:
    # Pickled, the inner reference would come back as a copy holding itself: not the state.
    state: dict[str, Any] = {"t": torch.ones(2)}
    state["self"] = state
    for allow_pickle in (False, True):
        with pytest.raises(UnsupportedObject, match=r"state\['self'\]: it is state itself"):
            Planner(allow_pickle=allow_pickle).flatten(state)


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_a_cached_plan_meeting_a_cycle_or_a_dataless_tensor_refuses_it(allow_pickle: bool) -> None:
    """The cached path checks nothing per tensor: a state of the plan's shape that now holds
    itself, or a tensor on the meta device, fails the match (the plan's walk is as deep as
    the plan) and the full flatten refuses it; the next good state is stored exactly."""
    planner = Planner(allow_pickle=allow_pickle)
    for step in range(2):
        _assert_like_flatten(planner, {"w": [torch.ones(3), [step]], "b": torch.zeros(2)})
    cyclic: dict[str, Any] = {"w": [torch.ones(3), None], "b": torch.zeros(2)}
    cyclic["w"][1] = cyclic["w"]
    with pytest.raises(UnsupportedObject, match="reference cycle"):
        planner.flatten(cyclic)
    deeper: dict[str, Any] = {"w": [torch.ones(3), None], "b": torch.zeros(2)}
    deeper["w"][1] = cyclic  # the plan's depth, then a cycle below it
    with pytest.raises(UnsupportedObject, match="reference cycle"):
        planner.flatten(deeper)
    for step in range(2):
        _assert_like_flatten(planner, {"w": [torch.ones(3), [step]], "b": torch.zeros(2)})
    with pytest.raises(UnsupportedObject, match="meta device"):
        planner.flatten({"w": [torch.ones(3), [0]], "b": torch.zeros(2, device="meta")})
    assert _assert_like_flatten(planner, {"w": [torch.ones(3), [5]], "b": torch.zeros(2)}) is False


def test_a_stale_plan_is_not_reused_after_an_unsupported_state() -> None:
    planner = Planner()
    state = _base()
    _assert_like_flatten(planner, state)
    state["bad"] = object()
    with pytest.raises(UnsupportedObject):
        planner.flatten(state)
    del state["bad"]
    assert not _assert_like_flatten(planner, state)


# --- the copy program -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", supported_dtypes(), ids=str)
def test_copy_program_writes_every_dtype_like_write_payload(dtype: torch.dtype) -> None:
    state = {
        "a": random_tensor(dtype, (3, 5), 1),
        "scalar": random_tensor(dtype, (), 2),
        "empty": random_tensor(dtype, (0, 3), 3),
        "b": random_tensor(dtype, (7,), 4),
        "strided": random_tensor(dtype, (4, 6), 5)[:, ::2],
        "other": torch.arange(5, dtype=torch.int16),  # a second run of another dtype
        "c": random_tensor(dtype, (2, 2, 2), 6),
    }
    layout, tensors = flatten(state)
    program = CopyProgram(layout)
    dest = torch.full((layout.payload_nbytes,), 0xEE, dtype=torch.uint8)
    program.write(tensors, dest)
    assert dest.numpy().tobytes() == _fresh(state)[1]


def test_the_grouped_kernel_is_probed_per_dtype() -> None:
    assert groupable(torch.float32)
    assert groupable(torch.uint8)
    # Whatever it answers for the others, the program's bytes are right (test above).
    assert all(isinstance(groupable(d), bool) for d in supported_dtypes())


def test_copy_program_checks_its_destination() -> None:
    layout, tensors = flatten({"a": torch.ones(3)})
    program = CopyProgram(layout)
    with pytest.raises(ValueError, match="bytes"):
        program.write(tensors, torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="tensors"):
        program.write([], torch.empty(layout.payload_nbytes, dtype=torch.uint8))


def test_many_tensors_with_padding_after_each() -> None:
    """An AdamW-like state at scale: every 0-dim step and odd-sized tensor leaves padding."""
    state = {
        "state": {
            i: {
                "step": torch.tensor(float(i)),
                "exp_avg": torch.randn(i % 7 + 1, 3),
                "exp_avg_sq": torch.rand(i % 5 + 1),
            }
            for i in range(300)
        },
        "param_groups": [{"lr": 0.1, "params": list(range(300))}],
    }
    planner = Planner()
    assert not _assert_like_flatten(planner, state)
    for i in range(300):
        state["state"][i]["exp_avg"].mul_(2)
    assert _assert_like_flatten(planner, state)


def test_layout_with_skeleton_shares_the_derived_tables() -> None:
    layout, _ = flatten({"a": torch.ones(3), "n": 1})
    _ = layout.index, layout.gaps, layout.packed_entries, layout.is_canonical()
    other, _ = flatten({"a": torch.ones(3), "n": 2})
    moved = layout.with_skeleton(other.skeleton)
    assert moved == other
    assert moved.packed_entries is layout.packed_entries
    assert moved.index is layout.index


def test_views_match_slices_of_the_payload() -> None:
    state = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "s": torch.tensor(5, dtype=torch.int64),
        "e": torch.zeros(0, 2, dtype=torch.float32),
        "b": torch.arange(3, dtype=torch.float64),
        "c": torch.ones(2, 2, dtype=torch.float32),
    }
    layout, tensors = flatten(state)
    payload = torch.zeros(layout.payload_nbytes, dtype=torch.uint8)
    write_payload(layout, tensors, payload)
    views = layout.views(payload)
    for view, spec, src in zip(views, layout.specs, tensors, strict=True):
        assert view.dtype == spec.dtype
        assert tuple(view.shape) == spec.shape
        assert torch.equal(view, src)
        if spec.nbytes:
            assert view.data_ptr() == payload.data_ptr() + spec.offset


def test_an_ordered_dict_keeps_its_metadata_through_the_plan() -> None:
    od: collections.OrderedDict[str, Any] = collections.OrderedDict(w=torch.ones(2))
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    planner = Planner()
    _assert_like_flatten(planner, {"m": od})
    od._metadata[""]["version"] = 3  # type: ignore[attr-defined]
    assert _assert_like_flatten(planner, {"m": od})

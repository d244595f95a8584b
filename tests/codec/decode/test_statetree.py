"""check_into checks a mapping's plain tensors without a call each where they fit: whatever the
mismatches, each is reported once, where it stands, in walk order."""

from __future__ import annotations

import collections
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercheck.codec.decode.statetree import check_into
from tiercheck.codec.format.layout import TensorSpec

FAULTS = ("none", "shape", "dtype", "meta", "inference", "missing", "extra", "leaf", "length")


def build(faults: list[str], spec_sources: bool) -> tuple[Any, Any]:
    target: dict[str, Any] = {"model": collections.OrderedDict(), "optim": {"state": {}}, "n": 3}
    source: dict[str, Any] = {"model": collections.OrderedDict(), "optim": {"state": {}}, "n": 4}
    for i, fault in enumerate(faults):
        shape = (2, i % 3 + 1)
        made = torch.zeros(shape)
        stored: Any = (
            TensorSpec(f"['model']['w{i}']", torch.float32, shape, 0, made.nbytes)
            if spec_sources
            else torch.zeros(shape)
        )
        if fault == "shape":
            made = torch.zeros(3, 3)
        elif fault == "dtype":
            made = torch.zeros(shape, dtype=torch.float64)
        elif fault == "meta":
            made = torch.empty(shape, device="meta")
        elif fault == "inference":
            with torch.inference_mode():
                made = torch.zeros(shape)
        elif fault == "leaf":
            made = 7  # type: ignore[assignment]
        if fault != "missing":
            target["model"][f"w{i}"] = made
        source["model"][f"w{i}"] = stored
        target["optim"]["state"][i] = {"step": 1, "exp_avg": torch.zeros(4)}
        source["optim"]["state"][i] = {"step": 2, "exp_avg": torch.zeros(4)}
        if fault == "extra":
            target["model"][f"x{i}"] = torch.zeros(1)
        if fault == "length":
            target["optim"]["state"][i]["betas"] = [0.9, 0.99]
            source["optim"]["state"][i]["betas"] = [0.9]
    return target, source


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from(FAULTS), max_size=12),
    st.booleans(),
    st.booleans(),
)
def test_each_mismatch_is_reported_once_in_walk_order(
    faults: list[str], strict: bool, spec_sources: bool
) -> None:
    target, source = build(faults, spec_sources)
    report = check_into(target, source, strict=strict)
    always = {"shape", "dtype", "meta", "inference", "leaf", "length"}
    expected = [
        (i, fault)
        for i, fault in enumerate(faults)
        if fault in always or (strict and fault in {"missing", "extra"})
    ]
    assert len(report) == len(expected), report
    # The model's entries in the version's order, then the keys only the target holds, then
    # the optimizer's entries (a list's length).
    order = (
        [e for e in expected if e[1] not in {"extra", "length"}]
        + [e for e in expected if e[1] == "extra"]
        + [e for e in expected if e[1] == "length"]
    )
    for line, (i, fault) in zip(report, order, strict=True):
        key = f"[{i}]" if fault == "length" else f"'x{i}'" if fault == "extra" else f"'w{i}'"
        assert key in line, (line, fault)


def test_an_inference_target_fits_inside_inference_mode() -> None:
    target, source = build(["inference", "none"], spec_sources=False)
    assert check_into(target, source)
    with torch.inference_mode():
        assert check_into(target, source) == []

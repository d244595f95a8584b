"""The skeleton read back (tiercheck/codec/decode/rebuild.py ``unflatten``) around stand-ins:
the layout's own ``TensorSpec`` records stand for the tensors where no object needs their bytes,
and a decode asks nothing of the skeleton it does not walk anyway."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.codec.format.test_skeleton import shard
from tiercheck.codec import encode_full, read_meta, snapshot, unflatten
from tiercheck.codec.format.layout import TensorSpec


def test_the_layouts_records_stand_for_the_tensors_of_a_plain_state() -> None:
    raw = snapshot({"w": torch.ones(2, 3), "inner": [torch.zeros(4), 7], "t": ("a", 1)}, version=1)
    layout = raw.layout
    rebuilt = unflatten(layout, layout.specs)
    assert type(rebuilt["w"]) is TensorSpec
    assert (rebuilt["w"].dtype, rebuilt["w"].shape) == (torch.float32, (2, 3))
    assert rebuilt["inner"][0] in layout.specs
    assert rebuilt["inner"][0].shape == (4,)
    assert rebuilt["inner"][1] == 7
    assert rebuilt["t"] == ("a", 1)


@pytest.mark.parametrize(
    "value", [np.arange(3, dtype=np.int16), shard()], ids=["numpy array", "DTensor"]
)
def test_an_object_rebuilt_around_its_bytes_refuses_a_stand_in(value: object) -> None:
    layout = snapshot({"x": value, "w": torch.ones(2)}, version=1).layout
    with pytest.raises(ValueError, match="rebuilt around tensors, not TensorSpecs"):
        unflatten(layout, layout.specs)


def test_a_decode_does_not_scan_the_skeletons_tags() -> None:
    """Unflattening a blob's state walks its skeleton once: no second walk to list its tags
    (thousands of extensions in a large state) beforehand."""
    raw = snapshot({f"w{i}": torch.full((2,), float(i)) for i in range(50)}, version=1)
    parts, _ = encode_full(raw, rank=0)
    meta = read_meta(b"".join(memoryview(p).cast("B").tobytes() for p in parts))
    layout = meta.layout
    unflatten(layout, layout.views(raw.payload))
    assert "_ext_codes" not in layout.__dict__

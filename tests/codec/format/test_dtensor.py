"""DTensors as leaves: the local shard travels as a tensor, the layout as plain data.

One process, a world-size-1 gloo group and 1-rank meshes: enough for every round trip, the
layout checks of an in-place restore and the cached plan. Several ranks: see
tests/distributed/test_fsdp2.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tests.helpers import one_rank_group
from tiercheck import DTensorShard, StateMismatch, SyncCheckpointer
from tiercheck.codec import (
    CodecOptions,
    decode,
    encode_full,
    encode_packed,
    flatten,
    read_meta,
    snapshot,
    unflatten,
)
from tiercheck.codec.decode.statetree import check_into, load_into
from tiercheck.codec.encode.flatten import Layout
from tiercheck.codec.encode.plan import Planner
from tiercheck.codec.format.dtensor import materialize
from tiercheck.codec.format.stages import FlattenStage, parse_stage
from tiercheck.errors import UnsupportedFormat

# The tests' process group is gloo. Where CUDA is present, torch would give a rebuilt mesh a new
# process group of its own (a collective call), so tiercheck returns the local shard instead
# (tiercheck.codec.format.dtensor.materialize documents it); these tests expect what applies here.
REBUILDS = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with one_rank_group():
        yield init_device_mesh("cpu", (1,))


def _state(mesh: DeviceMesh, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": distribute_tensor(torch.randn(6, 4, generator=g), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.randn(5, generator=g), mesh, [Replicate()]),
        "plain": torch.randn(3, generator=g),
        "step": seed,
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (
            distribute_tensor(torch.zeros(v.shape), v.device_mesh, v.placements)
            if isinstance(v, DTensor)
            else torch.zeros_like(v)
            if isinstance(v, torch.Tensor)
            else 0
        )
        for k, v in state.items()
    }


def test_a_dtensor_is_stored_as_its_local_shard_and_its_layout(mesh: DeviceMesh) -> None:
    state = _state(mesh, 1)
    layout, tensors = flatten(state)
    assert [type(t) for t in tensors] == [torch.Tensor] * 3
    assert tensors[0] is state["w"].to_local() or torch.equal(tensors[0], state["w"].to_local())
    assert layout.has_dtensors
    assert b"pickle" not in layout.skeleton
    assert b"DTensor" not in layout.skeleton
    back = unflatten(layout, [t.clone() for t in tensors])
    w = back["w"]
    assert type(w) is DTensorShard
    assert torch.equal(w.local, state["w"].to_local())
    assert (w.shape, w.stride, w.placements) == ((6, 4), (4, 1), (("shard", 0),))
    assert (w.mesh, w.names, w.device, w.coord, w.offset) == ((1,), None, "cpu", (0,), (0, 0))
    assert back["b"].placements == (("replicate",),)
    assert type(back["plain"]) is torch.Tensor
    assert back["step"] == 1
    # A shard saved again stores the same record.
    assert flatten(back)[0].skeleton == layout.skeleton


def test_mesh_names_and_partial_placements_are_recorded() -> None:
    # No process group needed for the record itself: build the shard as a restore gives it.
    record = {
        "shape": [4],
        "stride": [1],
        "placements": [["partial", "sum"]],
        "mesh": [1],
        "names": ["dp"],
        "device": "cpu",
        "coord": [0],
        "offset": [0],
    }
    shard = DTensorShard.from_record(torch.arange(4.0), record)
    layout, _ = flatten({"p": shard})
    again = unflatten(layout, [torch.arange(4.0)])["p"]
    assert again.record() == record
    with pytest.raises(ValueError, match="malformed DTensor record"):
        DTensorShard.from_record(torch.arange(4.0), {"shape": [4]})


def test_named_mesh_and_partial_dtensor_round_trip(mesh: DeviceMesh) -> None:
    named = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    partial = DTensor.from_local(torch.arange(4.0), named, [Partial()])
    layout, tensors = flatten({"p": partial})
    back = unflatten(layout, tensors)["p"]
    assert back.names == ("dp",)
    assert back.placements == (("partial", "sum"),)
    rebuilt = materialize({"p": back})["p"]
    if not REBUILDS:
        assert type(rebuilt) is torch.Tensor
        assert torch.equal(rebuilt, torch.arange(4.0))
        return
    assert isinstance(rebuilt, DTensor)
    assert rebuilt.device_mesh.mesh_dim_names == ("dp",)
    assert rebuilt.placements == (Partial(),)


def test_blobs_with_dtensors_name_flatten_2_and_others_flatten_1(mesh: DeviceMesh) -> None:
    with_dt = snapshot(_state(mesh), version=3)
    without = snapshot({"x": torch.ones(4)}, version=3)
    parts, meta = encode_full(with_dt, rank=0)
    assert meta.stages == ("tiercheck.flatten/2",)
    assert read_meta(b"".join(bytes(p) for p in parts)) == meta
    assert encode_full(without, rank=0)[1].stages == ("tiercheck.flatten/1",)
    parts, meta = encode_packed(with_dt, rank=0, base=with_dt, options=CodecOptions())
    assert meta.stages[:2] == ("tiercheck.flatten/2", "tiercheck.xor/1")
    packed = b"".join(bytes(p) for p in parts)
    restored = decode(packed, base=with_dt).state()
    assert torch.equal(restored["w"].local, _state(mesh)["w"].to_local())
    # A layout built from a skeleton alone finds its DTensors by a scan.
    layout = with_dt.layout
    assert Layout(layout.skeleton, layout.specs, layout.payload_nbytes).has_dtensors
    assert parse_stage("tiercheck.flatten/2", {}) == FlattenStage(2)
    with pytest.raises(UnsupportedFormat, match=r"flatten/1 to tiercheck\.flatten/3"):
        parse_stage("tiercheck.flatten/4", {})


def test_in_place_restore_fills_each_local_shard(mesh: DeviceMesh) -> None:
    saved = _state(mesh, 2)
    layout, tensors = flatten(saved)
    version = unflatten(layout, [t.clone() for t in tensors])
    target = _zeros_like(saved)
    locals_before = {k: target[k].to_local() for k in ("w", "b")}
    out = load_into(target, version)
    assert out is target
    for key in ("w", "b"):
        assert isinstance(target[key], DTensor)
        assert target[key].to_local().data_ptr() == locals_before[key].data_ptr()
        assert torch.equal(target[key].to_local(), saved[key].to_local())
    assert torch.equal(target["plain"], saved["plain"])
    assert target["step"] == 2


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("placements", "placements (replicate) against (shard(0))"),
        ("shape", "global shape (8, 4) against (6, 4)"),
        ("plain", "the target holds a tensor float32(6, 4), the version a DTensor"),
        ("dtensor_for_tensor", "the target holds a DTensor float32(3,)"),
    ],
)
def test_a_layout_mismatch_is_a_typed_error_and_nothing_is_written(
    mesh: DeviceMesh, change: str, expected: str
) -> None:
    saved = _state(mesh, 3)
    layout, tensors = flatten(saved)
    version = unflatten(layout, [t.clone() for t in tensors])
    target = _zeros_like(saved)
    if change == "placements":
        target["w"] = distribute_tensor(torch.zeros(6, 4), mesh, [Replicate()])
    elif change == "shape":
        target["w"] = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
    elif change == "plain":
        target["w"] = torch.zeros(6, 4)
    else:
        target["plain"] = distribute_tensor(torch.zeros(3), mesh, [Replicate()])
    problems = check_into(target, version)
    assert len(problems) == 1, problems
    assert expected in problems[0], problems
    with pytest.raises(StateMismatch, match="nothing was written"):
        load_into(target, version)
    assert target["b"].to_local().abs().sum().item() == 0


def test_a_different_mesh_shape_or_offset_is_a_mismatch(mesh: DeviceMesh) -> None:
    saved = _state(mesh)
    layout, tensors = flatten(saved)
    version = unflatten(layout, tensors)
    record = version["w"].record()
    for key, value, words in (
        ("mesh", [2], "mesh shape (1,) against (2,)"),
        ("offset", [3, 0], "shard offset (0, 0) against (3, 0)"),
    ):
        other = {
            **version,
            "w": DTensorShard.from_record(version["w"].local, {**record, key: value}),
        }
        problems = check_into(_zeros_like(saved), other)
        assert len(problems) == 1, problems
        assert words in problems[0], problems


def test_the_cached_plan_handles_dtensors(mesh: DeviceMesh) -> None:
    planner = Planner()
    state = _state(mesh, 4)
    first = planner.flatten(state)
    state["step"] = 5
    state["w"].to_local().add_(1)
    second = planner.flatten(state)
    assert second.reused
    assert second.program is not None
    layout, tensors = flatten(state)
    assert second.layout.skeleton == layout.skeleton
    assert second.layout.specs == layout.specs
    assert second.layout.has_dtensors
    assert first.layout.has_dtensors
    assert all(a is b for a, b in zip(second.tensors, tensors, strict=True))
    dest = torch.empty(layout.payload_nbytes, dtype=torch.uint8)
    second.write(dest)
    views = layout.views(dest)
    assert torch.equal(views[0], state["w"].to_local())
    # Another layout is another structure: the plan misses and the result is still exact.
    state["w"] = distribute_tensor(state["w"].full_tensor(), mesh, [Replicate()])
    third = planner.flatten(state)
    assert not third.reused
    assert third.layout.skeleton == flatten(state)[0].skeleton


def test_restore_without_a_target_rebuilds_dtensors_on_a_one_dimensional_mesh(
    mesh: DeviceMesh,
) -> None:
    saved = _state(mesh, 6)
    layout, tensors = flatten(saved)
    back = materialize(unflatten(layout, tensors))
    if REBUILDS:
        assert isinstance(back["w"], DTensor)
        assert back["w"].placements == (Shard(0),)
        assert back["w"].shape == (6, 4)
        assert torch.equal(back["w"].to_local(), tensors[0])
    else:
        assert type(back["w"]) is torch.Tensor
        assert torch.equal(back["w"], tensors[0])
    # A two-dimensional mesh cannot be made without new process groups: the local tensor.
    two_d = {
        **back,
        "w": DTensorShard.from_record(
            tensors[0],
            {
                **unflatten(layout, tensors)["w"].record(),
                "mesh": [1, 1],
                "coord": [0, 0],
                "placements": [["shard", 0], ["replicate"]],
                "offset": [0, 0],
            },
        ),
    }
    assert type(materialize(two_d)["w"]) is torch.Tensor


def test_checkpointer_round_trip_of_dtensors(mesh: DeviceMesh, tmp_path: Path) -> None:
    ckpt = SyncCheckpointer(
        "dt", local_root=tmp_path / "shm", persistent=(tmp_path / "d").as_uri(), base_every=2
    )
    with ckpt:
        state = _state(mesh, 7)
        for version in range(3):  # base, delta, base
            state["w"].to_local().add_(version)
            state["step"] = version
            ckpt.save(version, state)
        ckpt.wait()
        target = _zeros_like(state)
        restored = ckpt.restore(target)
        assert restored is not None
        assert restored.version == 2
        assert restored.state is target
        assert torch.equal(target["w"].to_local(), state["w"].to_local())
        plain = ckpt.restore()
        assert plain is not None
        if REBUILDS:
            assert isinstance(plain.state["w"], DTensor)
            assert torch.equal(plain.state["w"].to_local(), state["w"].to_local())
        else:
            assert torch.equal(plain.state["w"], state["w"].to_local())
        bad = _zeros_like(state)
        bad["w"] = distribute_tensor(torch.zeros(6, 4), mesh, [Replicate()])
        with pytest.raises(StateMismatch, match="placements"):
            ckpt.restore(bad)


def test_export_writes_local_shards_and_says_so(
    mesh: DeviceMesh, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiercheck.cli import EXIT_OK, main

    durable = tmp_path / "d"
    state = _state(mesh, 8)
    with SyncCheckpointer("dtx", local_root=tmp_path / "shm", persistent=durable.as_uri()) as ckpt:
        ckpt.save(0, state)
        ckpt.wait()
    out = tmp_path / "out" / "state"
    code = main(["export", str(durable / "dtx"), str(out), "--format", "pt"])
    captured = capsys.readouterr()
    assert code == EXIT_OK, captured.err
    assert "2 DTensors were exported as rank 0's local shards" in captured.out + captured.err
    loaded = torch.load(out.with_suffix(".pt"), weights_only=True)
    assert torch.equal(loaded["w"], state["w"].to_local())
    assert torch.equal(loaded["b"], state["b"].to_local())


def test_skeleton_record_is_plain_msgpack(mesh: DeviceMesh) -> None:
    layout, _ = flatten({"w": _state(mesh)["w"]})
    seen: list[Any] = []

    def hook(code: int, data: bytes) -> None:
        seen.append((code, msgpack.unpackb(data)))

    msgpack.unpackb(layout.skeleton, ext_hook=hook)
    assert seen == [
        (
            12,
            [
                0,
                {
                    "shape": [6, 4],
                    "stride": [4, 1],
                    "placements": [["shard", 0]],
                    "mesh": [1],
                    "names": None,
                    "device": "cpu",
                    "coord": [0],
                    "offset": [0, 0],
                },
            ],
        )
    ]

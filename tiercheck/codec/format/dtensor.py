"""DTensors as leaves of a state: the local shard travels, the layout is plain data.

A ``torch.distributed.tensor.DTensor`` (what ``model.state_dict()`` of an FSDP2 model and
``get_state_dict`` hold) is stored as its *local shard* -- an ordinary tensor that goes through
the whole tensor path (deltas, byte planes, zstd, checksums, zero-copy staging, the cached copy
plan) -- plus a small record in the skeleton, never a pickle:

* ``shape`` and ``stride``: the global (logical) shape and stride;
* ``placements``: one entry per mesh dimension, as plain lists -- ``["shard", dim]``,
  ``["replicate"]``, ``["partial", reduce_op]``, ``["strided_shard", dim, split_factor]``;
* ``mesh``: the mesh shape, ``names`` its dimension names (``None`` when it has none),
  ``device``: its device type (``"cpu"``, ``"cuda"``...);
* ``coord``: this rank's coordinate on the mesh, and ``offset``: the global offset of the local
  shard in every dimension (with its own shape, the exact region of the global tensor it holds).

That is enough to put shards saved by one world size together again on another (see DESIGN.md,
elastic restore); today a restore needs the same layout.

:class:`DTensorShard` is how a stored DTensor comes back from :func:`~.rebuild.unflatten`: the
local tensor plus the record. :func:`~tiercheck.codec.decode.statetree.load_into` copies it into the
local shard of a live DTensor after checking that the record matches that DTensor's layout (else
:class:`~tiercheck.errors.StateMismatch`). :func:`materialize` turns the shards of a state restored
without a target into DTensors where that is possible without creating process groups,
else into their local tensors.

``torch.distributed.tensor`` takes seconds to import: it is only looked at once the training
program has imported it (no DTensor can exist before).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Sequence
from typing import Any

import torch

from tiercheck.codec.format.containers import MAPPINGS

__all__ = ["DTensorShard", "dtensor_class", "layout_of", "materialize", "place_like"]


def dtensor_class() -> type[torch.Tensor] | None:
    """The ``DTensor`` class if ``torch.distributed.tensor`` is imported, else ``None``."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls if isinstance(cls, type) else None


def is_dtensor(obj: object) -> bool:
    """Whether ``obj`` is a ``DTensor`` (without importing ``torch.distributed.tensor``)."""
    cls = dtensor_class()
    return cls is not None and isinstance(obj, cls)


def _placement_data(placement: Any) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    t = type(placement)
    if t is Shard:
        return ["shard", int(placement.dim)]
    if t is Replicate:
        return ["replicate"]
    if t is Partial:
        return ["partial", str(placement.reduce_op)]
    if t is _StridedShard:
        return ["strided_shard", int(placement.dim), int(placement.split_factor)]
    raise ValueError(f"DTensor placement {placement!r} has no stored form")


def _placement_objects(data: Sequence[Any]) -> tuple[Any, ...]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = []
    for entry in data:
        kind = entry[0]
        if kind == "shard":
            out.append(Shard(entry[1]))
        elif kind == "replicate":
            out.append(Replicate())
        elif kind == "partial":
            out.append(Partial(entry[1]))
        elif kind == "strided_shard":
            out.append(_StridedShard(entry[1], split_factor=entry[2]))
        else:
            raise ValueError(f"unknown DTensor placement {entry!r}")
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _layout_cached(
    mesh: Any, placements: tuple[Any, ...], shape: tuple[int, ...], stride: tuple[int, ...]
) -> dict[str, Any]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    coord = mesh.get_coordinate()
    names = mesh.mesh_dim_names
    return {
        "shape": list(shape),
        "stride": list(stride),
        "placements": [_placement_data(p) for p in placements],
        "mesh": list(mesh.shape),
        "names": None if names is None else list(names),
        "device": str(mesh.device_type),
        "coord": None if coord is None else [int(c) for c in coord],
        "offset": [int(o) for o in offset],
    }


def layout_of(dt: Any) -> dict[str, Any]:
    """The stored record of the DTensor ``dt`` (see the module docstring); do not modify it.

    Cached per mesh, placements, shape and stride: a state of thousands of DTensors computes
    each distinct layout once. Raises ``ValueError`` for a placement with no stored form.
    """
    return _layout_cached(dt.device_mesh, tuple(dt.placements), tuple(dt.shape), tuple(dt.stride()))


@dataclasses.dataclass(frozen=True, slots=True)
class DTensorShard:
    """A stored DTensor as it comes back: this rank's local shard and the global layout.

    ``local`` is the local tensor; the other fields are the record described in
    :mod:`tiercheck.codec.format.dtensor` (global ``shape`` and ``stride``, ``placements`` as plain
    lists, the ``mesh`` shape, its dimension ``names`` and ``device`` type, this rank's
    ``coord`` on the mesh and the shard's global ``offset``). Saving a ``DTensorShard`` again
    stores the same record.
    """

    local: torch.Tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    placements: tuple[tuple[Any, ...], ...]
    mesh: tuple[int, ...]
    names: tuple[str, ...] | None
    device: str
    coord: tuple[int, ...] | None
    offset: tuple[int, ...]

    @classmethod
    def from_record(cls, local: torch.Tensor, record: dict[str, Any]) -> DTensorShard:
        """Rebuild from a stored record (``ValueError`` if it is malformed)."""
        try:
            names = record["names"]
            coord = record["coord"]
            return cls(
                local=local,
                shape=tuple(int(d) for d in record["shape"]),
                stride=tuple(int(d) for d in record["stride"]),
                placements=tuple(tuple(p) for p in record["placements"]),
                mesh=tuple(int(d) for d in record["mesh"]),
                names=None if names is None else tuple(str(n) for n in names),
                device=str(record["device"]),
                coord=None if coord is None else tuple(int(c) for c in coord),
                offset=tuple(int(o) for o in record["offset"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed DTensor record {record!r}: {exc}") from exc

    def record(self) -> dict[str, Any]:
        """The stored record (plain data)."""
        return {
            "shape": list(self.shape),
            "stride": list(self.stride),
            "placements": [list(p) for p in self.placements],
            "mesh": list(self.mesh),
            "names": None if self.names is None else list(self.names),
            "device": self.device,
            "coord": None if self.coord is None else list(self.coord),
            "offset": list(self.offset),
        }

    def describe(self) -> str:
        """A few words for a mismatch message."""
        dtype = str(self.local.dtype).removeprefix("torch.")
        return (
            f"a DTensor {dtype}{self.shape} placed {_placements_text(self.placements)} on a "
            f"mesh {self.mesh}, local shard {tuple(self.local.shape)} at offset {self.offset}"
        )

    def differences(self, target: Any) -> list[str]:
        """How the live DTensor ``target`` differs from this record (``[]``: it fits)."""
        record = layout_of(target)
        out: list[str] = []
        for key, what in (
            ("shape", "global shape"),
            ("placements", "placements"),
            ("mesh", "mesh shape"),
            ("offset", "shard offset"),
        ):
            mine = self.record()[key]
            if record[key] != mine:
                out.append(f"{what} {_plain(record[key])} against {_plain(mine)}")
        local = target.to_local()
        if local.shape != self.local.shape or local.dtype != self.local.dtype:
            out.append(
                f"local shard {str(local.dtype).removeprefix('torch.')}{tuple(local.shape)} "
                f"against {str(self.local.dtype).removeprefix('torch.')}"
                f"{tuple(self.local.shape)}"
            )
        return out

    def to_dtensor(self, mesh: Any) -> Any:
        """A ``DTensor`` on ``mesh`` around :attr:`local` (no copy, no communication)."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            self.local,
            mesh,
            _placement_objects(self.placements),
            run_check=False,
            shape=torch.Size(self.shape),
            stride=self.stride,
        )


def _plain(value: Any) -> str:
    if isinstance(value, list) and value and isinstance(value[0], list):
        return _placements_text(value)
    return str(tuple(value))


def _placements_text(placements: Any) -> str:
    parts = [f"{p[0]}({', '.join(map(str, p[1:]))})" if len(p) > 1 else p[0] for p in placements]
    return "(" + ", ".join(parts) + ")"


def _world_mesh(device: str, names: tuple[str, ...] | None) -> Any:
    """The 1-D mesh over every rank of the default group, built without a new process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    return DeviceMesh(device, torch.arange(world), mesh_dim_names=names)


def _can_rebuild(shard: DTensorShard) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    if len(shard.mesh) != 1 or shard.mesh[0] != dist.get_world_size():
        return False
    if shard.coord is not None and shard.coord != (dist.get_rank(),):
        return False
    # With CUDA present and a gloo default group, torch gives a new mesh a new process group
    # of its own (a collective call) rather than the default one.
    return not (torch.cuda.is_available() and dist.get_backend() == "gloo")


def materialize(state: Any) -> Any:
    """``state`` with every :class:`DTensorShard` made a ``DTensor`` where possible, else its
    local tensor.

    A shard becomes a ``DTensor`` when ``torch.distributed`` is initialized and the saved mesh is
    one-dimensional over the whole world in rank order (FSDP2's usual mesh): such a mesh is made
    from the default process group, with no collective call. Any other layout (several mesh
    dimensions, no process group, another world size) gives the local tensor: building meshes
    there would create process groups collectively, which a restore must not do behind the
    caller's back. So does CUDA present with a gloo default group: torch then gives each new
    mesh a process group of its own. Dicts and lists are updated in place (they are the
    restore's own objects); tuples are rebuilt where they hold a shard.
    """
    meshes: dict[tuple[str, tuple[str, ...] | None], Any] = {}

    def convert(obj: Any) -> Any:
        t = type(obj)
        if t is DTensorShard:
            if not _can_rebuild(obj):
                return obj.local
            key = (obj.device, obj.names)
            mesh = meshes.get(key)
            if mesh is None:
                mesh = meshes[key] = _world_mesh(*key)
            return obj.to_dtensor(mesh)
        if t in MAPPINGS:
            for key_, value in list(obj.items()):
                new = convert(value)
                if new is not value:
                    obj[key_] = new
            return obj
        if t is list:
            for i, value in enumerate(obj):
                new = convert(value)
                if new is not value:
                    obj[i] = new
            return obj
        if t is tuple:
            items = tuple(convert(v) for v in obj)
            return obj if all(a is b for a, b in zip(items, obj, strict=True)) else items
        return obj

    return convert(state)


def place_like(param: torch.Tensor, value: Any, where: str) -> Any:
    """``value`` (a restored tensor or shard of ``param``'s state) as a DTensor laid out like
    ``param``, when ``param`` is a DTensor; else ``value`` unchanged.

    0-dim values (a step counter) stay plain. Raises ``ValueError`` when the local shard's shape
    is not that of ``param``'s local shard (``where`` names it in the message).
    """
    if not is_dtensor(param) or not isinstance(value, (torch.Tensor, DTensorShard)):
        return value
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensorShard):
        local = value.local
    elif isinstance(value, DTensor):
        if value.device_mesh is param.device_mesh:  # type: ignore[attr-defined]
            return value
        local = value.to_local()
    else:
        local = value
    if local.dim() == 0:
        return local  # a step counter, not sharded
    mine = param.to_local()  # type: ignore[attr-defined]
    if local.shape != mine.shape:
        raise ValueError(
            f"the restored optimizer state {where} holds a local shard of shape "
            f"{tuple(local.shape)}; the parameter's local shard is {tuple(mine.shape)}"
        )
    return DTensor.from_local(
        local,
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )

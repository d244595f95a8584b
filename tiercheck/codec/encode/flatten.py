"""Stage ``tiercheck.flatten/1``: nested training state <-> msgpack skeleton + tensors.

:func:`flatten` walks a state (the dict a training loop hands to ``save``) and splits it into a
:class:`Layout` -- a msgpack *skeleton* in which every tensor is replaced by its index, plus one
:class:`TensorSpec` per tensor -- and the list of the caller's own tensors (nothing is copied).
:func:`write_payload` copies those tensors into one flat byte buffer, the *raw payload*, at
offsets fixed by the layout; :func:`~tiercheck.codec.decode.rebuild.unflatten` (its own module, the
skeleton read back) rebuilds the state around tensors (typically views into a payload). The
skeleton's tags and the walk over a stored skeleton live in
:mod:`~tiercheck.codec.format.skeleton`, :class:`Layout` in :mod:`~tiercheck.codec.format.layout`
(importable from here). Restoring a rebuilt state into live objects in place is decoding's last
step: see :func:`tiercheck.codec.decode.statetree.load_into`.

What the skeleton holds (everything else raises :class:`~tiercheck.errors.UnsupportedObject`
naming the path of the object, unless ``allow_pickle=True``; a container that holds itself, a
nesting deeper than :data:`MAX_DEPTH` and a tensor without data -- on the ``meta`` device, a
fake tensor, a tensor subclass without storage -- are refused whatever ``allow_pickle`` says,
since no stored form of them would restore the user's data):

* ``dict`` (keys: ``str``, ``int``, ``bool``, ``float``, ``None``, ``bytes`` and tuples of these),
  ``collections.OrderedDict`` (with the ``_metadata`` attribute ``Module.state_dict()`` sets),
  ``list``, ``tuple``, ``torch.Size``;
* ``None``, ``bool``, ``int`` (any size), ``float`` (every bit pattern, NaN payloads and -0.0
  included), ``complex``, ``str``, ``bytes``, ``bytearray``, ``torch.dtype``, ``torch.device``;
* tensors of every dtype in :func:`~tiercheck.codec.format.dtypes.supported_dtypes` (strided, on any
  device, of any shape and strides: zero-size, 0-dim and non-contiguous views included; an
  ``nn.Parameter`` is saved as its data and comes back as a plain tensor --
  :func:`~tiercheck.codec.decode.statetree.load_into` restores it into the live parameter);
* numpy arrays and numpy scalars (they come back as numpy): dtypes torch has travel as typed
  tensors, any other fixed-size dtype (``>f4``, ``datetime64``, ``U5``...) as its raw bytes;
* ``DTensor``s (FSDP2 and tensor-parallel state): the local shard travels as a tensor and the
  layout (global shape and stride, placements, mesh shape, shard offsets) as plain data in the
  skeleton (see :mod:`~tiercheck.codec.format.dtensor`). They come back from ``unflatten`` as
  :class:`~tiercheck.codec.format.dtensor.DTensorShard`;
  :func:`~tiercheck.codec.decode.statetree.load_into` copies each into the local shard of a live
  DTensor whose layout matches. A blob holding one names ``tiercheck.flatten/2``.

RNG states need nothing special: ``torch.get_rng_state()`` is a ``uint8`` tensor,
``random.getstate()`` a tuple of ints, numpy's legacy ``get_state()`` a tuple holding an array,
and ``Generator.bit_generator.state`` a dict holding 128-bit ints.

Types are kept exactly: a subclass of ``dict``/``list``/``int``... other than those listed (an
``IntEnum``, a ``namedtuple``, a ``defaultdict``) is unsupported rather than silently turned into
its base class.

**Views that share storage** are saved *by value*: every path that holds a tensor gets its own
:class:`TensorSpec` and its own bytes, even when two tensors alias the same memory (tied weights
in a ``state_dict``). Restoring with ``unflatten`` gives independent tensors; restoring with
:func:`~tiercheck.codec.decode.statetree.load_into` copies into the caller's live tensors, so their
aliasing is kept as it was.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from tiercheck.codec.format.containers import CONTAINERS
from tiercheck.codec.format.dtensor import DTensorShard, is_dtensor, layout_of
from tiercheck.codec.format.dtypes import is_supported_dtype
from tiercheck.codec.format.layout import ALIGNMENT, Layout, TensorSpec, align
from tiercheck.codec.format.skeleton import (
    EXT_BYTEARRAY,
    EXT_COMPLEX,
    EXT_DEVICE,
    EXT_DTENSOR,
    EXT_DTYPE,
    EXT_NDARRAY,
    EXT_ODICT,
    EXT_PICKLE,
    EXT_REPLICA,
    EXT_SIZE,
    EXT_TENSOR,
    EXT_TUPLE,
    encode_int,
    pack,
)
from tiercheck.errors import UnsupportedObject

__all__ = [
    "ALIGNMENT",
    "MAX_DEPTH",
    "TENSOR_TYPES",
    "DTensorShard",
    "Layout",
    "ReplicaRef",
    "TensorSpec",
    "align",
    "encode_key",
    "encode_leaf",
    "flatten",
    "flatten_walk",
    "ndarray_parts",
    "replicated_record",
    "without_data",
    "write_payload",
]


#: Containers nested deeper than this are refused (:class:`~tiercheck.errors.UnsupportedObject`):
#: real training states nest a few levels, and every walker over a state (this one, the
#: restore's, msgpack's own, limited to 512) recurses once per level.
MAX_DEPTH = 100

# numpy dtypes that map one to one onto a torch dtype (native byte order only).
_NP_TO_TORCH: dict[np.dtype[Any], torch.dtype] = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.uint16): torch.uint16,
    np.dtype(np.uint32): torch.uint32,
    np.dtype(np.uint64): torch.uint64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.complex64): torch.complex64,
    np.dtype(np.complex128): torch.complex128,
}

#: The exact types of the tensors the skeleton stores as :data:`~.skeleton.EXT_TENSOR` (any
#: other tensor type is a DTensor or a subclass: refused, or pickled).
TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True, slots=True)
class ReplicaRef:
    """A reference in a skeleton: "rank ``rank`` of this same save stores the value here".

    What a rank that is not its node's first stores in place of replicated state (see
    :class:`tiercheck.Replicated`), so its blob carries none of those bytes; the value is read
    from rank ``rank``'s blob of the same version at the same path
    (:func:`~tiercheck.codec.replica.resolve`). ``record`` is set when the value is a DTensor
    placed ``Replicate()`` everywhere: this rank's own layout record of it (its mesh
    coordinate differs from the storing rank's), the local tensor coming from rank ``rank``.
    Stored as the skeleton extension 13; a blob holding one names ``tiercheck.flatten/3``.
    """

    rank: int
    record: dict[str, Any] | None = None

    def __hash__(self) -> int:
        return hash(self.rank)


def replicated_record(record: dict[str, Any], world_size: int) -> bool:
    """Whether a DTensor of layout ``record`` holds the same value on every rank of a world
    of ``world_size``: every placement ``Replicate()`` on a mesh that spans all ranks.

    A DTensor replicated over a smaller mesh (tensor parallelism inside a data-parallel
    group, a pipeline stage) may differ between meshes: it is stored by every rank as usual.
    """
    try:
        placements = record["placements"]
        size = 1
        for d in record["mesh"]:
            size *= int(d)
    except (KeyError, TypeError, ValueError):
        return False
    return size == world_size and all(list(p) == ["replicate"] for p in placements)


# --- flatten ---------------------------------------------------------------------------------


class _Flattener:
    """One walk over a state; collects tensors and builds the skeleton."""

    def __init__(
        self, allow_pickle: bool, replica: ReplicaRef | None = None, world: int = 1
    ) -> None:
        self.allow_pickle = allow_pickle
        # Set on a rank that is not its node's first: a DTensor replicated over the whole
        # world becomes a reference to that rank's copy.
        self.replica = replica
        self.world = world
        self.refs = 0
        self.tensors: list[torch.Tensor] = []
        self.entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.seen_paths: set[str] = set()
        self.dtensors = 0
        #: Indexes (into ``tensors``) of the tensors made from numpy arrays: they may share the
        #: array's memory, whose changes no version counter counts.
        self.arrays: list[int] = []
        # The containers on the current path (id -> path): a container inside itself is a
        # cycle, and their number is the depth.
        self.active: dict[int, str] = {}

    def refuse(self, obj: object, path: str, why: str = "") -> Any:
        if self.allow_pickle:
            return msgpack.ExtType(EXT_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        reason = (
            why or f"type {type(obj).__module__}.{type(obj).__qualname__} has no no-pickle form"
        )
        raise UnsupportedObject(
            f"cannot flatten state{path}: {reason}. Convert it to supported types, or pass "
            "allow_pickle=True to store it with pickle (only load such checkpoints from trusted "
            "sources)."
        )

    @staticmethod
    def never(path: str, why: str) -> UnsupportedObject:
        """What no ``allow_pickle`` can store faithfully: the error to raise."""
        return UnsupportedObject(f"cannot store state{path}: {why}")

    def add_tensor(self, tensor: torch.Tensor, path: str) -> int:
        unique = path
        n = 1
        while unique in self.seen_paths:  # only when two keys have the same repr (two NaN keys)
            n += 1
            unique = f"{path}#{n}"
        self.seen_paths.add(unique)
        self.tensors.append(tensor)
        self.entries.append((unique, tensor.dtype, tuple(tensor.shape)))
        return len(self.tensors) - 1

    def key(self, key: object, path: str) -> Any:
        t = type(key)
        if key is None or t is str or t is bool or t is float or t is bytes:
            return key
        if t is int:
            return encode_int(key)  # type: ignore[arg-type]
        if t is tuple:
            items = [self.key(k, path) for k in key]  # type: ignore[attr-defined]
            return msgpack.ExtType(EXT_TUPLE, pack(items))
        return self.refuse(key, path, f"dict key {key!r} of type {t.__qualname__} is not supported")

    def walk(self, obj: Any, path: str) -> Any:
        t = type(obj)
        if obj is None or t is bool or t is str or t is bytes or t is float:
            return obj
        if t is int:
            return encode_int(obj)
        if t in CONTAINERS:
            active = self.active
            key = id(obj)
            if key in active:
                # Pickled, it would come back as a copy holding itself, not the same object.
                raise self.never(
                    path,
                    f"it is state{active[key]} itself (a reference cycle); a checkpoint "
                    "holds a tree of values: break the cycle",
                )
            if len(active) >= MAX_DEPTH:
                raise self.never(
                    path, f"containers nested more than {MAX_DEPTH} deep; flatten the structure"
                )
            active[key] = path
            try:
                return self.container(obj, path)
            finally:
                del active[key]
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if t is np.ndarray or isinstance(obj, np.generic):
            return self.ndarray(obj, path)
        if t is torch.Size:
            return msgpack.ExtType(EXT_SIZE, pack(list(obj)))
        if t is complex:
            return msgpack.ExtType(
                EXT_COMPLEX,
                np.array([obj.real, obj.imag], dtype="<f8").tobytes(),
            )
        if t is torch.dtype:
            return msgpack.ExtType(EXT_DTYPE, str(obj).removeprefix("torch.").encode())
        if t is torch.device:
            return msgpack.ExtType(EXT_DEVICE, str(obj).encode())
        if t is bytearray:
            return msgpack.ExtType(EXT_BYTEARRAY, bytes(obj))
        if t is DTensorShard:
            return self.shard(obj.local, obj.record(), path)
        if t is ReplicaRef:
            self.refs += 1
            return msgpack.ExtType(EXT_REPLICA, pack([obj.rank, obj.record]))
        return self.refuse(obj, path)

    def container(self, obj: Any, path: str) -> Any:
        t = type(obj)
        if t is list:
            return [self.walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if t is tuple:
            items = [self.walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]
            return msgpack.ExtType(EXT_TUPLE, pack(items))
        mapping = {self.key(k, path): self.walk(v, f"{path}[{k!r}]") for k, v in obj.items()}
        if t is dict:
            return mapping
        metadata = getattr(obj, "_metadata", None)
        meta = None if metadata is None else self.walk(metadata, f"{path}._metadata")
        return msgpack.ExtType(EXT_ODICT, pack([mapping, meta]))

    def tensor(self, obj: torch.Tensor, path: str) -> Any:
        if type(obj) not in TENSOR_TYPES and is_dtensor(obj):
            return self.dtensor(obj, path)
        dataless = without_data(obj)
        if dataless:
            raise self.never(path, dataless)
        if type(obj) not in TENSOR_TYPES:
            return self.refuse(obj, path, f"tensor subclass {type(obj).__qualname__}")
        if obj.layout != torch.strided or obj.is_quantized:
            return self.refuse(obj, path, f"tensor layout {obj.layout} on {obj.device}")
        if not is_supported_dtype(obj.dtype):
            return self.refuse(obj, path, f"tensor dtype {obj.dtype}")
        return msgpack.ExtType(EXT_TENSOR, pack(self.add_tensor(obj, path)))

    def dtensor(self, obj: Any, path: str) -> Any:
        try:
            record = layout_of(obj)
        except ValueError as exc:
            return self.refuse(obj, path, str(exc))
        return self.shard(obj.to_local(), record, path)

    def shard(self, local: torch.Tensor, record: dict[str, Any], path: str) -> Any:
        dataless = without_data(local)
        if dataless:
            raise self.never(path, f"the DTensor's local shard: {dataless}")
        if type(local) not in TENSOR_TYPES:
            return self.refuse(local, path, f"DTensor local tensor {type(local).__qualname__}")
        if local.layout != torch.strided or local.is_quantized:
            return self.refuse(local, path, f"tensor layout {local.layout} on {local.device}")
        if not is_supported_dtype(local.dtype):
            return self.refuse(local, path, f"tensor dtype {local.dtype}")
        if self.replica is not None and replicated_record(record, self.world):
            self.refs += 1
            return msgpack.ExtType(EXT_REPLICA, pack([self.replica.rank, record]))
        self.dtensors += 1
        return msgpack.ExtType(EXT_DTENSOR, pack([self.add_tensor(local, path), record]))

    def ndarray(self, obj: Any, path: str) -> Any:
        parts = ndarray_parts(obj)
        if isinstance(parts, str):
            return self.refuse(obj, path, parts)
        tensor, dtype_str, shape, scalar = parts
        index = self.add_tensor(tensor, path)
        self.arrays.append(index)
        return msgpack.ExtType(EXT_NDARRAY, pack([index, dtype_str, shape, scalar]))


def without_data(tensor: torch.Tensor) -> str:
    """Why ``tensor`` holds no data that could be stored, or ``""`` when it holds some.

    A tensor on the ``meta`` device has a shape and no values; a fake tensor
    (``torch._subclasses.FakeTensor``) reports a real device over storage on ``meta``; a tensor
    subclass may have no storage at all. Stored by pickle, any of them would come back as
    something that never was the user's data.
    """
    if tensor.device.type == "meta":
        return (
            "a tensor on the meta device has a shape but no data; materialize it first "
            "(module.to_empty(device=...) and load or initialize its values)"
        )
    if type(tensor) in TENSOR_TYPES:
        return ""  # a plain tensor off the meta device always has storage with its values
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return f"tensor subclass {type(tensor).__qualname__} has no storage of its own ({exc})"
    if storage.device.type == "meta":
        return (
            f"tensor subclass {type(tensor).__qualname__} has its storage on the meta device "
            "(a fake tensor): it holds no data"
        )
    return ""


def ndarray_parts(obj: Any) -> tuple[torch.Tensor, str | None, list[int], bool] | str:
    """How a numpy array or scalar travels: ``(tensor, dtype string, shape, scalar)``.

    The tensor shares the array's memory where torch can (a private copy otherwise); the dtype
    string is ``None`` for dtypes torch has, else the numpy dtype whose raw bytes the tensor
    holds. Returns the reason as a string for a dtype that cannot be stored.
    """
    scalar = isinstance(obj, np.generic)
    arr = np.asarray(obj)
    dt = arr.dtype
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None or dt.itemsize == 0:
        return f"numpy dtype {dt}"
    torch_dtype = _NP_TO_TORCH.get(dt) if dt.isnative else None
    if torch_dtype is not None:
        # torch.from_numpy shares memory, but refuses negative strides and warns on
        # read-only arrays: those (rare) get a private copy.
        if not arr.flags.writeable or any(s < 0 or s % dt.itemsize for s in arr.strides) or scalar:
            arr = np.array(arr, order="C", copy=True)
        return torch.from_numpy(arr), None, list(arr.shape), scalar
    raw = np.array(arr, order="C", copy=True)
    return torch.from_numpy(raw.reshape(-1).view(np.uint8)), dt.str, list(arr.shape), scalar


def flatten(
    state: Any,
    *,
    allow_pickle: bool = False,
    replica: ReplicaRef | None = None,
    world_size: int = 1,
) -> tuple[Layout, list[torch.Tensor]]:
    """Split ``state`` into a :class:`Layout` and its tensors (the caller's own, in spec order).

    Nothing is copied: the returned tensors are the objects found in the state (numpy arrays
    become tensors sharing their memory). Raises :class:`~tiercheck.errors.UnsupportedObject`,
    naming the object's path (``state['optim']['param_groups'][0]['foo']``), for anything the
    skeleton cannot represent; with ``allow_pickle=True`` such objects are pickled into the
    skeleton instead.

    With ``replica`` (a reference to the rank that stores this node's replicated state), each
    DTensor placed ``Replicate()`` on a mesh of all ``world_size`` ranks is stored as that
    reference instead of its bytes (see :class:`ReplicaRef`); :class:`ReplicaRef` objects in
    the state are stored as they are.
    """
    layout, tensors, _ = flatten_walk(
        state, allow_pickle=allow_pickle, replica=replica, world_size=world_size
    )
    return layout, tensors


def flatten_walk(
    state: Any,
    *,
    allow_pickle: bool = False,
    replica: ReplicaRef | None = None,
    world_size: int = 1,
) -> tuple[Layout, list[torch.Tensor], tuple[int, ...]]:
    """:func:`flatten`, and the indexes of the tensors made from numpy arrays (they may share
    the arrays' memory: see :attr:`tiercheck.codec.encode.plan.Flat.untracked`)."""
    walker = _Flattener(allow_pickle, replica, world_size)
    with torch.no_grad():  # DTensor.to_local() is then the local tensor itself
        skeleton = pack(walker.walk(state, ""))
    layout = Layout.build(skeleton, walker.entries)
    layout.__dict__["has_dtensors"] = walker.dtensors > 0  # known: spare the skeleton scan
    layout.__dict__["has_refs"] = walker.refs > 0
    layout.__dict__["has_arrays"] = bool(walker.arrays)
    return layout, walker.tensors, tuple(walker.arrays)


# Only scalars go through it, which never touches its per-walk state: safe to share.
_SCALARS = _Flattener(allow_pickle=False)


def encode_leaf(value: Any) -> bytes:
    """The skeleton bytes :func:`flatten` writes for ``value``, a value that is neither a
    container nor a tensor (what the cached plan re-encodes when a step counter changes)."""
    return pack(_SCALARS.walk(value, ""))


def encode_key(key: object, path: str) -> bytes:
    """The skeleton bytes :func:`flatten` writes for ``key``, a key of the dict at ``path``."""
    return pack(_SCALARS.key(key, path))


# --- payload ---------------------------------------------------------------------------------


def write_payload(
    layout: Layout,
    tensors: Sequence[torch.Tensor],
    dest: torch.Tensor,
    *,
    non_blocking: bool = False,
) -> None:
    """Copy ``tensors`` into ``dest`` at their layout offsets and zero every padding byte.

    ``dest`` is a uint8 1-D tensor of at least ``layout.payload_nbytes`` bytes (bytes past that
    are left alone); it may be a ``torch.frombuffer`` view over a writable mmap or a blob's own
    memory. Afterwards ``dest[:payload_nbytes]`` is a pure function of the state's values.

    Each tensor is one ``Tensor.copy_`` (strided sources are gathered by torch), so this runs at
    memory-copy speed. With ``non_blocking=True``, copies from a CUDA device into pinned host
    memory are asynchronous: the caller must synchronize (``torch.cuda.synchronize()`` or an
    event) before reading ``dest``.
    """
    if len(tensors) != len(layout.specs):
        raise ValueError(f"got {len(tensors)} tensors for a layout of {len(layout.specs)}")
    views = layout.views(dest)
    with torch.no_grad():
        for spec, src, view in zip(layout.specs, tensors, views, strict=True):
            if src.dtype != spec.dtype or tuple(src.shape) != spec.shape:
                raise ValueError(
                    f"tensor at {spec.path} is {src.dtype}{tuple(src.shape)}; the layout "
                    f"expects {spec.dtype}{spec.shape}"
                )
            if spec.nbytes:
                view.copy_(src, non_blocking=non_blocking)
        for start, end in layout.gaps:
            dest[start:end].zero_()

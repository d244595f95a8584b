"""Stage ``tiercheck.flatten/1``: nested training state <-> msgpack skeleton + tensors.

:func:`flatten` walks a state (the dict a training loop hands to ``save``) and splits it into a
:class:`Layout` -- a msgpack *skeleton* in which every tensor is replaced by its index, plus one
:class:`TensorSpec` per tensor -- and the list of the caller's own tensors (nothing is copied).
:func:`write_payload` copies those tensors into one flat byte buffer, the *raw payload*, at
offsets fixed by the layout; :func:`~tiercheck.codec.rebuild.unflatten` (its own module, the
skeleton read back) rebuilds the state around tensors (typically views into a payload).
Restoring a rebuilt state into live objects in place is not the codec's job: see
:func:`tiercheck.statetree.load_into`.

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
* tensors of every dtype in :func:`~tiercheck.codec.dtypes.supported_dtypes` (strided, on any
  device, of any shape and strides: zero-size, 0-dim and non-contiguous views included; an
  ``nn.Parameter`` is saved as its data and comes back as a plain tensor --
  :func:`~tiercheck.statetree.load_into` restores it into the live parameter);
* numpy arrays and numpy scalars (they come back as numpy): dtypes torch has travel as typed
  tensors, any other fixed-size dtype (``>f4``, ``datetime64``, ``U5``...) as its raw bytes;
* ``DTensor``s (FSDP2 and tensor-parallel state): the local shard travels as a tensor and the
  layout (global shape and stride, placements, mesh shape, shard offsets) as plain data in the
  skeleton (see :mod:`~tiercheck.codec.dtensor`). They come back from ``unflatten`` as
  :class:`~tiercheck.codec.dtensor.DTensorShard`; :func:`~tiercheck.statetree.load_into` copies
  each into the local shard of a live DTensor whose layout matches. A blob holding one names
  ``tiercheck.flatten/2``.

RNG states need nothing special: ``torch.get_rng_state()`` is a ``uint8`` tensor,
``random.getstate()`` a tuple of ints, numpy's legacy ``get_state()`` a tuple holding an array,
and ``Generator.bit_generator.state`` a dict holding 128-bit ints.

Types are kept exactly: a subclass of ``dict``/``list``/``int``... other than those listed (an
``IntEnum``, a ``namedtuple``, a ``defaultdict``) is unsupported rather than silently turned into
its base class.

**Views that share storage** are saved *by value*: every path that holds a tensor gets its own
:class:`TensorSpec` and its own bytes, even when two tensors alias the same memory (tied weights
in a ``state_dict``). Restoring with ``unflatten`` gives independent tensors; restoring with
:func:`~tiercheck.statetree.load_into` copies into the caller's live tensors, so their aliasing is
kept as it was.
"""

from __future__ import annotations

import collections
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import msgpack
import numpy as np
import torch

from tiercheck.codec.dtensor import DTensorShard, is_dtensor, layout_of
from tiercheck.codec.dtypes import dtype_name, is_supported_dtype
from tiercheck.errors import UnsupportedObject

__all__ = [
    "ALIGNMENT",
    "MAX_DEPTH",
    "DTensorShard",
    "Layout",
    "ReplicaRef",
    "TensorSpec",
    "align",
    "flatten",
    "flatten_walk",
    "without_data",
    "write_payload",
]

#: Every tensor starts at a multiple of this many bytes in the raw payload (a cache line, and a
#: multiple of every element size, so typed views into the payload are always legal).
ALIGNMENT = 64

#: Containers nested deeper than this are refused (:class:`~tiercheck.errors.UnsupportedObject`):
#: real training states nest a few levels, and every walker over a state (this one, the
#: restore's, msgpack's own, limited to 512) recurses once per level.
MAX_DEPTH = 100

# msgpack extension codes of the skeleton. Part of the ``tiercheck.flatten`` format: never
# renumber; add new codes only together with a new stage version.
_EXT_TENSOR = 1
_EXT_TUPLE = 2
_EXT_ODICT = 3
_EXT_SIZE = 4
_EXT_BIGINT = 5
_EXT_NDARRAY = 6
_EXT_COMPLEX = 7
_EXT_DTYPE = 8
_EXT_DEVICE = 9
_EXT_BYTEARRAY = 10
_EXT_PICKLE = 11
# Added with ``tiercheck.flatten/2`` (a blob whose skeleton holds one names that stage).
_EXT_DTENSOR = 12
# Added with ``tiercheck.flatten/3``: replicated state another rank of the same save stores
# (see :class:`ReplicaRef`).
_EXT_REPLICA = 13

_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 64) - 1

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

_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def align(n: int) -> int:
    """``n`` rounded up to the next multiple of :data:`ALIGNMENT`."""
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


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


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Where one tensor of the state lives in the raw payload.

    ``path`` is the tensor's place in the state written as subscripts (``"['model']['w']"``);
    it is unique within a layout and is what a delta matches tensors by. ``offset`` is the byte
    offset in the raw payload (a multiple of :data:`ALIGNMENT`) and ``nbytes`` the size of the
    tensor's elements (``numel * element_size``).
    """

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """The shape of a flattened state: the skeleton and where each tensor sits in the payload.

    The raw payload is a pure function of the layout and the tensors' values: tensors are placed
    in spec order, each at the next multiple of :data:`ALIGNMENT`, and every padding byte is zero
    (see :func:`write_payload`). ``payload_nbytes`` is a multiple of :data:`ALIGNMENT` (0 when the
    state holds no tensor bytes).
    """

    skeleton: bytes
    specs: tuple[TensorSpec, ...]
    payload_nbytes: int

    @classmethod
    def build(
        cls,
        skeleton: bytes,
        entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    ) -> Layout:
        """Lay out tensors given as ``(path, dtype, shape)`` in order (offsets are computed)."""
        specs: list[TensorSpec] = []
        end = 0
        for path, dtype, shape in entries:
            offset = align(end)
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * dtype.itemsize
            specs.append(TensorSpec(path, dtype, tuple(shape), offset, nbytes))
            end = offset + nbytes
        return cls(skeleton, tuple(specs), align(end))

    @cached_property
    def index(self) -> dict[str, int]:
        """Spec index by path."""
        return {spec.path: i for i, spec in enumerate(self.specs)}

    @cached_property
    def gaps(self) -> tuple[tuple[int, int], ...]:
        """The ``(start, end)`` byte ranges of the payload that hold padding (always zero)."""
        gaps: list[tuple[int, int]] = []
        end = 0
        for spec in self.specs:
            if spec.offset > end:
                gaps.append((end, spec.offset))
            end = max(end, spec.offset + spec.nbytes)
        if self.payload_nbytes > end:
            gaps.append((end, self.payload_nbytes))
        return tuple(gaps)

    @cached_property
    def _canonical(self) -> bool:
        rebuilt = Layout.build(self.skeleton, [(s.path, s.dtype, s.shape) for s in self.specs])
        return rebuilt == self and len(self.index) == len(self.specs)

    def is_canonical(self) -> bool:
        """Whether offsets and sizes are exactly what :meth:`build` gives (paths unique too).

        Layouts from :func:`flatten` always are; encoders refuse any other.
        """
        return self._canonical

    def views(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Typed, shaped views of every tensor in ``payload`` (a uint8 1-D tensor); no copy.

        The views share memory with ``payload``: they are valid while it is, and see any later
        write into it.
        """
        _check_payload(payload, self.payload_nbytes, "payload")
        views: list[torch.Tensor] = []
        for dtype, start, end, sizes, keep in self._view_runs:
            # One split per run of same-dtype tensors: the pieces alternate tensor, padding.
            pieces = torch.split_with_sizes(payload[start:end].view(dtype), sizes)
            for piece, spec in zip(pieces[::2], self.specs[keep], strict=True):
                views.append(piece if len(spec.shape) == 1 else piece.view(spec.shape))
        return views

    @cached_property
    def _view_runs(self) -> list[tuple[torch.dtype, int, int, list[int], slice]]:
        """Per run of consecutive same-dtype specs: its byte range, the element counts of its
        pieces (each tensor, then the padding after it), and the specs it covers."""
        runs = []
        specs = self.specs
        i = 0
        while i < len(specs):
            dtype = specs[i].dtype
            j = i
            while j < len(specs) and specs[j].dtype == dtype:
                j += 1
            end = specs[j].offset if j < len(specs) else self.payload_nbytes
            sizes: list[int] = []
            for k in range(i, j):
                following = specs[k + 1].offset if k + 1 < j else end
                sizes.append(specs[k].nbytes // dtype.itemsize)
                sizes.append((following - specs[k].offset - specs[k].nbytes) // dtype.itemsize)
            runs.append((dtype, specs[i].offset, end, sizes, slice(i, j)))
            i = j
        return runs

    @cached_property
    def packed_entries(self) -> bytes:
        """The msgpack encoding of ``[[path, dtype name, shape], ...]``, one entry per spec.

        This is the tensor table of a blob header (:mod:`~tiercheck.codec.blob`); computed once
        per layout and shared by :meth:`with_skeleton`, so a save whose structure repeats does
        not encode thousands of entries again.
        """
        return msgpack.packb(
            [[s.path, dtype_name(s.dtype), list(s.shape)] for s in self.specs], use_bin_type=True
        )

    @cached_property
    def has_refs(self) -> bool:
        """Whether the skeleton holds a :class:`ReplicaRef` (such blobs name
        ``tiercheck.flatten/3``); known without a scan for layouts :func:`flatten` made."""
        return _EXT_REPLICA in self._ext_codes

    @cached_property
    def _ext_codes(self) -> frozenset[int]:
        """The extension codes of the skeleton, containers opened (empty when malformed)."""
        found: set[int] = set()

        def hook(code: int, data: bytes) -> None:
            found.add(code)
            if code in (_EXT_TUPLE, _EXT_ODICT):
                msgpack.unpackb(data, ext_hook=hook, strict_map_key=False, raw=True)

        try:
            msgpack.unpackb(self.skeleton, ext_hook=hook, strict_map_key=False, raw=True)
        except (msgpack.UnpackException, ValueError, TypeError):
            return frozenset()
        return frozenset(found)

    @cached_property
    def has_dtensors(self) -> bool:
        """Whether the skeleton holds a DTensor record (such blobs name ``tiercheck.flatten/2``).

        Known without a scan for layouts made by :func:`flatten` and the cached plan; otherwise
        found by walking the skeleton once (a malformed one counts as ``False``: decoding it
        reports the problem).
        """
        return _EXT_DTENSOR in self._ext_codes

    def with_skeleton(self, skeleton: bytes) -> Layout:
        """The same tensors at the same offsets under another skeleton.

        What a save whose non-tensor values changed (a step counter, a learning rate) needs:
        the derived tables (:attr:`index`, :attr:`gaps`, :attr:`packed_entries`, the
        canonical check) depend on the specs only and are shared, not recomputed.
        """
        new = Layout(skeleton, self.specs, self.payload_nbytes)
        for name in ("index", "gaps", "_canonical", "packed_entries", "_view_runs"):
            if name in self.__dict__:
                new.__dict__[name] = self.__dict__[name]
        return new

    def compatible(self, other: Layout) -> bool:
        """Whether ``other`` places the same tensors (paths, dtypes, shapes) at the same offsets.

        Compatible layouts have interchangeable payloads; their skeletons (the non-tensor
        values, such as a step counter) may differ.
        """
        return self.specs == other.specs and self.payload_nbytes == other.payload_nbytes


def _check_payload(payload: torch.Tensor, nbytes: int, what: str) -> None:
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"{what} must be a 1-D uint8 tensor, got {payload.dtype} {payload.shape}")
    if payload.numel() < nbytes:
        raise ValueError(f"{what} holds {payload.numel()} bytes; the layout needs {nbytes}")
    # Typed views need the byte offset to be a multiple of the element size (up to 16 bytes).
    if payload.storage_offset() % 16:
        raise ValueError(f"{what} must start at a multiple of 16 bytes within its storage")


# --- flatten ---------------------------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogatepass")
    assert isinstance(data, bytes)
    return data


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
            return msgpack.ExtType(_EXT_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
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
            return self.integer(key)  # type: ignore[arg-type]
        if t is tuple:
            items = [self.key(k, path) for k in key]  # type: ignore[attr-defined]
            return msgpack.ExtType(_EXT_TUPLE, _pack(items))
        return self.refuse(key, path, f"dict key {key!r} of type {t.__qualname__} is not supported")

    @staticmethod
    def integer(value: int) -> Any:
        if _INT_MIN <= value <= _INT_MAX:
            return value
        return msgpack.ExtType(
            _EXT_BIGINT, value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        )

    def walk(self, obj: Any, path: str) -> Any:
        t = type(obj)
        if obj is None or t is bool or t is str or t is bytes or t is float:
            return obj
        if t is int:
            return self.integer(obj)
        if t is dict or t is list or t is tuple or t is collections.OrderedDict:
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
            return msgpack.ExtType(_EXT_SIZE, _pack(list(obj)))
        if t is complex:
            return msgpack.ExtType(
                _EXT_COMPLEX,
                np.array([obj.real, obj.imag], dtype="<f8").tobytes(),
            )
        if t is torch.dtype:
            return msgpack.ExtType(_EXT_DTYPE, str(obj).removeprefix("torch.").encode())
        if t is torch.device:
            return msgpack.ExtType(_EXT_DEVICE, str(obj).encode())
        if t is bytearray:
            return msgpack.ExtType(_EXT_BYTEARRAY, bytes(obj))
        if t is DTensorShard:
            return self.shard(obj.local, obj.record(), path)
        if t is ReplicaRef:
            self.refs += 1
            return msgpack.ExtType(_EXT_REPLICA, _pack([obj.rank, obj.record]))
        return self.refuse(obj, path)

    def container(self, obj: Any, path: str) -> Any:
        t = type(obj)
        if t is list:
            return [self.walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if t is tuple:
            items = [self.walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]
            return msgpack.ExtType(_EXT_TUPLE, _pack(items))
        mapping = {self.key(k, path): self.walk(v, f"{path}[{k!r}]") for k, v in obj.items()}
        if t is dict:
            return mapping
        metadata = getattr(obj, "_metadata", None)
        meta = None if metadata is None else self.walk(metadata, f"{path}._metadata")
        return msgpack.ExtType(_EXT_ODICT, _pack([mapping, meta]))

    def tensor(self, obj: torch.Tensor, path: str) -> Any:
        if type(obj) not in _TENSOR_TYPES and is_dtensor(obj):
            return self.dtensor(obj, path)
        dataless = without_data(obj)
        if dataless:
            raise self.never(path, dataless)
        if type(obj) not in _TENSOR_TYPES:
            return self.refuse(obj, path, f"tensor subclass {type(obj).__qualname__}")
        if obj.layout != torch.strided or obj.is_quantized:
            return self.refuse(obj, path, f"tensor layout {obj.layout} on {obj.device}")
        if not is_supported_dtype(obj.dtype):
            return self.refuse(obj, path, f"tensor dtype {obj.dtype}")
        return msgpack.ExtType(_EXT_TENSOR, _pack(self.add_tensor(obj, path)))

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
        if type(local) not in _TENSOR_TYPES:
            return self.refuse(local, path, f"DTensor local tensor {type(local).__qualname__}")
        if local.layout != torch.strided or local.is_quantized:
            return self.refuse(local, path, f"tensor layout {local.layout} on {local.device}")
        if not is_supported_dtype(local.dtype):
            return self.refuse(local, path, f"tensor dtype {local.dtype}")
        if self.replica is not None and replicated_record(record, self.world):
            self.refs += 1
            return msgpack.ExtType(_EXT_REPLICA, _pack([self.replica.rank, record]))
        self.dtensors += 1
        return msgpack.ExtType(_EXT_DTENSOR, _pack([self.add_tensor(local, path), record]))

    def ndarray(self, obj: Any, path: str) -> Any:
        parts = ndarray_parts(obj)
        if isinstance(parts, str):
            return self.refuse(obj, path, parts)
        tensor, dtype_str, shape, scalar = parts
        index = self.add_tensor(tensor, path)
        self.arrays.append(index)
        return msgpack.ExtType(_EXT_NDARRAY, _pack([index, dtype_str, shape, scalar]))


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
    if type(tensor) in _TENSOR_TYPES:
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
    the arrays' memory: see :attr:`tiercheck.codec.plan.Flat.untracked`)."""
    walker = _Flattener(allow_pickle, replica, world_size)
    with torch.no_grad():  # DTensor.to_local() is then the local tensor itself
        skeleton = _pack(walker.walk(state, ""))
    layout = Layout.build(skeleton, walker.entries)
    layout.__dict__["has_dtensors"] = walker.dtensors > 0  # known: spare the skeleton scan
    layout.__dict__["has_refs"] = walker.refs > 0
    return layout, walker.tensors, tuple(walker.arrays)


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


def __getattr__(name: str) -> Any:
    # ``unflatten`` lives in :mod:`.rebuild` (which imports this module); importing it from
    # here keeps working.
    if name == "unflatten":
        from tiercheck.codec.rebuild import unflatten

        return unflatten
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

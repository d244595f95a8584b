"""Stage ``tiercheck.flatten/1``: nested training state <-> msgpack skeleton + tensors.

:func:`flatten` walks a state (the dict a training loop hands to ``save``) and splits it into a
:class:`Layout` -- a msgpack *skeleton* in which every tensor is replaced by its index, plus one
:class:`TensorSpec` per tensor -- and the list of the caller's own tensors (nothing is copied).
:func:`write_payload` copies those tensors into one flat byte buffer, the *raw payload*, at
offsets fixed by the layout; :func:`unflatten` rebuilds the state around tensors (typically views
into a payload); :func:`load_into` restores a rebuilt state into live objects in place, after
:func:`check_into` found that they match (shapes, dtypes, keys, lengths: else
:class:`~tiercheck.errors.StateMismatch`, and nothing is written).

What the skeleton holds (everything else raises :class:`~tiercheck.errors.UnsupportedObject`
naming the path of the object, unless ``allow_pickle=True``):

* ``dict`` (keys: ``str``, ``int``, ``bool``, ``float``, ``None``, ``bytes`` and tuples of these),
  ``collections.OrderedDict`` (with the ``_metadata`` attribute ``Module.state_dict()`` sets),
  ``list``, ``tuple``, ``torch.Size``;
* ``None``, ``bool``, ``int`` (any size), ``float`` (every bit pattern, NaN payloads and -0.0
  included), ``complex``, ``str``, ``bytes``, ``bytearray``, ``torch.dtype``, ``torch.device``;
* tensors of every dtype in :func:`~tiercheck.codec.dtypes.supported_dtypes` (strided, on any
  device, of any shape and strides: zero-size, 0-dim and non-contiguous views included; an
  ``nn.Parameter`` is saved as its data and comes back as a plain tensor -- :func:`load_into`
  restores it into the live parameter);
* numpy arrays and numpy scalars (they come back as numpy): dtypes torch has travel as typed
  tensors, any other fixed-size dtype (``>f4``, ``datetime64``, ``U5``...) as its raw bytes;
* ``DTensor``s (FSDP2 and tensor-parallel state): the local shard travels as a tensor and the
  layout (global shape and stride, placements, mesh shape, shard offsets) as plain data in the
  skeleton (see :mod:`~tiercheck.codec.dtensor`). They come back from :func:`unflatten` as
  :class:`~tiercheck.codec.dtensor.DTensorShard`; :func:`load_into` copies each into the local
  shard of a live DTensor whose layout matches. A blob holding one names ``tiercheck.flatten/2``.

RNG states need nothing special: ``torch.get_rng_state()`` is a ``uint8`` tensor,
``random.getstate()`` a tuple of ints, numpy's legacy ``get_state()`` a tuple holding an array,
and ``Generator.bit_generator.state`` a dict holding 128-bit ints.

Types are kept exactly: a subclass of ``dict``/``list``/``int``... other than those listed (an
``IntEnum``, a ``namedtuple``, a ``defaultdict``) is unsupported rather than silently turned into
its base class.

**Views that share storage** are saved *by value*: every path that holds a tensor gets its own
:class:`TensorSpec` and its own bytes, even when two tensors alias the same memory (tied weights
in a ``state_dict``). Restoring with :func:`unflatten` gives independent tensors; restoring with
:func:`load_into` copies into the caller's live tensors, so their aliasing is kept as it was.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
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
from tiercheck.errors import FormatError, StateMismatch, UnsupportedObject

__all__ = [
    "ALIGNMENT",
    "DTensorShard",
    "Layout",
    "Lenient",
    "TensorSpec",
    "check_into",
    "flatten",
    "load_into",
    "own_copy",
    "unflatten",
    "write_payload",
]

#: Every tensor starts at a multiple of this many bytes in the raw payload (a cache line, and a
#: multiple of every element size, so typed views into the payload are always legal).
ALIGNMENT = 64

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


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


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
            offset = _align(end)
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * dtype.itemsize
            specs.append(TensorSpec(path, dtype, tuple(shape), offset, nbytes))
            end = offset + nbytes
        return cls(skeleton, tuple(specs), _align(end))

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
    def has_dtensors(self) -> bool:
        """Whether the skeleton holds a DTensor record (such blobs name ``tiercheck.flatten/2``).

        Known without a scan for layouts made by :func:`flatten` and the cached plan; otherwise
        found by walking the skeleton once (a malformed one counts as ``False``: decoding it
        reports the problem).
        """
        found = False

        def hook(code: int, data: bytes) -> None:
            nonlocal found
            if code == _EXT_DTENSOR:
                found = True
            elif code in (_EXT_TUPLE, _EXT_ODICT):
                msgpack.unpackb(data, ext_hook=hook, strict_map_key=False, raw=True)

        try:
            msgpack.unpackb(self.skeleton, ext_hook=hook, strict_map_key=False, raw=True)
        except (msgpack.UnpackException, ValueError, TypeError):
            return False
        return found

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

    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.tensors: list[torch.Tensor] = []
        self.entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.seen_paths: set[str] = set()
        self.dtensors = 0
        # ids of the containers on the current path: a container inside itself is a cycle.
        self.active: set[int] = set()

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
            if id(obj) in self.active:
                return self.refuse(obj, path, "the container holds itself (a reference cycle)")
            self.active.add(id(obj))
            try:
                return self.container(obj, path)
            finally:
                self.active.discard(id(obj))
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
        if type(obj) not in _TENSOR_TYPES:
            return self.refuse(obj, path, f"tensor subclass {type(obj).__qualname__}")
        if obj.layout != torch.strided or obj.is_quantized or obj.device.type == "meta":
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
        if type(local) not in _TENSOR_TYPES:
            return self.refuse(local, path, f"DTensor local tensor {type(local).__qualname__}")
        if local.layout != torch.strided or local.is_quantized or local.device.type == "meta":
            return self.refuse(local, path, f"tensor layout {local.layout} on {local.device}")
        if not is_supported_dtype(local.dtype):
            return self.refuse(local, path, f"tensor dtype {local.dtype}")
        self.dtensors += 1
        return msgpack.ExtType(_EXT_DTENSOR, _pack([self.add_tensor(local, path), record]))

    def ndarray(self, obj: Any, path: str) -> Any:
        parts = ndarray_parts(obj)
        if isinstance(parts, str):
            return self.refuse(obj, path, parts)
        tensor, dtype_str, shape, scalar = parts
        index = self.add_tensor(tensor, path)
        return msgpack.ExtType(_EXT_NDARRAY, _pack([index, dtype_str, shape, scalar]))


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


def flatten(state: Any, *, allow_pickle: bool = False) -> tuple[Layout, list[torch.Tensor]]:
    """Split ``state`` into a :class:`Layout` and its tensors (the caller's own, in spec order).

    Nothing is copied: the returned tensors are the objects found in the state (numpy arrays
    become tensors sharing their memory). Raises :class:`~tiercheck.errors.UnsupportedObject`,
    naming the object's path (``state['optim']['param_groups'][0]['foo']``), for anything the
    skeleton cannot represent; with ``allow_pickle=True`` such objects are pickled into the
    skeleton instead.
    """
    walker = _Flattener(allow_pickle)
    with torch.no_grad():  # DTensor.to_local() is then the local tensor itself
        skeleton = _pack(walker.walk(state, ""))
    layout = Layout.build(skeleton, walker.entries)
    layout.__dict__["has_dtensors"] = walker.dtensors > 0  # known: spare the skeleton scan
    return layout, walker.tensors


# --- unflatten -------------------------------------------------------------------------------


class _Unflattener:
    def __init__(self, tensors: Sequence[torch.Tensor], allow_pickle: bool) -> None:
        self.tensors = tensors
        self.allow_pickle = allow_pickle

    def unpack(self, data: bytes) -> Any:
        return msgpack.unpackb(
            data,
            ext_hook=self.ext_hook,
            strict_map_key=False,
            raw=False,
            use_list=True,
            unicode_errors="surrogatepass",
        )

    def tensor(self, index: object) -> torch.Tensor:
        if type(index) is not int or not 0 <= index < len(self.tensors):
            raise FormatError(
                f"skeleton refers to tensor {index!r}; the layout has {len(self.tensors)}"
            )
        return self.tensors[index]

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == _EXT_TENSOR:
            # The index is a msgpack int; the one-byte form (positive fixint, index < 128) and
            # the uint16 form cover most states without a nested unpack.
            first = data[0] if data else 0xC1
            if len(data) == 1 and first < 0x80:
                return self.tensor(first)
            if len(data) == 3 and first == 0xCD:
                return self.tensor(int.from_bytes(data[1:], "big"))
            return self.tensor(self.unpack(data))
        if code == _EXT_TUPLE:
            return tuple(self.unpack(data))
        if code == _EXT_ODICT:
            mapping, meta = self.unpack(data)
            od = collections.OrderedDict(mapping)
            if meta is not None:
                od._metadata = meta  # type: ignore[attr-defined]
            return od
        if code == _EXT_SIZE:
            return torch.Size(self.unpack(data))
        if code == _EXT_BIGINT:
            return int.from_bytes(data, "little", signed=True)
        if code == _EXT_NDARRAY:
            return self.ndarray(self.unpack(data))
        if code == _EXT_COMPLEX:
            re, im = np.frombuffer(data, dtype="<f8", count=2).tolist()
            return complex(re, im)
        if code == _EXT_DTYPE:
            dtype = getattr(torch, data.decode(), None)
            if not isinstance(dtype, torch.dtype):
                raise FormatError(f"skeleton names an unknown torch dtype {data!r}")
            return dtype
        if code == _EXT_DEVICE:
            return torch.device(data.decode())
        if code == _EXT_BYTEARRAY:
            return bytearray(data)
        if code == _EXT_DTENSOR:
            index, record = self.unpack(data)
            if type(record) is not dict:
                raise FormatError(f"skeleton holds a malformed DTensor record {record!r}")
            return DTensorShard.from_record(self.tensor(index), record)
        if code == _EXT_PICKLE:
            if not self.allow_pickle:
                raise UnsupportedObject(
                    "the state holds a pickled object; pass allow_pickle=True to load it "
                    "(only for checkpoints from trusted sources: unpickling can run code)"
                )
            return pickle.loads(data)  # noqa: S301 -- explicit opt-in, documented as unsafe
        raise FormatError(f"skeleton holds unknown extension code {code}")

    def ndarray(self, fields: Any) -> Any:
        index, dtype_str, shape, scalar = fields
        tensor = self.tensor(index)
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if dtype_str is None:
            arr = tensor.numpy()
        else:
            dt = np.dtype(dtype_str)
            if dt.hasobject:
                raise FormatError(f"skeleton holds a numpy array of object dtype {dtype_str!r}")
            arr = tensor.numpy().view(dt).reshape(shape)
        return arr[()] if scalar else arr


def unflatten(
    layout: Layout, tensors: Sequence[torch.Tensor], *, allow_pickle: bool = False
) -> Any:
    """Rebuild the state of ``layout`` around ``tensors`` (one per spec, typically its views).

    Tensors are placed as given (no copy); numpy arrays come back as arrays sharing the tensors'
    memory. A skeleton holding pickled objects needs ``allow_pickle=True``, else
    :class:`~tiercheck.errors.UnsupportedObject`; a malformed skeleton raises
    :class:`~tiercheck.errors.FormatError`.
    """
    if len(tensors) != len(layout.specs):
        raise ValueError(f"got {len(tensors)} tensors for a layout of {len(layout.specs)}")
    try:
        return _Unflattener(tensors, allow_pickle).unpack(layout.skeleton)
    except (msgpack.UnpackException, ValueError, TypeError, KeyError) as exc:
        if isinstance(exc, (FormatError, UnsupportedObject)):
            raise
        raise FormatError(f"malformed state skeleton: {exc}") from exc


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


# --- load_into -------------------------------------------------------------------------------

#: At most this many mismatch lines go into a :class:`~tiercheck.errors.StateMismatch` message.
_MAX_MISMATCH_LINES = 50


class Lenient:
    """The restore target standing for a ``Stateful`` object: its current ``state_dict()``.

    :func:`check_into` compares the version with ``template`` allowing keys that only one side
    holds (a fresh optimizer has no state yet), and reports a version that lacks the entry
    altogether; :func:`load_into` fills ``template`` in place and returns it, for the caller to
    hand to ``owner.load_state_dict`` (see :mod:`tiercheck.stateful`).
    """

    __slots__ = ("owner", "template")

    def __init__(self, owner: Any, template: Any) -> None:
        self.owner = owner
        self.template = template


def _kind(obj: Any) -> str:
    """The structural kind of ``obj``: ``tensor``, ``dtensor`` (a live DTensor or a stored
    one), ``array``, ``mapping``, ``list``, ``tuple``, ``stateful`` (a
    :class:`Lenient` target), or ``leaf`` (a value, replaced whole by a restore)."""
    t = type(obj)
    if t is DTensorShard:
        return "dtensor"
    if isinstance(obj, torch.Tensor):
        return "tensor" if t in _PLAIN_TENSORS or not is_dtensor(obj) else "dtensor"
    if t is Lenient:
        return "stateful"
    if t is np.ndarray:
        return "array"
    if t is dict or t is collections.OrderedDict:
        return "mapping"
    if t is list:
        return "list"
    if t is tuple:
        return "tuple"
    return "leaf"


def _an(word: str) -> str:
    return f"an {word}" if word[:1].lower() in "aeiou" else f"a {word}"


def _items(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _typed_shape(obj: torch.Tensor | np.ndarray[Any, Any]) -> str:
    if isinstance(obj, torch.Tensor):
        return f"{str(obj.dtype).removeprefix('torch.')}{tuple(obj.shape)}"
    return f"{obj.dtype}{tuple(obj.shape)}"


def _describe(obj: Any) -> str:
    """``obj`` in a few words, for a mismatch line."""
    kind = _kind(obj)
    if kind == "tensor":
        return f"a tensor {_typed_shape(obj)}"
    if kind == "dtensor":
        if type(obj) is DTensorShard:
            return obj.describe()
        return f"a DTensor {_typed_shape(obj)} placed {tuple(obj.placements)}"
    if kind == "stateful":
        return f"a Stateful {type(obj.owner).__qualname__}"
    if kind == "array":
        return f"a numpy array {_typed_shape(obj)}"
    if kind == "mapping":
        return f"{_an(type(obj).__name__)} of {_items(len(obj), 'key')}"
    if kind in ("list", "tuple"):
        return f"a {kind} of {_items(len(obj), 'item')}"
    if obj is None:
        return "None"
    return _an(f"{type(obj).__qualname__} value")


# A path in the state as nested pairs ``(parent, key)`` (``()`` is the root), formatted only
# when a mismatch is reported: building a string per visited node would cost more than the
# check itself in a state of thousands of tensors.
_Path = tuple[Any, ...]


def _where(path: _Path) -> str:
    keys = []
    while path:
        path, key = path
        keys.append(f"[{key!r}]")
    return "state" + "".join(reversed(keys))


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_IS_CPU = operator.attrgetter("is_cpu")


def _check(target: Any, source: Any, path: _Path, strict: bool, out: list[str]) -> None:
    if type(source) is torch.Tensor and type(target) in _PLAIN_TENSORS:
        # The common case, first (a restored tensor into a live one): same test as below.
        if target.shape != source.shape or target.dtype != source.dtype:
            out.append(
                f"{_where(path)}: the target holds {_typed_shape(target)}, "
                f"the version {_typed_shape(source)}"
            )
        elif target.is_inference() and not torch.is_inference_mode_enabled():
            out.append(
                f"{_where(path)}: the target holds an inference tensor "
                f"{_typed_shape(target)}, which cannot be written outside "
                "torch.inference_mode()"
            )
        return
    tk, sk = _kind(target), _kind(source)
    if tk == "stateful":
        # A Stateful object's current state_dict(): a fresh object (an optimizer before its
        # first step) lacks entries the version holds, so keys only one side holds are fine;
        # its load_state_dict() judges what it is given.
        _check(target.template, source, path, False, out)
        return
    if tk != sk:
        # Two values of different types are not structure: the version's value replaces the
        # target's. Anything else (a tensor where the version holds an int...) is.
        if tk != "leaf" or sk != "leaf":
            out.append(
                f"{_where(path)}: the target holds {_describe(target)}, "
                f"the version {_describe(source)}"
            )
        return
    if tk == "tensor":
        # The device is not compared: copying across devices is how a restore reaches a GPU.
        if target.shape != source.shape or target.dtype != source.dtype:
            out.append(
                f"{_where(path)}: the target holds {_typed_shape(target)}, "
                f"the version {_typed_shape(source)}"
            )
        elif target.is_inference() and not torch.is_inference_mode_enabled():
            out.append(
                f"{_where(path)}: the target holds an inference tensor "
                f"{_typed_shape(target)}, which cannot be written outside "
                "torch.inference_mode()"
            )
    elif tk == "dtensor":
        if type(target) is DTensorShard or type(source) is not DTensorShard:
            out.append(
                f"{_where(path)}: the target holds {_describe(target)}, "
                f"the version {_describe(source)}"
            )
            return
        differences = source.differences(target)
        if differences:
            out.append(
                f"{_where(path)}: the target's DTensor differs from the version's: "
                + "; ".join(differences)
                + " (the target's value first)"
            )
    elif tk == "array":
        if target.shape != source.shape or target.dtype != source.dtype:
            out.append(
                f"{_where(path)}: the target holds {_typed_shape(target)}, "
                f"the version {_typed_shape(source)}"
            )
        elif not target.flags.writeable and not np.shares_memory(target, source):
            out.append(
                f"{_where(path)}: the target holds a read-only numpy array {_typed_shape(target)}, "
                "which cannot be restored in place"
            )
    elif tk == "mapping":
        for key, value in source.items():
            if key in target:
                _check(target[key], value, (path, key), strict, out)
            elif strict:
                out.append(f"{_where(path)}: the version holds key {key!r} that the target lacks")
        out.extend(
            f"{_where(path)}: the target holds a Stateful at key {key!r} that the version lacks "
            "(nothing to load into it)"
            for key, value in target.items()
            if not strict and type(value) is Lenient and key not in source
        )
        if strict:
            out.extend(
                f"{_where(path)}: the target holds key {key!r} that the version lacks"
                for key in target
                if key not in source
            )
    elif tk in ("list", "tuple"):
        if len(target) != len(source):
            out.append(
                f"{_where(path)}: the target holds {_describe(target)}, "
                f"the version {_describe(source)}"
            )
            return
        for i, (t, s) in enumerate(zip(target, source, strict=True)):
            _check(t, s, (path, i), strict, out)


def check_into(target: Any, source: Any, *, strict: bool = True) -> list[str]:
    """Every reason why ``source`` cannot be restored into ``target`` in place; ``[]`` if none.

    Walks both objects together and modifies neither. Each line names a path in the subscript
    style of :func:`flatten` and says what the target holds and what the version (``source``)
    holds, e.g. ``state['model']['0.weight']: the target holds float32(8, 8), the version
    float32(4, 4)``. Modelled on ``torch.nn.Module.load_state_dict(strict=...)``; a mismatch is:

    * two tensors of different shape or dtype (the device may differ: the copy crosses it), or
      a target that is an inference tensor outside ``torch.inference_mode()``;
    * two numpy arrays of different shape or dtype, or a target array that is read-only;
    * a tensor, numpy array or container on one side and anything else on the other, or
      containers of different types. ``dict`` and ``OrderedDict`` are both mappings and match
      each other (a ``Module.state_dict()`` is an ``OrderedDict``; a plain ``dict`` target for
      it is fine). Subclasses (a ``defaultdict``) are not containers here;
    * lists or tuples of different lengths (``strict`` or not);
    * with ``strict=True``, a key in only one of two mappings, either way round. With
      ``strict=False`` such keys are allowed (:func:`load_into` adds the version's and keeps the
      target's), but the entries the two have in common must still match.

    Other values (numbers, strings, ``None``, ``torch.Size``...) are values, not structure: the
    version's replaces the target's whatever the two types, so they never mismatch each other.
    """
    out: list[str] = []
    _check(target, source, (), strict, out)
    return out


def _apply(target: Any, source: Any, copies: tuple[list[torch.Tensor], list[torch.Tensor]]) -> Any:
    """Restore ``source`` into ``target``, which :func:`check_into` found compatible.

    Tensor copies are not made here but listed in ``copies`` (targets, sources), in the order
    of the walk, for :func:`_copy_all` to make in few calls.
    """
    if type(target) in _PLAIN_TENSORS and type(source) is torch.Tensor:
        copies[0].append(target)
        copies[1].append(source)
        return target
    kind = _kind(target)
    if kind == "tensor" and isinstance(source, torch.Tensor):
        copies[0].append(target)
        copies[1].append(source)
        return target
    if kind == "dtensor" and type(source) is DTensorShard:
        with torch.no_grad():
            copies[0].append(target.to_local())
        copies[1].append(source.local)
        return target
    if kind == "stateful":
        target.template = _apply(target.template, source, copies)
        return target.template
    if kind == "array" and type(source) is np.ndarray:
        if np.shares_memory(target, source):
            return source
        np.copyto(target, source)
        return target
    if kind == "mapping":
        for key, value in source.items():
            if key in target:
                merged = _apply(target[key], value, copies)
                if merged is not target[key]:
                    target[key] = merged
            else:
                # A key only the version holds (strict=False): the target gets a copy of its
                # own, not views into the version's buffer, which may be reused later.
                target[key] = own_copy(value)
        order = list(source) + [k for k in target if k not in source]
        if list(target) != order:
            items = [(k, target[k]) for k in order]
            target.clear()
            target.update(items)
        return target
    if kind == "list":
        for i, value in enumerate(source):
            merged = _apply(target[i], value, copies)
            if merged is not target[i]:
                target[i] = merged
        return target
    if kind == "tuple":
        merged_items = tuple(_apply(t, s, copies) for t, s in zip(target, source, strict=True))
        if all(m is t for m, t in zip(merged_items, target, strict=True)):
            return target
        return merged_items
    return source


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``target.copy_(source)`` for each pair, in order, in one call per pair of devices."""
    if not targets:
        return
    with torch.no_grad():
        if False not in map(_IS_CPU, targets) and False not in map(_IS_CPU, sources):
            torch._foreach_copy_(targets, sources)
            return
        # Across devices, one call per pair of devices (the order within each is kept; tensors
        # in two groups cannot alias each other).
        groups: dict[tuple[torch.device, torch.device], tuple[list[Any], list[Any]]] = {}
        for t, s in zip(targets, sources, strict=True):
            group = groups.setdefault((t.device, s.device), ([], []))
            group[0].append(t)
            group[1].append(s)
        for group_targets, group_sources in groups.values():
            torch._foreach_copy_(group_targets, group_sources)


def load_into(target: Any, source: Any, *, strict: bool = True, checked: bool = False) -> Any:
    """Restore ``source`` (an unflattened state) into the live object ``target``, in place.

    First :func:`check_into`: if ``source`` does not fit ``target``, this raises
    :class:`~tiercheck.errors.StateMismatch` listing every mismatching path, and nothing has
    been written into ``target``. Then ``target`` and ``source`` are walked together:

    * a tensor in both: ``target.copy_(source)`` under ``torch.no_grad()`` (across devices too),
      so modules and optimizers keep their references (and tensors that alias each other in
      ``target`` stay aliased);
    * a numpy array in both: copied in place;
    * a mapping (``dict`` / ``OrderedDict``) in both: mutated in place -- common keys merged
      recursively, and the key order becomes ``source``'s. With ``strict=False``, keys only in
      ``source`` are added (as copies of their own, so a fresh optimizer's empty ``state``
      receives the saved moments) and keys only in ``target`` are kept as they are, after
      ``source``'s;
    * a ``list`` in both (of the same length): mutated in place, items merged recursively;
    * a ``tuple`` in both (same length): rebuilt from the merged items (tuples cannot be
      mutated), so tensors inside a tuple are still restored in place;
    * any other value: ``source``'s replaces ``target``'s.

    Returns ``target`` itself where it could be updated in place, else the object that replaces
    it; the caller stores the result where it got ``target`` from (containers do this for their
    entries).

    The tensors are copied after the walk, in one ``torch._foreach_copy_`` (per pair of
    devices), in walk order. ``checked=True`` says the caller has just run :func:`check_into`
    on these same objects with the same ``strict`` and found nothing, and that neither changed
    since: the check is not repeated.
    """
    problems = [] if checked else check_into(target, source, strict=strict)
    if problems:
        shown = problems[:_MAX_MISMATCH_LINES]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more")
        listing = "\n  ".join(shown)
        hint = (
            ""
            if not strict
            else ", or pass strict=False to allow keys that only one side holds (shapes, "
            "dtypes and lengths must still match)"
        )
        raise StateMismatch(
            f"cannot restore in place: the state given does not match the stored version at "
            f"{_items(len(problems), 'place')}; nothing was written into it:\n  {listing}\n"
            "Build the state as it was saved (same model and optimizer configuration), or "
            "restore without a state (the result holds the version as saved) and load what "
            f"you need from it yourself{hint}."
        )
    copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    result = _apply(target, source, copies)
    _copy_all(*copies)
    return result


def own_copy(obj: Any) -> Any:
    """``obj`` with every tensor and numpy array in it copied out of the payload it views.

    Restored tensors are views of one payload buffer. Saved with ``torch.save`` as they are,
    each would drag that whole buffer along (it stores storages); handed to code that reads a
    tensor's storage from its start (``torch.Generator.set_state``), a view at an offset gives
    the wrong bytes. Containers are rebuilt (dicts, lists, tuples; an ``OrderedDict`` keeps its
    ``_metadata``, as a module's ``state_dict`` has); other leaves are returned as they are.
    """
    if type(obj) is DTensorShard:
        return dataclasses.replace(obj, local=obj.local.clone())
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if type(obj) is collections.OrderedDict:
        out: collections.OrderedDict[Any, Any] = collections.OrderedDict(
            (k, own_copy(v)) for k, v in obj.items()
        )
        metadata = getattr(obj, "_metadata", None)
        if metadata is not None:
            out._metadata = metadata  # type: ignore[attr-defined]
        return out
    if type(obj) is dict:
        return {k: own_copy(v) for k, v in obj.items()}
    if type(obj) is list:
        return [own_copy(v) for v in obj]
    if type(obj) is tuple:
        return tuple(own_copy(v) for v in obj)
    return obj

"""The layout of a flattened state: where each tensor sits in the raw payload.

A :class:`Layout` pairs a state's skeleton (:mod:`~tiercheck.codec.format.skeleton`) with one
:class:`TensorSpec` per tensor: tensors are placed in spec order, each at the next multiple of
:data:`ALIGNMENT`, padding zero. :func:`~tiercheck.codec.encode.flatten.flatten` makes layouts, a
blob header stores one (:mod:`~tiercheck.codec.format.blobformat`), and typed views of a payload
come from :meth:`Layout.views`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import Any, NamedTuple, NoReturn

import msgpack
import numpy as np
import torch

from tiercheck.codec.format.dtypes import dtype_from_name, dtype_name
from tiercheck.codec.format.skeleton import EXT_DTENSOR, EXT_NDARRAY, EXT_REPLICA, ext_codes
from tiercheck.errors import FormatError, UnsupportedFormat

__all__ = ["ALIGNMENT", "Layout", "TensorSpec", "align", "check_payload", "layout_from_header"]
#: Every tensor starts at a multiple of this many bytes in the raw payload (a cache line, and a
#: multiple of every element size, so typed views into the payload are always legal).
ALIGNMENT = 64


def align(n: int) -> int:
    """``n`` rounded up to the next multiple of :data:`ALIGNMENT`."""
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class TensorSpec(NamedTuple):
    """Where one tensor of the state lives in the raw payload.

    ``path`` is the tensor's place in the state written as subscripts (``"['model']['w']"``);
    it is unique within a layout and is what a delta matches tensors by. ``offset`` is the byte
    offset in the raw payload (a multiple of :data:`ALIGNMENT`) and ``nbytes`` the size of the
    tensor's elements (``numel * element_size``).

    A named tuple (immutable, compared field by field): a layout of 100,000 tensors makes as
    many of these on every restore, and a tuple is made in less than half the time of a frozen
    dataclass.
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
        entries: Iterable[tuple[str, torch.dtype, Iterable[int]]],
    ) -> Layout:
        """Lay out tensors given as ``(path, dtype, shape)`` in order (offsets are computed).

        Sizes and offsets are computed over arrays (a state of 100,000 tensors is laid out on
        every restore, from its blob's header), exactly as the loop in :func:`_build_exact`;
        that loop runs instead where a size could pass 2**62 bytes.
        """
        columns = list(zip(*entries, strict=True))
        if not columns:
            return cls(skeleton, (), 0)
        return cls.from_columns(skeleton, columns[0], columns[1], columns[2])

    @classmethod
    def from_columns(
        cls,
        skeleton: bytes,
        paths: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Iterable[Iterable[int]],
    ) -> Layout:
        """:meth:`build` from the entries' columns: their paths, dtypes and shapes."""
        tuples: list[tuple[int, ...]] = list(map(tuple, shapes))
        n = len(paths)
        if not n:
            return cls(skeleton, (), 0)
        ndims = np.fromiter(map(len, tuples), np.int64, n)
        try:
            dims = np.fromiter(chain.from_iterable(tuples), np.int64, int(ndims.sum()))
        except OverflowError:  # a dimension past int64 (a damaged header)
            return _build_exact(cls, skeleton, paths, dtypes, tuples)
        itemsizes = {d: d.itemsize for d in set(dtypes)}
        items = np.fromiter(map(itemsizes.__getitem__, dtypes), np.int64, n)
        numel = np.ones(n, np.int64)
        shaped = ndims > 0
        if dims.size:
            starts = (np.cumsum(ndims) - ndims)[shaped]
            # float64 first: a product past 2**62 would wrap in int64 (a damaged header).
            if float(np.multiply.reduceat(dims.astype(np.float64), starts).max()) * 16 >= 2.0**62:
                return _build_exact(cls, skeleton, paths, dtypes, tuples)
            numel[shaped] = np.multiply.reduceat(dims, starts)
        nbytes = numel * items
        widths = (nbytes + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT
        ends = np.cumsum(widths)
        offsets = ends - widths
        specs = tuple(map(TensorSpec, paths, dtypes, tuples, offsets.tolist(), nbytes.tolist()))
        return cls(skeleton, specs, int(ends[-1]))

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
        check_payload(payload, self.payload_nbytes, "payload")
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
        return EXT_REPLICA in self._ext_codes

    @cached_property
    def has_arrays(self) -> bool:
        """Whether the skeleton holds a numpy array (its value is read from the payload when
        the skeleton is unpacked, unlike a tensor's)."""
        return EXT_NDARRAY in self._ext_codes

    @cached_property
    def _ext_codes(self) -> frozenset[int]:
        """The tags of the skeleton, containers opened (empty when malformed)."""
        return ext_codes(self.skeleton)

    @cached_property
    def has_dtensors(self) -> bool:
        """Whether the skeleton holds a DTensor record (such blobs name ``tiercheck.flatten/2``).

        Known without a scan for layouts made by :func:`flatten` and the cached plan; otherwise
        found by walking the skeleton once (a malformed one counts as ``False``: decoding it
        reports the problem).
        """
        return EXT_DTENSOR in self._ext_codes

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


def _build_exact(
    cls: type[Layout],
    skeleton: bytes,
    paths: Iterable[str],
    dtypes: Iterable[torch.dtype],
    shapes: Iterable[tuple[int, ...]],
) -> Layout:
    """:meth:`Layout.build` in Python integers (no bound on a size)."""
    specs: list[TensorSpec] = []
    end = 0
    for path, dtype, shape in zip(paths, dtypes, shapes, strict=True):
        offset = align(end)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        specs.append(TensorSpec(path, dtype, shape, offset, nbytes))
        end = offset + nbytes
    return cls(skeleton, tuple(specs), align(end))


_INT_ONLY = {int}
_LIST_ONLY = {list}
_STR_ONLY = {str}
_THREE = {3}


def layout_from_header(obj: Any) -> Layout:
    """The :class:`Layout` a blob header's ``layout`` field holds (``[skeleton, [[path, dtype
    name, shape], ...]]``); :class:`~tiercheck.errors.FormatError` where it is malformed or names
    a path twice, :class:`~tiercheck.errors.UnsupportedFormat` for a dtype this torch lacks."""
    if not isinstance(obj, list) or len(obj) != 2 or type(obj[0]) is not bytes:
        raise FormatError("malformed layout in blob header")
    skeleton, specs = obj
    if not isinstance(specs, list):
        raise FormatError("malformed layout in blob header")
    # Checked column by column (each a pass in C over a header of up to 100,000 entries); a
    # header that fails is walked entry by entry to name the first bad one.
    if not (_LIST_ONLY.issuperset(map(type, specs)) and _THREE.issuperset(map(len, specs))):
        _name_bad_entry(specs)
    paths, names, shapes = zip(*specs, strict=True) if specs else ((), (), ())
    if not (
        _STR_ONLY.issuperset(map(type, paths))
        and _STR_ONLY.issuperset(map(type, names))
        and _LIST_ONLY.issuperset(map(type, shapes))
    ):
        _name_bad_entry(specs)
    dims = list(chain.from_iterable(shapes))
    if not _INT_ONLY.issuperset(map(type, dims)) or (dims and min(dims) < 0):
        _name_bad_entry(specs)
    dtypes: dict[str, torch.dtype] = {}
    for name in set(names):
        dtype = dtype_from_name(name)
        if dtype is None:
            raise UnsupportedFormat(
                f"blob holds a tensor of dtype {name!r}, which this build of torch lacks"
            )
        dtypes[name] = dtype
    layout = Layout.from_columns(skeleton, paths, list(map(dtypes.__getitem__, names)), shapes)
    if len(layout.index) != len(layout.specs):
        raise FormatError("blob header lists a tensor path twice")
    return layout


def _name_bad_entry(specs: list[Any]) -> NoReturn:
    """Raise :class:`~tiercheck.errors.FormatError` naming the first malformed entry."""
    for entry in specs:
        if (
            type(entry) is not list
            or len(entry) != 3
            or type(entry[0]) is not str
            or type(entry[1]) is not str
            or type(entry[2]) is not list
            or (entry[2] and (not _INT_ONLY.issuperset(map(type, entry[2])) or min(entry[2]) < 0))
        ):
            raise FormatError(f"malformed tensor entry {entry!r} in blob header")
    raise AssertionError("a column check failed on entries that each pass it")


def check_payload(payload: torch.Tensor, nbytes: int, what: str) -> None:
    """Refuse (``ValueError``, naming ``what``) a payload that cannot hold ``nbytes`` bytes of
    typed views: not a 1-D uint8 tensor, too short, or not 16-byte aligned in its storage."""
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"{what} must be a 1-D uint8 tensor, got {payload.dtype} {payload.shape}")
    if payload.numel() < nbytes:
        raise ValueError(f"{what} holds {payload.numel()} bytes; the layout needs {nbytes}")
    # Typed views need the byte offset to be a multiple of the element size (up to 16 bytes).
    if payload.storage_offset() % 16:
        raise ValueError(f"{what} must start at a multiple of 16 bytes within its storage")

"""Flatten once, copy many times: the cached layout and copy program of a repeating state.

A training loop saves the same structure at every step -- the same keys, the same number of
tensors with the same shapes and dtypes -- and only values change. :func:`~.flatten.flatten`
walks the whole state in Python and encodes its skeleton at every call, and
:func:`~.flatten.write_payload` copies tensor by tensor: with thousands of tensors (a model with
AdamW brings ``exp_avg``, ``exp_avg_sq`` and a 0-dim ``step`` per parameter) that Python work
costs more than copying the bytes. Here:

* :class:`Planner` flattens the first state fully and compiles a :class:`StatePlan` from it: a
  tree mirroring the state's containers that holds each part's encoded skeleton bytes and each
  non-tensor value. The next state is *matched* against the plan: containers are compared by
  type, length and keys (exact key types), tensors are gathered without per-tensor work, and
  their types, dtypes, shapes, layouts and devices are compared in a few list comparisons.
  A non-tensor value (a step counter, a learning rate) that changed is re-encoded on its own and
  only the containers above it are re-joined; the layout is then the same with a new skeleton
  (:meth:`~.flatten.Layout.with_skeleton`). Anything else -- a key added or removed, a tensor
  that changed shape or dtype or device, a tensor where a value was, an optimizer that gained
  state -- is a *miss*: the state is flattened from scratch and a new plan compiled. The result
  is always byte for byte what :func:`~.flatten.flatten` gives (each compiled plan is checked
  against it once).
* a :class:`~.copyprogram.CopyProgram` (its own module) then writes the payload of a matched
  state in few calls; :class:`Flat` carries it with the layout and tensors.

What a plan does not cover -- a state whose root is not a container, dict keys other than
``str``, ``int``, ``bytes``, ``bool`` and ``None``, pickled objects -- is simply flattened in
full at every save, as before.
"""

from __future__ import annotations

import collections
import logging
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from tiercheck.codec.encode.copyprogram import CopyProgram, Flat, groupable
from tiercheck.codec.encode.flatten import (
    TENSOR_TYPES,
    Layout,
    ReplicaRef,
    encode_key,
    encode_leaf,
    flatten_walk,
    ndarray_parts,
    replicated_record,
)
from tiercheck.codec.format.containers import CONTAINERS, MAPPINGS
from tiercheck.codec.format.dtensor import DTensorShard, is_dtensor, layout_of
from tiercheck.codec.format.dtypes import is_supported_dtype
from tiercheck.codec.format.skeleton import (
    EXT_DTENSOR,
    EXT_NDARRAY,
    EXT_ODICT,
    EXT_REPLICA,
    EXT_TENSOR,
    EXT_TUPLE,
    ext,
    pack,
)
from tiercheck.codec.resources import paused_gc

# CopyProgram, Flat and groupable live in .copyprogram, paused_gc in .resources; they stay
# importable from here.
__all__ = ["CopyProgram", "Flat", "Planner", "StatePlan", "groupable", "paused_gc"]

logger = logging.getLogger("tiercheck")

_PACKER = msgpack.Packer(use_bin_type=True, unicode_errors="surrogatepass")
_NONE = pack(None)

# Non-tensor values a plan holds as they are (what the skeleton stores in place).
_IMMUTABLE_LEAVES = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        str,
        bytes,
        complex,
        torch.dtype,
        torch.device,
        torch.Size,
        ReplicaRef,
    }
)
_LEAF_TYPES = _IMMUTABLE_LEAVES | {bytearray}
# Two values of one of these exact types that compare equal have the same encoding (not so for
# floats: 0.0 == -0.0, and NaN != NaN).
_EQUAL_MEANS_SAME = frozenset({int, str, bytes})
# Dict keys a plan compares with ``==`` plus their exact types (1, 1.0 and True are equal keys
# with three encodings; floats and tuples hold -0.0 and NaN).
_KEY_TYPES = frozenset({str, int, bytes, bool, type(None)})

# Slot kinds of a container node.
_TENSOR = 0
_LEAF = 1
_NODE = 2
_ARRAY = 3
_DTENSOR = 4
_REF = 5  # a replicated DTensor another rank stores: checked, nothing travels

_TYPE = type
# What a tensor must keep for the plan to hold, read in one pass (one cache miss per tensor).
_META = operator.attrgetter("dtype", "shape", "device", "layout")


class _Miss(Exception):
    """The state does not have the plan's structure (the plan is stale)."""


class _Uncacheable(Exception):
    """The state holds something a plan does not model; flatten it in full every time."""


def _encode_leaf(value: Any) -> bytes:
    if type(value) not in _LEAF_TYPES:
        raise _Miss
    return encode_leaf(value)


class _Leaf:
    """A non-tensor value and its encoding."""

    __slots__ = ("enc", "mutable", "value")

    def __init__(self, value: Any, enc: bytes) -> None:
        self.value = value
        self.enc = enc
        # A bytearray can change in place: identity does not mean the same value.
        self.mutable = type(value) is bytearray

    def changed(self, value: Any) -> bytes | None:
        """The new encoding if ``value`` encodes differently from the held one, else ``None``."""
        held = self.value
        if value is held and not self.mutable:
            return None
        self.value = value
        t = type(value)
        if t is type(held) and t in _EQUAL_MEANS_SAME and value == held:
            return None
        enc = _encode_leaf(value)
        if enc == self.enc:
            return None
        self.enc = enc
        return enc


class _Array:
    """A numpy array or scalar: it travels as a tensor (see :func:`~.flatten.ndarray_parts`)."""

    __slots__ = ("signature",)

    def __init__(self, signature: tuple[str | None, list[int], bool]) -> None:
        self.signature = signature

    def tensor(self, value: Any) -> torch.Tensor:
        if type(value) is not np.ndarray and not isinstance(value, np.generic):
            raise _Miss
        parts = ndarray_parts(value)
        if isinstance(parts, str) or (parts[1], parts[2], parts[3]) != self.signature:
            raise _Miss
        return parts[0]


class _DSlot:
    """A DTensor (or a restored :class:`~.dtensor.DTensorShard`): its local tensor travels; its
    layout record must stay the same (a new layout is a new structure)."""

    __slots__ = ("cls", "record")

    cls: Any  # the exact type (Any: a comparison with it must not narrow)

    def __init__(self, cls: Any, record: dict[str, Any]) -> None:
        self.cls = cls
        self.record = record

    def tensor(self, value: Any) -> torch.Tensor:
        if type(value) is not self.cls:
            raise _Miss
        if self.cls is DTensorShard:
            if value.record() != self.record:
                raise _Miss
            return value.local  # type: ignore[no-any-return]
        record = layout_of(value)
        if record is not self.record and record != self.record:
            raise _Miss
        return value.to_local()  # type: ignore[no-any-return]  # under no_grad: the local


class _RefSlot(_DSlot):
    """A DTensor replicated over the whole world, stored by another rank: it must keep its
    type and layout record (else the structure changed), and contributes no tensor."""

    __slots__ = ()

    def check(self, value: Any) -> None:
        self.tensor(value)


class _Node:
    """A container of the state: its slots, and its encoding kept up to date."""

    __slots__ = ("cls", "enc", "encs", "kinds", "n", "slots", "stride")

    cls: Any  # the exact container type (Any: a comparison with it must not narrow)
    n: int
    kinds: list[int]
    slots: list[Any]
    encs: list[bytes]  # the encoded parts the node's encoding joins (see _reencode)
    stride: int  # where value i's encoding sits in encs: encs[offset + i * stride]
    enc: bytes

    def visit(self, obj: Any, out: list[torch.Tensor]) -> bool:
        """Match ``obj``, append its tensors to ``out``; whether its encoding changed."""
        raise NotImplementedError

    def _values(self, values: Iterable[Any], offset: int, out: list[torch.Tensor]) -> bool:
        dirty = False
        i = offset
        encs = self.encs
        stride = self.stride
        for value, kind, slot in zip(values, self.kinds, self.slots, strict=True):
            if kind == _TENSOR:
                out.append(value)
            elif kind == _LEAF:
                enc = slot.changed(value)
                if enc is not None:
                    encs[i] = enc
                    dirty = True
            elif kind == _NODE:
                if slot.visit(value, out):
                    encs[i] = slot.enc
                    dirty = True
            elif kind == _REF:
                slot.check(value)
            else:  # an array or a DTensor
                out.append(slot.tensor(value))
            i += stride
        return dirty


class _Seq(_Node):
    """A list or tuple."""

    __slots__ = ("all_tensors",)

    def __init__(self, obj: list[Any] | tuple[Any, ...], compiler: _Compiler, path: str) -> None:
        self.cls = type(obj)
        self.n = len(obj)
        self.stride = 1
        self.kinds, self.slots, self.encs = [], [], []
        for i, value in enumerate(obj):
            kind, slot, enc = compiler.slot(value, f"{path}[{i}]")
            self.kinds.append(kind)
            self.slots.append(slot)
            self.encs.append(enc)
        self.all_tensors = all(k == _TENSOR for k in self.kinds)
        self._reencode()

    def _reencode(self) -> None:
        body = _PACKER.pack_array_header(self.n) + b"".join(self.encs)
        self.enc = body if self.cls is list else ext(EXT_TUPLE, body)

    def visit(self, obj: Any, out: list[torch.Tensor]) -> bool:
        if type(obj) is not self.cls or len(obj) != self.n:
            raise _Miss
        if self.all_tensors:
            out.extend(obj)
            return False
        if self._values(obj, 0, out):
            self._reencode()
            return True
        return False


class _Map(_Node):
    """A dict or an OrderedDict (with the ``_metadata`` a module's ``state_dict`` carries)."""

    __slots__ = ("all_tensors", "key_types", "keys", "meta", "meta_kind")

    def __init__(self, obj: dict[Any, Any], compiler: _Compiler, path: str) -> None:
        self.cls = type(obj)
        self.n = len(obj)
        self.keys = list(obj)
        self.key_types = [type(k) for k in self.keys]
        if not _KEY_TYPES.issuperset(self.key_types):
            raise _Uncacheable
        self.stride = 2
        self.kinds, self.slots, self.encs = [], [], []
        for key, value in obj.items():
            kind, slot, enc = compiler.slot(value, f"{path}[{key!r}]")
            self.kinds.append(kind)
            self.slots.append(slot)
            self.encs.append(encode_key(key, path))
            self.encs.append(enc)
        self.all_tensors = all(k == _TENSOR for k in self.kinds)
        self.meta_kind = -1  # no metadata: a plain dict, or an OrderedDict without any
        self.meta: Any = None
        if self.cls is collections.OrderedDict:
            metadata = getattr(obj, "_metadata", None)
            if metadata is not None:
                self.meta_kind, self.meta, enc = compiler.slot(metadata, f"{path}._metadata")
                if self.meta_kind not in (_LEAF, _NODE):
                    raise _Uncacheable
        self._reencode()

    def _meta_enc(self) -> bytes:
        if self.meta_kind == -1:
            return _NONE
        return self.meta.enc  # type: ignore[no-any-return]

    def _reencode(self) -> None:
        body = _PACKER.pack_map_header(self.n) + b"".join(self.encs)
        if self.cls is dict:
            self.enc = body
        else:
            self.enc = ext(EXT_ODICT, _PACKER.pack_array_header(2) + body + self._meta_enc())

    def visit(self, obj: Any, out: list[torch.Tensor]) -> bool:
        if type(obj) is not self.cls or len(obj) != self.n:
            raise _Miss
        keys = list(obj)
        if keys != self.keys or list(map(_TYPE, keys)) != self.key_types:
            raise _Miss
        if self.all_tensors:
            out.extend(obj.values())
            dirty = False
        else:
            dirty = self._values(obj.values(), 1, out)
        if self.cls is not dict:
            metadata = getattr(obj, "_metadata", None)
            if self.meta_kind == -1:
                if metadata is not None:
                    raise _Miss
            elif metadata is None:
                raise _Miss
            elif self.meta_kind == _LEAF:
                dirty = self.meta.changed(metadata) is not None or dirty
            else:
                dirty = self.meta.visit(metadata, out) or dirty
        if dirty:
            self._reencode()
        return dirty


class _Compiler:
    """Builds the node tree of a state (the walk of :func:`~.flatten.flatten`, mirrored)."""

    def __init__(self, replica: ReplicaRef | None = None, world: int = 1) -> None:
        self.tensors: list[torch.Tensor] = []
        #: Indexes of the tensors made from numpy arrays (see :attr:`Flat.untracked`).
        self.arrays: list[int] = []
        self.active: set[int] = set()
        self.replica = replica
        self.world = world

    def slot(self, obj: Any, path: str) -> tuple[int, Any, bytes]:
        t = type(obj)
        if t in CONTAINERS:
            if id(obj) in self.active:
                raise _Uncacheable  # a cycle (only reaches here when pickling is allowed)
            self.active.add(id(obj))
            try:
                node: _Node = _Map(obj, self, path) if t in MAPPINGS else _Seq(obj, self, path)
            finally:
                self.active.discard(id(obj))
            return _NODE, node, node.enc
        if t is DTensorShard or (
            isinstance(obj, torch.Tensor) and t not in TENSOR_TYPES and is_dtensor(obj)
        ):
            return self.dtensor(obj)
        if isinstance(obj, torch.Tensor):
            if (
                t not in TENSOR_TYPES
                or obj.layout != torch.strided
                or obj.is_quantized
                or obj.device.type == "meta"
                or not is_supported_dtype(obj.dtype)
            ):
                raise _Uncacheable
            index = len(self.tensors)
            self.tensors.append(obj)
            return _TENSOR, None, ext(EXT_TENSOR, pack(index))
        if t is np.ndarray or isinstance(obj, np.generic):
            parts = ndarray_parts(obj)
            if isinstance(parts, str):
                raise _Uncacheable
            tensor, dtype_str, shape, scalar = parts
            index = len(self.tensors)
            self.tensors.append(tensor)
            self.arrays.append(index)
            enc = ext(EXT_NDARRAY, pack([index, dtype_str, shape, scalar]))
            return _ARRAY, _Array((dtype_str, shape, scalar)), enc
        if t in _LEAF_TYPES:
            leaf = _Leaf(obj, _encode_leaf(obj))
            return _LEAF, leaf, leaf.enc
        raise _Uncacheable

    def dtensor(self, obj: Any) -> tuple[int, Any, bytes]:
        if type(obj) is DTensorShard:
            record, local = obj.record(), obj.local
        else:
            try:
                record = layout_of(obj)
            except ValueError:
                raise _Uncacheable from None  # flatten refuses it, or pickles it
            local = obj.to_local()
        if (
            type(local) not in TENSOR_TYPES
            or local.layout != torch.strided
            or local.is_quantized
            or local.device.type == "meta"
            or not is_supported_dtype(local.dtype)
        ):
            raise _Uncacheable
        if self.replica is not None and replicated_record(record, self.world):
            enc = ext(EXT_REPLICA, pack([self.replica.rank, record]))
            return _REF, _RefSlot(type(obj), record), enc
        index = len(self.tensors)
        self.tensors.append(local)
        return _DTENSOR, _DSlot(type(obj), record), ext(EXT_DTENSOR, pack([index, record]))


class StatePlan:
    """The compiled structure of one state; see the module docstring.

    Build with :meth:`compile`; :meth:`match` a later state against it.
    """

    def __init__(
        self,
        root: _Node,
        layout: Layout,
        tensors: Sequence[torch.Tensor],
        arrays: Sequence[int] = (),
    ) -> None:
        self.root = root
        self.layout = layout
        self.count = len(tensors)
        self.types = [type(t) for t in tensors]
        self.metas = [_META(t) for t in tensors]
        #: Whether every tensor is in host memory (the :class:`CopyProgram` can write them).
        self.on_host = all(t.device.type == "cpu" for t in tensors)
        #: Indexes of the tensors made from numpy arrays (see :attr:`Flat.untracked`).
        self.arrays = tuple(arrays)

    @classmethod
    def compile(
        cls,
        state: Any,
        layout: Layout,
        tensors: Sequence[torch.Tensor],
        replica: ReplicaRef | None = None,
        world_size: int = 1,
    ) -> StatePlan | None:
        """The plan of ``state``, which :func:`~.flatten.flatten` turned into ``layout`` and
        ``tensors`` (with the same ``replica`` and ``world_size``); ``None`` where a plan cannot
        model it (it is then flattened every time)."""
        t = type(state)
        if t not in CONTAINERS:
            return None
        compiler = _Compiler(replica, world_size)
        try:
            with torch.no_grad():  # DTensor.to_local() is then the local tensor itself
                kind, root, enc = compiler.slot(state, "")
        except _Uncacheable:
            return None
        # The plan must reproduce flatten exactly; anything it models differently is left to
        # flatten (never a silent difference in the stored bytes).
        if (
            kind != _NODE
            or enc != layout.skeleton
            or len(compiler.tensors) != len(tensors)
            or any(
                (a is not b) and (a.dtype != b.dtype or a.shape != b.shape)
                for a, b in zip(compiler.tensors, tensors, strict=True)
            )
        ):
            logger.debug("tiercheck: the state's plan differs from flatten; not caching it")
            return None
        return cls(root, layout, tensors, compiler.arrays)

    def match(self, state: Any) -> tuple[Layout, list[torch.Tensor]] | None:
        """``(layout, tensors)`` of ``state`` if it has the plan's structure, else ``None``.

        A ``None`` leaves the plan unusable (it may be half updated): compile a new one.
        """
        out: list[torch.Tensor] = []
        try:
            with torch.no_grad():  # DTensor.to_local() is then the local tensor itself
                dirty = self.root.visit(state, out)
        except _Miss:
            return None
        if (
            len(out) != self.count
            or list(map(_TYPE, out)) != self.types
            or list(map(_META, out)) != self.metas
        ):
            return None
        if dirty:
            known = {
                name: getattr(self.layout, name)
                for name in ("has_dtensors", "has_refs", "has_arrays")
            }
            self.layout = self.layout.with_skeleton(self.root.enc)
            self.layout.__dict__.update(known)  # same structure
        return self.layout, out


class Planner:
    """Flattens states, reusing the plan of the previous one while the structure repeats.

    Not thread-safe: one caller at a time (the checkpointer's save path is serialized).
    """

    def __init__(
        self,
        *,
        allow_pickle: bool = False,
        replica: ReplicaRef | None = None,
        world_size: int = 1,
    ) -> None:
        self.allow_pickle = allow_pickle
        #: Set on a rank that is not its node's first: whole-world replicated DTensors are
        #: stored as this reference (see :func:`~.flatten.flatten`).
        self.replica = replica
        self.world_size = world_size
        self.plan: StatePlan | None = None
        self.program: CopyProgram | None = None
        #: Saves that reused the plan, and saves that flattened in full.
        self.hits = 0
        self.misses = 0

    def flatten(self, state: Any) -> Flat:
        """Flatten ``state``: through the plan when it matches, else in full (and re-plan).

        Raises what :func:`~.flatten.flatten` raises for a state it cannot store.
        """
        plan = self.plan
        if plan is not None:
            with paused_gc():
                matched = plan.match(state)
            if matched is not None:
                self.hits += 1
                layout, tensors = matched
                return Flat(
                    layout, tensors, self._program(layout, plan), True, plan.on_host, plan.arrays
                )
            self.plan = None
        self.misses += 1
        layout, tensors, arrays = flatten_walk(
            state,
            allow_pickle=self.allow_pickle,
            replica=self.replica,
            world_size=self.world_size,
        )
        self.plan = plan = StatePlan.compile(state, layout, tensors, self.replica, self.world_size)
        if plan is not None:
            return Flat(layout, tensors, self._program(layout, plan), False, plan.on_host, arrays)
        on_host = all(t.device.type == "cpu" for t in tensors)
        return Flat(layout, tensors, None, False, on_host, arrays)

    def _program(self, layout: Layout, plan: StatePlan) -> CopyProgram | None:
        if not plan.on_host:
            return None
        program = self.program
        if program is None or (
            program.layout.specs is not layout.specs and not program.layout.compatible(layout)
        ):
            program = self.program = CopyProgram(layout)
        return program

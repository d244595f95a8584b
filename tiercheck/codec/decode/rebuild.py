"""Stage ``tiercheck.flatten/1``, the way back: a skeleton and its tensors -> the state.

:func:`unflatten` reads the msgpack skeleton :func:`~tiercheck.codec.encode.flatten.flatten` wrote,
turning each extension record (tensor index, tuple, ``OrderedDict``, ``torch.Size``, big int,
numpy array, complex, dtype, device, bytearray, DTensor shard, replica reference -- a
:class:`~tiercheck.codec.encode.flatten.ReplicaRef`, left for
:func:`~tiercheck.codec.replica.resolve` -- and, only when allowed, pickle) back into its object
around the tensors given (typically views into a payload). The format, tags included, is defined in
:mod:`~tiercheck.codec.format.skeleton`; the walk is its
:func:`~tiercheck.codec.format.skeleton.unpack` with a hook that turns each tag back into its
object.
"""

from __future__ import annotations

import collections
import pickle
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from tiercheck.codec.encode.flatten import Layout, ReplicaRef
from tiercheck.codec.format.dtensor import DTensorShard
from tiercheck.codec.format.layout import TensorSpec
from tiercheck.codec.format.skeleton import (
    EXT_BIGINT,
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
    unpack,
)
from tiercheck.errors import FormatError, UnsupportedObject

__all__ = ["unflatten"]


class _NeedsBytes(Exception):
    """A stand-in met where an object is rebuilt around a tensor's bytes (kept apart from the
    errors a malformed skeleton raises: the caller's input is wrong, not the blob)."""


class _Unflattener:
    def __init__(self, tensors: Sequence[torch.Tensor | TensorSpec], allow_pickle: bool) -> None:
        self.tensors = tensors
        self.allow_pickle = allow_pickle

    def unpack(self, data: bytes) -> Any:
        return unpack(data, self.ext_hook)

    def tensor(self, index: object) -> torch.Tensor | TensorSpec:
        if type(index) is not int or not 0 <= index < len(self.tensors):
            raise FormatError(
                f"skeleton refers to tensor {index!r}; the layout has {len(self.tensors)}"
            )
        return self.tensors[index]

    def real(self, index: object) -> torch.Tensor:
        """The tensor ``index`` where an object is rebuilt around its bytes (an array, a
        DTensor shard): never a stand-in (:func:`unflatten` says so with a ValueError)."""
        leaf = self.tensor(index)
        if not isinstance(leaf, torch.Tensor):
            raise _NeedsBytes(
                "a state with numpy arrays or DTensors is rebuilt around tensors, not "
                f"TensorSpecs (tensor {index!r})"
            )
        return leaf

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            # The index is a msgpack int; the one-byte form (positive fixint, index < 128) and
            # the uint16 form cover most states without a nested unpack.
            first = data[0] if data else 0xC1
            if len(data) == 1 and first < 0x80:
                return self.tensor(first)
            if len(data) == 3 and first == 0xCD:
                return self.tensor(int.from_bytes(data[1:], "big"))
            return self.tensor(self.unpack(data))
        if code == EXT_TUPLE:
            return tuple(self.unpack(data))
        if code == EXT_ODICT:
            mapping, meta = self.unpack(data)
            od = collections.OrderedDict(mapping)
            if meta is not None:
                od._metadata = meta  # type: ignore[attr-defined]
            return od
        if code == EXT_SIZE:
            return torch.Size(self.unpack(data))
        if code == EXT_BIGINT:
            return int.from_bytes(data, "little", signed=True)
        if code == EXT_NDARRAY:
            return self.ndarray(self.unpack(data))
        if code == EXT_COMPLEX:
            re, im = np.frombuffer(data, dtype="<f8", count=2).tolist()
            return complex(re, im)
        if code == EXT_DTYPE:
            dtype = getattr(torch, data.decode(), None)
            if not isinstance(dtype, torch.dtype):
                raise FormatError(f"skeleton names an unknown torch dtype {data!r}")
            return dtype
        if code == EXT_DEVICE:
            return torch.device(data.decode())
        if code == EXT_BYTEARRAY:
            return bytearray(data)
        if code == EXT_DTENSOR:
            index, record = self.unpack(data)
            if type(record) is not dict:
                raise FormatError(f"skeleton holds a malformed DTensor record {record!r}")
            return DTensorShard.from_record(self.real(index), record)
        if code == EXT_REPLICA:
            rank, record = self.unpack(data)
            if type(rank) is not int or not (record is None or type(record) is dict):
                raise FormatError(f"skeleton holds a malformed replica reference {data!r}")
            return ReplicaRef(rank, record)
        if code == EXT_PICKLE:
            if not self.allow_pickle:
                raise UnsupportedObject(
                    "the state holds a pickled object; pass allow_pickle=True to load it "
                    "(only for checkpoints from trusted sources: unpickling can run code)"
                )
            return pickle.loads(data)  # noqa: S301 -- explicit opt-in, documented as unsafe
        raise FormatError(f"skeleton holds unknown extension code {code}")

    def ndarray(self, fields: Any) -> Any:
        index, dtype_str, shape, scalar = fields
        tensor = self.real(index)
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
    layout: Layout, tensors: Sequence[torch.Tensor | TensorSpec], *, allow_pickle: bool = False
) -> Any:
    """Rebuild the state of ``layout`` around ``tensors`` (one per spec, typically its views).

    Tensors are placed as given (no copy); numpy arrays come back as arrays sharing the tensors'
    memory. A skeleton holding pickled objects needs ``allow_pickle=True``, else
    :class:`~tiercheck.errors.UnsupportedObject`; a malformed skeleton raises
    :class:`~tiercheck.errors.FormatError`.

    The layout's own :class:`~tiercheck.codec.format.layout.TensorSpec` records may stand for
    the tensors (the structure alone, to check a live state against) where the state holds no
    numpy array and no DTensor, which are rebuilt around tensors (else :class:`ValueError`).
    """
    if len(tensors) != len(layout.specs):
        raise ValueError(f"got {len(tensors)} tensors for a layout of {len(layout.specs)}")
    try:
        return _Unflattener(tensors, allow_pickle).unpack(layout.skeleton)
    except _NeedsBytes as exc:
        # Found on the way, not by a scan up front: a scan of the skeleton's tags would cost
        # every decode a walk of thousands of extensions.
        raise ValueError(str(exc)) from None
    except (msgpack.UnpackException, ValueError, TypeError, KeyError) as exc:
        if isinstance(exc, (FormatError, UnsupportedObject)):
            raise
        raise FormatError(f"malformed state skeleton: {exc}") from exc

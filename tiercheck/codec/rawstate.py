"""A state as its raw payload: :class:`RawState`, what encoders read and decoding returns.

:func:`snapshot` makes one from a live state (flatten, copy, digest); :func:`host_buffer` is
the fresh host memory a payload is decoded into.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiercheck.codec.decode.rebuild import unflatten
from tiercheck.codec.encode.flatten import flatten, write_payload
from tiercheck.codec.format.digest import chunk_count, chunk_digests, tree_root
from tiercheck.codec.format.layout import Layout

__all__ = ["RawState", "host_buffer", "snapshot"]


def host_buffer(nbytes: int) -> torch.Tensor:
    """A fresh uint8 host tensor of ``nbytes``, cheap to fault in.

    Allocated by numpy, which asks the kernel for transparent huge pages on large arrays:
    first-touch page faults then cost about 9 GB/s instead of about 2 GB/s for torch's own
    allocator (measured on the dev VM), which matters for every fresh decode.
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))


@dataclass(frozen=True)
class RawState:
    """A state as its raw payload: what encoders read and :func:`decode` returns.

    ``payload`` is a contiguous uint8 1-D tensor of exactly ``layout.payload_nbytes`` bytes and
    ``raw_digest`` its :func:`~tiercheck.codec.raw_digest` -- build one with :func:`snapshot`, or
    compute the digest yourself: encoders trust it, and decoding checks it end to end.
    ``chunk_digests``, when known, are the leaves of that digest
    (:func:`~tiercheck.codec.format.digest.chunk_digests`): :func:`encode_full` then stores them, so
    that parts of the blob can be checked alone. They must add up to ``raw_digest`` (checked
    here, without reading the payload).

    The payload normally lives in host memory. :func:`encode_packed` also takes one on a GPU
    (its XOR and plane split then run there; the digest must come from a host copy, as
    :func:`~tiercheck.codec.raw_digest` reads host memory); :func:`decode` always returns a
    host payload.
    """

    version: int
    layout: Layout
    payload: torch.Tensor
    raw_digest: int
    chunk_digests: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        p = self.payload
        if p.dtype != torch.uint8 or p.dim() != 1 or not p.is_contiguous():
            raise ValueError(
                f"payload must be a contiguous 1-D uint8 tensor, got {p.dtype} {tuple(p.shape)}"
            )
        if p.numel() != self.layout.payload_nbytes:
            raise ValueError(
                f"payload holds {p.numel()} bytes; the layout has {self.layout.payload_nbytes}"
            )
        leaves = self.chunk_digests
        if leaves is not None and (
            len(leaves) != chunk_count(p.numel()) or tree_root(leaves, p.numel()) != self.raw_digest
        ):
            raise ValueError("chunk_digests do not add up to raw_digest")

    def tensors(self) -> list[torch.Tensor]:
        """Typed views of every tensor in the payload (no copy; they share its memory)."""
        return self.layout.views(self.payload)

    def state(self, *, allow_pickle: bool = False) -> Any:
        """The nested state, rebuilt around views of the payload (no copy).

        The state's tensors live in ``payload``: copy them (or
        :func:`~tiercheck.codec.decode.statetree.load_into` a live state) before the payload's
        memory is reused.
        """
        return unflatten(self.layout, self.tensors(), allow_pickle=allow_pickle)


def snapshot(
    state: Any,
    *,
    version: int,
    out: torch.Tensor | None = None,
    allow_pickle: bool = False,
    executor: Executor | None = None,
) -> RawState:
    """Flatten ``state``, copy it into a raw payload (``out`` or a new host buffer), digest it.

    A convenience for callers without their own staging buffers (tests, tools, benchmarks).
    """
    layout, tensors = flatten(state, allow_pickle=allow_pickle)
    n = layout.payload_nbytes
    dest = host_buffer(n) if out is None else out[:n]
    write_payload(layout, tensors, dest)
    leaves = chunk_digests(dest, executor=executor)
    return RawState(version, layout, dest, tree_root(leaves, n), tuple(leaves))

"""Reading blobs back: :func:`decode` (verified end to end) and :func:`verify` (no decode).

The format is :mod:`.blobformat`'s; :mod:`.partial` reads parts of a blob.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from tiercheck.codec.format.blobformat import BlobMeta, PackedInfo, byte_view, frame_extents, parse
from tiercheck.codec.format.digest import DIGEST_CHUNK, chunk_digests, tree_root
from tiercheck.codec.packed.frames import Buffer, DecodeSettings, Frame, decode_frame
from tiercheck.codec.rawstate import RawState, host_buffer
from tiercheck.codec.resources import ScratchPool, run_bounded
from tiercheck.errors import BaseMismatch, ChecksumMismatch, FormatError

__all__ = ["decode", "verify"]


def verify(blob: Buffer, *, executor: Executor | None = None) -> BlobMeta:
    """Check the whole blob against its checksum without decoding; return its meta.

    One parallel hash pass over the body. Raises what :func:`read_meta` raises, and
    :class:`~tiercheck.errors.ChecksumMismatch` when the body does not match.
    """
    view = byte_view(blob)
    meta = parse(view, len(view))
    body = view[meta.body_offset :]
    if meta.packed is None:
        if tree_root(_digest_chunks(body, executor), len(body)) != meta.body_digest:
            raise _corrupt(meta)
        return meta
    jobs = _frame_jobs(meta, meta.packed, body)

    def check(job: _FrameJob) -> bool:
        return xxhash.xxh3_64_intdigest(job.stored) == job.digest

    if not all(run_bounded(check, jobs, workers=os.cpu_count() or 1, executor=executor)):
        raise _corrupt(meta)
    return meta


def _digest_chunks(data: memoryview, executor: Executor | None) -> list[int]:
    # For functions whose parameter ``chunk_digests`` hides the function of that name.
    return chunk_digests(data, executor=executor)


def _corrupt(meta: BlobMeta) -> ChecksumMismatch:
    return ChecksumMismatch(
        f"blob of version {meta.version} rank {meta.rank} does not match its checksum "
        f"{meta.checksum:#018x}: the blob is corrupt; read another copy"
    )


@dataclass(frozen=True, slots=True)
class _FrameJob:
    frame: Frame
    stored: memoryview  # the frame's bytes in the body
    entries: list[tuple[int, int]]  # (mode, size) per stored plane
    digest: int


def _frame_jobs(meta: BlobMeta, info: PackedInfo, body: memoryview) -> list[_FrameJob]:
    """Where each frame of a packed blob lies in the body, from the frame table."""
    return [
        _FrameJob(e.frame, body[e.start : e.start + e.nbytes], e.entries, e.digest)
        for e in frame_extents(meta, info)
    ]


def _check_base(meta: BlobMeta, base: RawState | None) -> None:
    if meta.base is None:
        return
    want = meta.base
    if base is None:
        raise BaseMismatch(
            f"blob of version {meta.version} is a delta against version {want.version} "
            f"(raw digest {want.raw_digest:#018x}); decode it with that base"
        )
    if base.version != want.version or base.raw_digest != want.raw_digest:
        raise BaseMismatch(
            f"blob of version {meta.version} is a delta against version {want.version} "
            f"(raw digest {want.raw_digest:#018x}), but the base given is version "
            f"{base.version} (raw digest {base.raw_digest:#018x})"
        )
    if base.payload.device.type != "cpu":
        raise ValueError(f"decode needs the base payload in host memory, got {base.payload.device}")


def _out_buffer(out: torch.Tensor | None, n: int, base: RawState | None) -> torch.Tensor:
    if out is None:
        return host_buffer(n)
    if out.device.type != "cpu" or out.dtype != torch.uint8 or out.dim() != 1:
        raise ValueError("out must be a 1-D uint8 host tensor")
    if out.numel() < n or not out.is_contiguous() or out.storage_offset() % 16:
        raise ValueError(f"out must hold {n} contiguous bytes starting at a multiple of 16")
    dest = out[:n]
    if (
        base is not None
        and n
        and base.payload.numel()
        and np.may_share_memory(dest.numpy(), base.payload.numpy())
    ):
        raise ValueError("out must not overlap the base payload")
    return dest


def decode(
    blob: Buffer,
    *,
    base: RawState | None = None,
    executor: Executor | None = None,
    out: torch.Tensor | None = None,
    threads: int = 0,
    meta: BlobMeta | None = None,
) -> RawState:
    """Decode a blob into a :class:`RawState`, verified end to end.

    Checks, in order: the blob's format and header (:func:`read_meta`), the base (a delta needs
    exactly the base it was encoded against -- same version and raw digest -- else
    :class:`~tiercheck.errors.BaseMismatch`, also when ``base`` is missing), the body against its
    checksum (for a packed blob frame by frame, each before it is decompressed), and finally the
    rebuilt raw payload against ``meta.raw_digest``
    (:class:`~tiercheck.errors.ChecksumMismatch`). A decoded state is therefore bit-exact or an
    error, never silently different.

    The payload is written into ``out[:payload_nbytes]`` when given (a uint8 host tensor that
    must not overlap ``base.payload``). For a full blob without ``out``: a *writable* blob
    (``bytearray``, writable ``memoryview`` or mmap) is not copied at all -- the payload is a
    view of the blob's memory, valid while the blob is and changed if the blob is; a read-only
    blob (``bytes``) is copied once. Packed frames decode in parallel on ``executor`` (or a pool
    of ``threads`` threads, ``0`` = ``os.cpu_count()``). When decoding fails after the checks
    on the header, ``out`` may hold partly written bytes.

    ``meta``: what :func:`read_meta` returned for this very blob, if the caller has it (its
    header is then not parsed a second time -- thousands of tensor entries); the body is still
    verified here as always.
    """
    view = byte_view(blob)
    if meta is None or meta.nbytes != len(view):
        meta = parse(view, len(view))
    _check_base(meta, base)
    layout = meta.layout
    n = layout.payload_nbytes
    body = view[meta.body_offset :]
    if meta.encoding.as_is:
        if out is None and not view.readonly and n:
            payload = torch.frombuffer(body, dtype=torch.uint8)
        else:
            payload = _out_buffer(out, n, None)
            if n:
                np.copyto(payload.numpy(), np.frombuffer(body, dtype=np.uint8))
        # One pass: the body digest of a full blob is its raw digest.
        leaves = chunk_digests(payload, executor=executor)
        digest = tree_root(leaves, n)
        if digest != meta.raw_digest:
            raise _corrupt(meta)
        return RawState(meta.version, layout, payload, digest, tuple(leaves))

    info = meta.packed
    assert info is not None
    payload = _out_buffer(out, n, base)
    leaves = _decode_packed(
        body,
        meta=meta,
        info=info,
        base=base,
        payload=payload,
        executor=executor,
        workers=threads or os.cpu_count() or 1,
    )
    digest = tree_root(leaves, n)
    if digest != meta.raw_digest:
        raise ChecksumMismatch(
            f"decoded payload of version {meta.version} rank {meta.rank} does not match the "
            "digest recorded at encode time (a wrong base, or a bug): refusing it"
        )
    return RawState(meta.version, layout, payload, digest, tuple(leaves))


def _decode_packed(
    body: memoryview,
    *,
    meta: BlobMeta,
    info: PackedInfo,
    base: RawState | None,
    payload: torch.Tensor,
    executor: Executor | None,
    workers: int,
) -> list[int]:
    """Rebuild the payload frame by frame; return the leaves of its raw digest.

    The digest is computed on the way: each 8 MiB chunk of the payload is hashed by the worker
    that finishes the last frame writing into it, while those bytes are still in cache, instead
    of in a separate pass over the whole payload afterwards.
    """
    layout = meta.layout
    jobs = _frame_jobs(meta, info, body)

    base_offsets = (-1,) * len(layout.specs)
    base_np = None
    if info.delta is not None:
        assert base is not None
        base_specs = base.layout.specs
        offsets = []
        for spec, j in zip(layout.specs, info.delta, strict=True):
            if j < 0:
                offsets.append(-1)
                continue
            if j >= len(base_specs) or (base_specs[j].dtype, base_specs[j].shape) != (
                spec.dtype,
                spec.shape,
            ):
                raise FormatError(f"delta map points {spec.path} at a different base tensor")
            offsets.append(base_specs[j].offset)
        base_offsets = tuple(offsets)
        base_np = base.payload.numpy()

    out_np = payload.numpy()
    for start, end in layout.gaps:
        out_np[start:end] = 0
    settings = DecodeSettings(layout, out_np, base_np, base_offsets)
    pool = ScratchPool(info.frame_bytes)

    n = layout.payload_nbytes
    chunk = DIGEST_CHUNK
    leaves = [0] * ((n + chunk - 1) // chunk)
    waiting = [0] * len(leaves)  # frames still to write into each chunk
    touched: list[list[int]] = []  # per frame: the chunks it writes into
    for job in jobs:
        chunks: set[int] = set()
        for p in job.frame.pieces:
            begin = layout.specs[p.spec].offset + p.start
            chunks.update(range(begin // chunk, (begin + p.nbytes - 1) // chunk + 1))
        for c in chunks:
            waiting[c] += 1
        touched.append(sorted(chunks))
    lock = threading.Lock()

    def hash_chunk(c: int) -> None:
        leaves[c] = xxhash.xxh3_64_intdigest(out_np[c * chunk : (c + 1) * chunk].data)

    for c, count in enumerate(waiting):
        if count == 0:  # padding only: final already
            hash_chunk(c)

    def work(index: int) -> None:
        job = jobs[index]
        decode_frame(job.frame, job.stored, job.entries, job.digest, s=settings, pool=pool)
        ready = []
        with lock:
            for c in touched[index]:
                waiting[c] -= 1
                if waiting[c] == 0:
                    ready.append(c)
        for c in ready:
            hash_chunk(c)

    run_bounded(work, range(len(jobs)), workers=workers, executor=executor)
    return leaves

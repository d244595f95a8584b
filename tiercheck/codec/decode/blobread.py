"""Reading one rank's blob of one version back, verified, with its base.

The one reading rule that restore (:class:`tiercheck.engine.restore.read.Reader`) and the CLI
(:func:`tiercheck.catalog.read.decode_blob`) share. The blob's header is read and checked (and,
when the caller knows them, its version and rank); a delta's base is found by version and rank
(how is the caller's: a ``COMMIT`` record, a listing, a catalog), read the same way, and must be
self-contained; decoding then checks every checksum and the payload against the digest taken at
save time. What comes back is bit for bit what was saved, or an error. A blob found damaged is
shown to the caller's ``on_damaged`` before the error is raised (restore sets it aside).
:func:`complete` then puts back the replicated state a blob refers to other ranks' blobs for.

Above the codec and the tiers (it reads through any ``get``), below the engine and the catalog.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

from tiercheck.buffer import Buffer
from tiercheck.codec import RawState, decode, read_meta
from tiercheck.codec.decode.assembled import Resharded
from tiercheck.codec.replica import referenced, resolve, take
from tiercheck.errors import ChecksumMismatch, FormatError

__all__ = [
    "FindBase",
    "GetBlob",
    "OnDamaged",
    "OtherBase",
    "ReadRank",
    "complete",
    "read_blob",
]

#: Reads the blob stored under a key.
GetBlob = Callable[[str], Awaitable[Buffer]]
#: The key of the blob of ``(version, rank)``: where a delta's base is; raises if there is none.
FindBase = Callable[[int, int], Awaitable[str]]
#: Told of a blob that failed verification: its key, its bytes, the error (raised afterwards).
OnDamaged = Callable[[str, Buffer, Exception], Awaitable[None]]
#: A delta's base from somewhere else, when the one beside the delta cannot be read: called with
#: the base's version and rank and why that one failed; returns it read and verified, or raises.
OtherBase = Callable[[int, int, Exception], Awaitable[RawState]]
#: Rank ``rank``'s blob of the same version, read and verified (:func:`complete` reads by it).
ReadRank = Callable[[int], Awaitable[RawState]]


async def read_blob(
    get: GetBlob,
    key: str,
    *,
    find_base: FindBase,
    expect: tuple[int, int] | None = None,
    executor: Executor | None = None,
    on_damaged: OnDamaged | None = None,
    other_base: OtherBase | None = None,
) -> RawState:
    """Read the blob under ``key`` (and its base, for a delta) and decode it, verified.

    Args:
        get: reads a blob by key.
        key: the blob's key.
        find_base: the key of a delta's base, from its version and rank.
        expect: ``(version, rank)`` the blob must hold (:class:`~tiercheck.errors.FormatError`
            if it holds another); its base is then checked the same way. ``None``: not checked.
        executor: threads for decoding (see :func:`tiercheck.codec.decode`).
        on_damaged: awaited with a blob that fails verification, before the error is raised.
        other_base: where a delta's base comes from when the one ``find_base`` names is
            missing or damaged (a copy in another tier): any blob that decodes to the raw
            payload the delta was encoded against serves, since decoding checks its digest.
    """
    return await _read(
        get,
        key,
        find_base=find_base,
        expect=expect,
        executor=executor,
        on_damaged=on_damaged,
        other_base=other_base,
    )


async def _read(
    get: GetBlob,
    key: str,
    *,
    find_base: FindBase,
    expect: tuple[int, int] | None,
    executor: Executor | None,
    on_damaged: OnDamaged | None,
    as_base: bool = False,
    other_base: OtherBase | None = None,
) -> RawState:
    blob = await get(key)
    try:
        meta = await asyncio.to_thread(read_meta, blob)
        if expect is not None and (meta.version, meta.rank) != expect:
            raise FormatError(
                f"{key} holds version {meta.version} of rank {meta.rank}, not version "
                f"{expect[0]} of rank {expect[1]}"
            )
    except (ChecksumMismatch, FormatError) as exc:
        if on_damaged is not None:
            await on_damaged(key, blob, exc)
        raise
    base: RawState | None = None
    if meta.base is not None:
        if as_base:
            raise FormatError(f"{key} is a delta, but a base must be self-contained")
        base_version = meta.base.version
        base_expect = None if expect is None else (base_version, meta.rank)
        try:
            base_key = await find_base(base_version, meta.rank)
            base = await _read(
                get,
                base_key,
                find_base=find_base,
                expect=base_expect,
                executor=executor,
                on_damaged=on_damaged,
                as_base=True,
            )
        except (FileNotFoundError, ChecksumMismatch, FormatError, OSError) as exc:
            if other_base is None:
                raise
            base = await other_base(base_version, meta.rank, exc)
    try:
        return await asyncio.to_thread(decode, blob, base=base, executor=executor, meta=meta)
    except (ChecksumMismatch, FormatError) as exc:
        if on_damaged is not None:
            await on_damaged(key, blob, exc)
        raise


async def complete(raw: RawState, rank: int, world: int, read: ReadRank) -> RawState | Resharded:
    """``raw`` (rank ``rank``'s blob of a save by ``world`` ranks) with each reference to
    replicated state replaced by the value it leads to; ``raw`` itself when it holds none.

    The blobs the references name are read with ``read``, and those their own references name
    in turn (a node's first rank refers on to rank 0 in durable tiers), each once; see
    :func:`tiercheck.codec.replica.resolve`.
    """
    if not raw.layout.has_refs:
        return raw
    others: dict[int, RawState] = {}
    wanted = referenced(raw.layout) - {rank}
    while wanted:
        other = min(wanted)
        others[other] = got = await read(other)
        wanted = (wanted | referenced(got.layout)) - others.keys() - {rank}
    resolved = await asyncio.to_thread(
        resolve, raw.layout, rank, {r: o.layout for r, o in others.items()}
    )
    tensors = {r: o.tensors() for r, o in others.items()}
    tensors[rank] = raw.tensors()
    return Resharded(raw.version, resolved.layout, tuple(take(resolved, tensors)), world)

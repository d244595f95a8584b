"""Reading a small record file from an event loop, through ``aiofiles``.

A node's identity record (``identity.json``, a few hundred bytes) is read from async code in
two places: when a checkpointer opens (:func:`tiercheck.engine.open.claim.gather_facts`) and when
the command line scans a node root (:mod:`tiercheck.catalog.scan`). Each happens once per opening or
scan, so ``aiofiles``' extra thread-pool hops (open, read and close are one each, where
``asyncio.to_thread(path.read_bytes)`` is one in all) cost nothing that matters: 0.2-0.3 ms
a read, 2.7x the single hop (``python bench/aiofiles_io.py``, docs/architecture.md "Small
files: aiofiles"). The event loop never waits on the file.

Not for blobs: the local tier reads and writes those with ``preadv``/``pwritev`` straight into
caller buffers (:mod:`tiercheck.tiers.local.files`), which ``aiofiles``' Python file objects
cannot do. Not for writes either: a record is published by
:func:`tiercheck.tiers.atomic.atomic_write` (temporary name, rename over), the one place a file
gets its final name.
"""

from __future__ import annotations

import os

import aiofiles

__all__ = ["read_small"]


async def read_small(path: str | os.PathLike[str]) -> bytes | None:
    """The whole of the file at ``path``, or ``None`` where there is no such file.

    Every other :class:`OSError` (a folder in its place, no permission, an I/O error) is raised
    as :meth:`pathlib.Path.read_bytes` would raise it: same type, same message.
    """
    try:
        async with aiofiles.open(path, "rb") as f:
            return await f.read()
    except FileNotFoundError:
        return None

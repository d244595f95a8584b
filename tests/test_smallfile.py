"""The node identity record read through ``aiofiles`` (tiercheck/smallfile.py) behaves exactly
as the ``asyncio.to_thread(path.read_bytes)`` it replaced: the same bytes, ``None`` for no file,
and every other error raised with the same type and message -- in the helper itself, in the
command line's scan of a node root, and in what a rank reports of its node when it opens."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tiercheck.catalog import Location, OpenLocation
from tiercheck.consistency.identity import IDENTITY_FILE, NodeIdentity
from tiercheck.engine.core import CheckpointerCore
from tiercheck.engine.open.claim import gather_facts, keep_identity
from tiercheck.errors import FormatError
from tiercheck.guards import RankLock, read_identity, write_identity
from tiercheck.smallfile import read_small

IDENTITY = NodeIdentity("job", "t0k3n", 1, None, 1.5)


async def _old_read(path: Path) -> bytes | None:
    """The read as it was before aiofiles (catalog/scan.py)."""
    try:
        return await asyncio.to_thread(path.read_bytes)
    except FileNotFoundError:
        return None


def _error(exc: BaseException) -> tuple[type, str]:
    return type(exc), str(exc)


async def test_read_small_reads_what_read_bytes_reads(tmp_path: Path) -> None:
    write_identity(tmp_path, IDENTITY)
    path = tmp_path / IDENTITY_FILE
    assert await read_small(path) == path.read_bytes() == IDENTITY.to_bytes()
    assert await read_small(str(path)) == path.read_bytes()
    big = tmp_path / "big"
    big.write_bytes(os.urandom(3 << 20))  # more than one read of aiofiles' buffer
    assert await read_small(big) == big.read_bytes()
    (tmp_path / "empty").write_bytes(b"")
    assert await read_small(tmp_path / "empty") == b""
    assert await read_small(tmp_path / "missing") is None
    assert await read_small(tmp_path / "missing" / "below") is None


async def _both_raise(path: Path, kind: type[OSError]) -> tuple[tuple[type, str], tuple[type, str]]:
    """The ``kind`` of error the old read and :func:`read_small` of ``path`` raise, each as
    (its exact type, its message)."""
    with pytest.raises(kind) as old:
        await _old_read(path)
    with pytest.raises(kind) as new:
        await read_small(path)
    return _error(old.value), _error(new.value)


async def test_read_small_raises_other_errors_as_read_bytes_does(tmp_path: Path) -> None:
    """A folder in the record's place, a file in a folder's, and a file nobody may read: the
    same type and the same words (the path's included)."""
    folder = tmp_path / IDENTITY_FILE
    folder.mkdir()
    old, new = await _both_raise(folder, IsADirectoryError)
    assert new == old
    assert new[0] is IsADirectoryError
    assert str(folder) in new[1]
    not_a_folder = tmp_path / "file"
    not_a_folder.write_bytes(b"x")
    old, new = await _both_raise(not_a_folder / "below", NotADirectoryError)
    assert new == old
    assert new[0] is NotADirectoryError
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked"
        locked.write_bytes(b"x")
        locked.chmod(0)
        old, new = await _both_raise(locked, PermissionError)
        assert new == old
        assert new[0] is PermissionError


async def _scanned(node: Path) -> tuple[NodeIdentity | None, str | None]:
    (node / "blobs").mkdir(parents=True, exist_ok=True)
    async with OpenLocation(Location("node", str(node), "job", "node0")) as opened:
        catalog = await opened.scan()
    return catalog.identity, catalog.identity_error


async def test_a_node_roots_scan_reports_the_identity_as_before(tmp_path: Path) -> None:
    node = tmp_path / "job" / "node0"
    node.mkdir(parents=True)
    path = node / IDENTITY_FILE
    assert await _scanned(node) == (None, None)  # none: normal (older checkpointers)
    write_identity(node, IDENTITY)
    assert await _scanned(node) == (IDENTITY, None)
    path.write_bytes(IDENTITY.to_bytes()[:9])  # cut short: damaged
    with pytest.raises(FormatError) as cut:
        NodeIdentity.from_bytes(path.read_bytes())
    assert await _scanned(node) == (None, f"FormatError: {cut.value}")
    path.unlink()
    path.mkdir()  # unreadable: reported with the error's own type and words
    with pytest.raises(IsADirectoryError) as old:
        await _old_read(path)
    assert await _scanned(node) == (None, f"IsADirectoryError: {old.value}")


def _facts_as_before(node_root: Path) -> tuple[str | None, str | None]:
    """What the opening reported of the identity before aiofiles (``guard.read_identity``)."""
    try:
        identity = read_identity(node_root)
    except (FormatError, OSError) as exc:
        return None, str(exc)
    return (None if identity is None else identity.to_bytes().decode()), None


async def test_an_opening_rank_reports_its_nodes_identity_as_before(tmp_path: Path) -> None:
    options = CheckpointerCore("job", local_root=tmp_path, rank=0, world_size=1)._config
    node_root = options.job.node_root
    path = node_root / IDENTITY_FILE

    async def facts() -> tuple[str | None, str | None, bool]:
        lock = RankLock(node_root, 0)
        try:
            got = await gather_facts(options, "session", lock, [])
        finally:
            lock.release(remove=True)
        return got.identity, got.identity_error, got.identity_damaged

    node_root.mkdir(parents=True, exist_ok=True)
    assert await facts() == (*_facts_as_before(node_root), False) == (None, None, False)
    write_identity(node_root, IDENTITY)
    whole = IDENTITY.to_bytes().decode()
    assert await facts() == (*_facts_as_before(node_root), False) == (whole, None, False)
    path.write_bytes(IDENTITY.to_bytes()[:9])  # cut short: damaged, not another run's
    got = await facts()
    assert got == (*_facts_as_before(node_root), True)
    assert got[1] is not None
    path.unlink()
    path.mkdir()  # cannot be read: an error, not damage
    got = await facts()
    assert got == (*_facts_as_before(node_root), False)
    assert got[1] is not None
    assert "Is a directory" in got[1]


async def test_keep_identity_sees_the_record_through_aiofiles(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The existence check after a commit: a record present is left alone; a folder in its
    place counts as present (as ``Path.exists`` said), so nothing is written over it."""

    class Claimed:  # what keep_identity reads of a claim
        def __init__(self, node_root: Path) -> None:
            self.options = CheckpointerCore(
                "job", local_root=node_root, rank=0, world_size=1
            )._config
            self.topo = self.options.job.topology
            self.opened_at = 1.0
            self.superseded = False
            self.recorded = 0

        async def record_identity(self) -> None:
            self.recorded += 1

    claim = Claimed(tmp_path)
    await keep_identity(claim)  # type: ignore[arg-type]
    assert claim.recorded == 1  # gone: written again, with a warning
    assert "is gone" in caplog.text
    write_identity(claim.options.job.node_root, IDENTITY)
    await keep_identity(claim)  # type: ignore[arg-type]
    (claim.options.job.node_root / IDENTITY_FILE).unlink()
    (claim.options.job.node_root / IDENTITY_FILE).mkdir()
    await keep_identity(claim)  # type: ignore[arg-type]
    assert claim.recorded == 1

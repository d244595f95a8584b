"""LocalTier on a full tmpfs: scenarios run in a child process by ``test_local_full.py``.

Not a test module: a regression here is a SIGBUS, which would kill pytest itself, so the test
runs this file as a script, one ``NAME=ROOT`` argument per scenario (``ROOT``: an empty, freshly
mounted small tmpfs), and reads what it prints: ``PASS NAME`` or ``FAIL NAME`` and a traceback.
A reservation that should have been refused is written to anyway, which is exactly what used
to kill training, so a regression shows as the child dying of SIGBUS.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path

from tiercheck.errors import TierFull
from tiercheck.tiers import LocalTier

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def pattern(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def free(root: str) -> int:
    """Bytes the filesystem at ``root`` can still hold."""
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def internal_files(root: str) -> list[str]:
    """The tier's own files (temporary, spare, prepared): names holding '#'."""
    return sorted(str(p) for p in Path(root).rglob("*") if p.is_file() and "#" in str(p))


async def expect_full_reserve(tier: LocalTier, key: str, nbytes: int) -> None:
    """``reserve`` must raise TierFull; if it does not, touch the memory like a snapshot would."""
    try:
        reservation = await tier.reserve(key, nbytes)
    except TierFull:
        return
    # Before the fix, the reserve succeeded and this copy died of SIGBUS.
    reservation.buffer[:] = b"\x01" * nbytes
    await reservation.abort()
    reservation.release()
    raise AssertionError(f"a reserve of {nbytes} bytes did not raise TierFull")


async def expect_full_put(tier: LocalTier, key: str, nbytes: int) -> None:
    try:
        await tier.put(key, b"\x02" * nbytes)
    except TierFull:
        return
    raise AssertionError(f"a put of {nbytes} bytes did not raise TierFull")


async def reserve_filled(tier: LocalTier, key: str, data: bytes) -> None:
    """Reserve, fill every byte, commit, release: what a save does."""
    reservation = await tier.reserve(key, len(data))
    reservation.buffer[:] = data
    await reservation.commit()
    reservation.release()


async def reserve_too_large(root: str) -> None:
    """A reserve larger than the free space raises TierFull and leaves nothing behind."""
    async with LocalTier(root) as tier:
        keep = pattern(MiB, 1)
        await tier.put("keep", keep)
        before = free(root)
        await expect_full_reserve(tier, "big", before + PAGE)
        await expect_full_reserve(tier, "keep", before + PAGE)  # an overwrite: the old one stays
        assert internal_files(root) == [], internal_files(root)
        assert free(root) == before, (free(root), before)
        assert tier.usage == MiB, tier.usage
        assert bytes(await tier.get("keep")) == keep


async def put_too_large(root: str) -> None:
    """A put larger than the free space raises TierFull and leaves nothing behind."""
    async with LocalTier(root) as tier:
        keep = pattern(MiB, 1)
        await tier.put("keep", keep)
        before = free(root)
        await expect_full_put(tier, "big", before + PAGE)
        await expect_full_put(tier, "keep", before + PAGE)
        assert internal_files(root) == [], internal_files(root)
        assert free(root) == before, (free(root), before)
        assert tier.usage == MiB, tier.usage
        assert bytes(await tier.get("keep")) == keep
        assert not await tier.exists("big")


async def fill_delete_reserve(root: str, spare_files: int) -> None:
    """One blob fills the filesystem; deleting it makes room for the next reserve."""
    async with LocalTier(root, spare_files=spare_files) as tier:
        keep = pattern(MiB, 1)
        await tier.put("keep", keep)
        size = free(root)
        await reserve_filled(tier, "fill", pattern(size, 2))
        assert free(root) == 0, free(root)
        await expect_full_reserve(tier, "more", PAGE)
        await tier.delete("fill")
        again = pattern(size, 3)
        await reserve_filled(tier, "again", again)
        assert bytes(await tier.get("again")) == again
        assert bytes(await tier.get("keep")) == keep
        assert internal_files(root) == [], internal_files(root)


async def fill_delete_reserve_fresh(root: str) -> None:
    """The same, with recycling off: the room comes from removing the file."""
    await fill_delete_reserve(root, spare_files=0)


async def fill_delete_reserve_recycled(root: str) -> None:
    """The same, with recycling: the deleted file is kept and refilled."""
    await fill_delete_reserve(root, spare_files=4)


async def grown_spare_too_large(root: str) -> None:
    """A recycled file that would grow past the free space raises TierFull (reserve and put)."""
    async with LocalTier(root, spare_files=4) as tier:
        keep = pattern(MiB, 1)
        await tier.put("keep", keep)
        for attempt in (expect_full_reserve, expect_full_put):
            await tier.put("a", pattern(2 * MiB, 2))
            await tier.delete("a")
            assert tier.spare_count == 1, tier.spare_count
            before = free(root)
            # The spare's own pages, all the free space, and one page more.
            await attempt(tier, "b", 2 * MiB + before + PAGE)
            # The spare was used up trying: its file is gone, and so is its count.
            assert (tier.spare_count, tier.spare_bytes) == (0, 0)
            assert internal_files(root) == [], internal_files(root)
            assert free(root) == before + 2 * MiB, (free(root), before)
            assert tier.usage == MiB, tier.usage
            assert bytes(await tier.get("keep")) == keep


async def prepare_too_large(root: str) -> None:
    """Preparing more than the free space prepares nothing (False), leaving nothing behind."""
    async with LocalTier(root) as tier:
        keep = pattern(MiB, 1)
        await tier.put("keep", keep)
        before = free(root)
        if await tier.prepare(before + PAGE):
            # Before the fix: prepared, and the reserve that takes it dies when written to.
            await expect_full_reserve(tier, "big", before + PAGE)
            raise AssertionError("prepare of more than the free space returned True")
        assert internal_files(root) == [], internal_files(root)
        assert free(root) == before, (free(root), before)
        assert tier.usage == MiB, tier.usage
        await expect_full_reserve(tier, "big", before + PAGE)
        assert bytes(await tier.get("keep")) == keep


async def spares_give_way(root: str) -> None:
    """Spares that fill the filesystem are dropped for a reserve that needs their room."""
    async with LocalTier(root, spare_files=4) as tier:
        await tier.put("a", pattern(3 * MiB, 1))
        await tier.put("b", pattern(3 * MiB, 2))
        await tier.delete("a")
        await tier.delete("b")
        assert tier.spare_bytes == 6 * MiB, tier.spare_bytes
        data = pattern(6 * MiB, 3)
        await reserve_filled(tier, "c", data)
        assert bytes(await tier.get("c")) == data
        assert (tier.spare_count, tier.spare_bytes) == (0, 0)
        assert internal_files(root) == [], internal_files(root)


async def prepared_gives_way(root: str) -> None:
    """Prepared memory that fills the filesystem is dropped for a reserve of another size."""
    async with LocalTier(root, spare_files=0) as tier:
        keep = pattern(MiB, 1)
        await tier.put("keep", keep)
        assert await tier.prepare(4 * MiB)
        data = pattern(5 * MiB, 2)
        await reserve_filled(tier, "x", data)
        assert bytes(await tier.get("x")) == data
        assert bytes(await tier.get("keep")) == keep
        assert internal_files(root) == [], internal_files(root)
        assert tier.usage == 6 * MiB, tier.usage


SCENARIOS: dict[str, Callable[[str], Awaitable[None]]] = {
    fn.__name__: fn
    for fn in (
        reserve_too_large,
        put_too_large,
        fill_delete_reserve_fresh,
        fill_delete_reserve_recycled,
        grown_spare_too_large,
        prepare_too_large,
        spares_give_way,
        prepared_gives_way,
    )
}

#: Size of the tmpfs each scenario gets (the numbers above are chosen for it).
FS_SIZE = 8 * MiB


async def main(args: list[str]) -> None:
    for arg in args:
        name, _, root = arg.partition("=")
        print(f"START {name}", flush=True)
        try:
            await SCENARIOS[name](root)
        except Exception:
            print(f"FAIL {name}", flush=True)
            traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
        else:
            print(f"PASS {name}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))

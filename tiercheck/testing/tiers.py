"""The tier conformance suite: every tier, built-in or third-party, passes :class:`TierTests`."""

from __future__ import annotations

import array
import asyncio
import functools
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import ClassVar

import pytest
import pytest_asyncio

from tiercheck.errors import BlobNotFound, InvalidKey, TierClosed
from tiercheck.tiers.base import Buffer, FailureScope, SupportsReserve, Tier

__all__ = ["TierTests"]

_KiB = 1024
_MiB = 1024 * _KiB

# Keys a tier must store, list and return unchanged (all valid per validate_key).
UNUSUAL_KEYS: tuple[str, ...] = (
    "with space/in the name",
    "ünïcødé/ключ/键/🙂",
    "punct/a=b+c@d%e~f,g!h(i)'j;k&l$m",
    "dots/a.b",
    "dots/a.b.c/d.e.f",
    "dots/.hidden",
    "dots/..two-leading",
    "dots/...",
    "deep/" + "/".join(f"level{i}" for i in range(24)),
    "trailing.dot./x.",
    "MiXeD/CaSe",
)

# Keys validate_key rejects; every operation must raise InvalidKey for them before any I/O.
INVALID_KEYS: tuple[object, ...] = (
    "",
    ".",
    "..",
    "a/../b",
    "a/./b",
    "/absolute",
    "a//b",
    "trailing/",
    "back\\slash",
    "question?mark",
    "hash#mark",
    "colon:name",
    "star*",
    "nul\x00byte",
    "new\nline",
    "del\x7fchar",
    " leading-space",
    "trailing-space ",
    "x" * 1025,
    None,
    5,
    b"bytes-key",
)


@functools.lru_cache(maxsize=8)
def _blob(size: int, seed: int) -> bytes:
    """``size`` pseudo-random bytes; different seeds differ almost everywhere.

    Cached: making 64 MiB of them takes longer than most tiers take to store them.
    """
    return random.Random(seed).randbytes(size)


def _as_kind(data: bytes, kind: str) -> Buffer:
    if kind == "bytes":
        return data
    if kind == "bytearray":
        return bytearray(data)
    if kind == "memoryview":
        # A view into the middle of a larger buffer, so that tiers honour its offset and length.
        padded = bytearray(b"\xee" * 7 + data + b"\xee" * 5)
        return memoryview(padded)[7 : 7 + len(data)]
    raise AssertionError(f"unknown buffer kind {kind}")


def _raw(data: object) -> memoryview:
    return memoryview(data).cast("B")  # type: ignore[arg-type]


def _same(a: memoryview, b: memoryview) -> bool:
    # memoryview == memoryview compares item by item; bytes compare with memcmp.
    return a.nbytes == b.nbytes and a.tobytes() == b.tobytes()


def assert_same_bytes(got: object, expected: object, what: str = "blob") -> None:
    """Assert two bytes-like objects are equal; on failure say where, without dumping them."""
    a, b = _raw(got), _raw(expected)
    if _same(a, b):
        return
    if a.nbytes != b.nbytes:
        raise AssertionError(f"{what}: got {a.nbytes} bytes, expected {b.nbytes}")
    step = _MiB
    start = next(i for i in range(0, a.nbytes, step) if a[i : i + step] != b[i : i + step])
    first = next(i for i in range(start, min(start + step, a.nbytes)) if a[i] != b[i])
    raise AssertionError(f"{what}: {a.nbytes} bytes, first difference at offset {first}")


def _equals(got: object, expected: bytes) -> bool:
    return _same(_raw(got), _raw(expected))


async def _listed(tier: Tier, prefix: str = "") -> list[str]:
    return sorted([key async for key in tier.list(prefix)])


class TierTests:
    """Conformance tests for a :class:`~tiercheck.tiers.Tier` implementation.

    Subclass it in a test module, under a name pytest collects (``Test...``), and say how to
    make the tier; every test below then runs against it. The base class itself is not
    collected (its name does not start with ``Test``). Complete example::

        # tests/test_my_tier.py
        from pathlib import Path

        from tiercheck.testing import TierTests
        from tiercheck.tiers import Tier

        from my_package import MyTier


        class TestMyTier(TierTests):
            large_size = 16 * 2**20  # optional: a smaller "large" blob for a slow backend

            async def make_tier(self, tmp_path: Path) -> Tier:
                return MyTier(root=tmp_path / "store")

            async def destroy_tier(self, tier: Tier) -> None:
                ...  # optional: remove what the test stored, if tmp_path does not hold it

            async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier:
                return MyTier(root=tmp_path / "store")  # optional: the same storage, anew

            async def raw_get(self, tier: Tier, key: str) -> bytes:
                return (tier.root / key).read_bytes()  # optional: the back door

            async def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
                ...  # optional: write straight into the backing storage

    Hooks and settings
        * ``make_tier(tmp_path)`` (required): a fresh, empty tier for one test. ``tmp_path``
          is pytest's per-test folder, for tiers that store files.
        * ``destroy_tier(tier)`` (optional): called after each test, once the tier is closed.
        * ``reopen_tier(tier, tmp_path)`` (optional): a new tier instance over the storage of
          ``tier``, which is closed. Define it for a tier whose blobs outlive the instance that
          stored them (a file, a store, another process's memory); the ``test_reopen_*`` tests
          then check that what was stored, overwritten and deleted is so after a reopen, and
          that nothing uncommitted shows. Without it they are skipped, saying why.
        * ``raw_get(tier, key)`` and ``raw_put(tier, key, data)`` (optional, both or neither):
          a back door that reads and writes the tier's backing storage directly, without
          calling the tier -- the files under its root, the objects in its bucket. ``raw_get``
          raises :class:`FileNotFoundError` (or :class:`~tiercheck.errors.BlobNotFound`) where
          nothing is stored. With them, the ``test_backing_*`` tests check that ``put`` really
          stores what it claims where it claims, that ``get`` reads what is there, and that
          ``delete`` removes it; without them they are skipped, saying why.
        * ``large_size``, ``race_size``, ``race_rounds``, ``concurrency``: sizes and counts
          used below; lower them only where a backend is too slow for the defaults.
        * A tier that needs other fixtures (a server, credentials) gets them through an
          autouse fixture of the subclass that stores them on ``self`` for ``make_tier``::

              @pytest.fixture(autouse=True)
              def _server(self, s3_server):
                  self.server = s3_server

    The tests need ``pytest-asyncio``; they are marked ``asyncio`` so they run in its strict
    mode too. A tier that implements :class:`~tiercheck.tiers.SupportsReserve` also runs the
    ``test_reserve_*`` tests; the others skip them.
    """

    pytestmark: ClassVar = [pytest.mark.asyncio]

    #: Size of the large-blob round trips (at least 64 MiB by default).
    large_size: ClassVar[int] = 64 * _MiB
    #: Size of the two blobs that writers alternate in the atomicity race.
    race_size: ClassVar[int] = 4 * _MiB
    #: How many puts each of the two racing writers makes.
    race_rounds: ClassVar[int] = 6
    #: How many different keys the concurrency test writes and reads at once.
    concurrency: ClassVar[int] = 64

    async def make_tier(self, tmp_path: Path) -> Tier:
        """Return a fresh, empty tier for one test. Subclasses must override this."""
        raise NotImplementedError(f"{type(self).__name__} must define make_tier(tmp_path)")

    async def destroy_tier(self, tier: Tier) -> None:
        """Clean up after one test (the tier is already closed). Does nothing by default."""

    async def reopen_tier(self, tier: Tier, tmp_path: Path) -> Tier:
        """Return a new tier over the storage of ``tier`` (closed by then). Optional.

        Not defined by default: the ``test_reopen_*`` tests are then skipped.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define reopen_tier")

    async def raw_get(self, tier: Tier, key: str) -> bytes:
        """The bytes stored under ``key``, read from the backing storage without ``tier``.

        Optional (with :meth:`raw_put`); raise :class:`FileNotFoundError` where nothing is
        stored. Not defined by default: the ``test_backing_*`` tests are then skipped.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define raw_get")

    async def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` in the backing storage without ``tier``. Optional."""
        raise NotImplementedError(f"{type(self).__name__} does not define raw_put")

    def _require(self, *hooks: str) -> None:
        """Skip the test, saying why, unless the subclass defines every one of ``hooks``."""
        missing = [h for h in hooks if getattr(type(self), h) is getattr(TierTests, h)]
        if missing:
            why = {
                "reopen_tier": "a tier whose blobs outlive the instance that stored them",
                "raw_get": "a back door to the tier's backing storage",
                "raw_put": "a back door to the tier's backing storage",
            }
            pytest.skip(
                f"{type(self).__name__} does not define {' and '.join(missing)} "
                f"(define it for {why[missing[0]]})"
            )

    async def _raw_stored(self, tier: Tier, key: str, what: str) -> bytes:
        """What the backing storage holds under ``key``; a failed test if it holds nothing."""
        try:
            return await self.raw_get(tier, key)
        except FileNotFoundError:
            raise AssertionError(
                f"{what}: the backing storage holds nothing under {key!r}"
            ) from None

    async def _raw_missing(self, tier: Tier, key: str) -> bool:
        """Whether the backing storage holds nothing under ``key`` (by the back door)."""
        try:
            await self.raw_get(tier, key)
        except FileNotFoundError:
            return True
        return False

    @pytest_asyncio.fixture
    async def tier(self, tmp_path: Path) -> AsyncIterator[Tier]:
        """The tier under test, closed and destroyed after the test."""
        made = await self.make_tier(tmp_path)
        try:
            yield made
        finally:
            await made.aclose()
            await self.destroy_tier(made)

    # --- identity -----------------------------------------------------------------------------

    async def test_declares_name_and_failure_scope(self, tier: Tier) -> None:
        """The tier names itself with a non-empty str and says which failures it outlives."""
        assert isinstance(tier.name, str)
        assert tier.name
        assert isinstance(tier.survives, FailureScope)

    # --- round trips --------------------------------------------------------------------------

    @pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
    async def test_round_trip_empty(self, tier: Tier, kind: str) -> None:
        """An empty blob is a blob: stored, found, sized 0 and read back empty."""
        await tier.put("empty", _as_kind(b"", kind))
        assert await tier.exists("empty")
        assert await tier.get_size("empty") == 0
        assert_same_bytes(await tier.get("empty"), b"")

    @pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
    async def test_round_trip_small(self, tier: Tier, kind: str) -> None:
        """A small blob given as bytes, bytearray or a sliced memoryview reads back the same."""
        data = _blob(1000, seed=1)
        await tier.put("small/blob", _as_kind(data, kind))
        assert_same_bytes(await tier.get("small/blob"), data)
        assert await tier.get_size("small/blob") == len(data)

    @pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
    async def test_round_trip_large(self, tier: Tier, kind: str) -> None:
        """A large blob (``large_size``, 64 MiB by default) reads back byte for byte."""
        data = _blob(self.large_size, seed=2)
        await tier.put("large/blob", _as_kind(data, kind))
        assert await tier.get_size("large/blob") == len(data)
        assert_same_bytes(await tier.get("large/blob"), data)

    async def test_round_trip_wide_items(self, tier: Tier) -> None:
        """A buffer of multi-byte items (floats) is stored as its raw bytes, all of them."""
        floats = array.array("d", [1.5, -2.25, 3.0e300, 0.0, 7.0])
        await tier.put("wide", memoryview(floats))
        assert await tier.get_size("wide") == len(floats) * floats.itemsize
        assert_same_bytes(await tier.get("wide"), floats.tobytes())

    async def test_put_takes_a_snapshot(self, tier: Tier) -> None:
        """Changing the caller's buffer after put returns does not change the stored blob."""
        data = bytearray(_blob(4096, seed=3))
        expected = bytes(data)
        await tier.put("snap", data)
        data[:] = b"\x00" * len(data)
        assert_same_bytes(await tier.get("snap"), expected)

    async def test_get_returns_a_private_copy(self, tier: Tier) -> None:
        """Changing a buffer returned by get (if writable) does not change the stored blob."""
        expected = _blob(4096, seed=4)
        await tier.put("private", expected)
        got = _raw(await tier.get("private"))
        if not got.readonly:
            got[:] = b"\x00" * got.nbytes
        assert_same_bytes(await tier.get("private"), expected)

    async def test_overwrite_replaces_the_blob(self, tier: Tier) -> None:
        """A put over an existing key replaces it wholly, with a larger or a smaller blob."""
        first, bigger, smaller = _blob(3000, 5), _blob(9000, 6), _blob(10, 7)
        await tier.put("over", first)
        await tier.put("over", bigger)
        assert_same_bytes(await tier.get("over"), bigger)
        await tier.put("over", smaller)
        assert_same_bytes(await tier.get("over"), smaller)
        assert await tier.get_size("over") == len(smaller)
        assert await _listed(tier) == ["over"]

    async def test_putv_round_trip(self, tier: Tier) -> None:
        """putv stores the concatenation of its parts (mixed buffer types, empty parts)."""
        parts: list[Buffer] = [
            _blob(100, 8),
            b"",
            bytearray(_blob(5000, 9)),
            memoryview(_blob(3, 10)),
            _as_kind(_blob(2 * _MiB, 11), "memoryview"),
        ]
        expected = b"".join(bytes(p) for p in parts)
        await tier.putv("vec/tor", parts)
        assert await tier.get_size("vec/tor") == len(expected)
        assert_same_bytes(await tier.get("vec/tor"), expected)

    async def test_putv_of_no_parts_is_an_empty_blob(self, tier: Tier) -> None:
        """putv with no parts stores an empty blob (and replaces an older one)."""
        await tier.put("vec/none", b"old")
        await tier.putv("vec/none", [])
        assert await tier.exists("vec/none")
        assert_same_bytes(await tier.get("vec/none"), b"")

    # --- missing keys, exists, size, delete ---------------------------------------------------

    async def test_get_missing_raises_blob_not_found(self, tier: Tier) -> None:
        """get of a key never stored raises BlobNotFound, which is a FileNotFoundError."""
        with pytest.raises(BlobNotFound) as info:
            await tier.get("never/stored")
        assert isinstance(info.value, FileNotFoundError)

    async def test_get_size_missing_raises_blob_not_found(self, tier: Tier) -> None:
        """get_size of a key never stored raises BlobNotFound."""
        with pytest.raises(BlobNotFound):
            await tier.get_size("never/stored")

    async def test_exists(self, tier: Tier) -> None:
        """exists is False before put, True after, False after delete."""
        assert not await tier.exists("ex/key")
        await tier.put("ex/key", b"x")
        assert await tier.exists("ex/key")
        await tier.delete("ex/key")
        assert not await tier.exists("ex/key")

    async def test_get_size(self, tier: Tier) -> None:
        """get_size reports each blob's length in bytes."""
        sizes = {"size/a": 1, "size/b": 4097, "size/c": 65536 + 3}
        for key, size in sizes.items():
            await tier.put(key, _blob(size, size))
        for key, size in sizes.items():
            assert await tier.get_size(key) == size

    async def test_delete_is_idempotent(self, tier: Tier) -> None:
        """Deleting a missing key is fine; deleting a stored one removes it, twice is fine."""
        await tier.delete("del/never")
        await tier.put("del/key", b"payload")
        await tier.delete("del/key")
        await tier.delete("del/key")
        assert not await tier.exists("del/key")
        with pytest.raises(BlobNotFound):
            await tier.get("del/key")

    async def test_delete_leaves_other_keys(self, tier: Tier) -> None:
        """Deleting one key leaves its siblings and nested neighbours intact."""
        for key in ("d/a", "d/b", "d/sub/c", "d2"):
            await tier.put(key, key.encode())
        await tier.delete("d/a")
        assert await _listed(tier) == ["d/b", "d/sub/c", "d2"]
        await tier.delete("d/sub/c")
        assert await _listed(tier) == ["d/b", "d2"]
        assert_same_bytes(await tier.get("d/b"), b"d/b")

    async def test_a_prefix_of_keys_is_not_a_blob(self, tier: Tier) -> None:
        """A key's folder ('v1' for 'v1/x') is no blob: absent, not found, delete is a no-op."""
        await tier.put("v1/x", b"x")
        assert not await tier.exists("v1")
        with pytest.raises(BlobNotFound):
            await tier.get("v1")
        with pytest.raises(BlobNotFound):
            await tier.get_size("v1")
        await tier.delete("v1")
        assert_same_bytes(await tier.get("v1/x"), b"x")

    # --- listing ------------------------------------------------------------------------------

    async def test_list_by_prefix_with_nested_keys(self, tier: Tier) -> None:
        """list yields exactly the keys with the prefix, however deep; each key once."""
        keys = ["a/b/c", "a/b/d", "a/bc", "a/e", "ab/f", "b", "b2/x/y/z"]
        for key in keys:
            await tier.put(key, key.encode())
        assert await _listed(tier, "a/") == ["a/b/c", "a/b/d", "a/bc", "a/e"]
        assert await _listed(tier, "a/b/") == ["a/b/c", "a/b/d"]
        assert await _listed(tier, "a/b") == ["a/b/c", "a/b/d", "a/bc"]
        assert await _listed(tier, "a") == ["a/b/c", "a/b/d", "a/bc", "a/e", "ab/f"]
        assert await _listed(tier, "b2/x/") == ["b2/x/y/z"]
        assert await _listed(tier, "a/b/c") == ["a/b/c"]
        assert await _listed(tier, "zzz/") == []
        listed = [key async for key in tier.list("")]
        assert len(listed) == len(set(listed))

    async def test_list_empty_prefix_lists_everything(self, tier: Tier) -> None:
        """list('') and list() yield every stored key, and nothing on an empty tier."""
        assert await _listed(tier) == []
        keys = ["x", "y/z", "deep/er/still"]
        for key in keys:
            await tier.put(key, b"1")
        assert await _listed(tier, "") == sorted(keys)
        assert sorted([key async for key in tier.list()]) == sorted(keys)

    async def test_list_never_shows_temporary_files(self, tier: Tier) -> None:
        """While large puts are in flight, a listing shows only whole, stored keys."""
        await tier.put("tmp/done", b"done")
        data = _blob(self.race_size, 12)
        writes = asyncio.gather(*(tier.put(f"tmp/inflight{i}", data) for i in range(4)))
        allowed = {"tmp/done"} | {f"tmp/inflight{i}" for i in range(4)}
        try:
            while not writes.done():
                listed = set(await _listed(tier))
                assert listed <= allowed, sorted(listed - allowed)
                await asyncio.sleep(0)
        finally:
            await writes
        assert set(await _listed(tier)) == allowed
        for key in allowed - {"tmp/done"}:
            await tier.delete(key)
        assert await _listed(tier) == ["tmp/done"]

    # --- concurrency and atomicity ------------------------------------------------------------

    async def test_many_concurrent_puts_and_gets(self, tier: Tier) -> None:
        """``concurrency`` puts, then gets, of different keys at once all land correctly."""
        n = self.concurrency
        blobs = {f"conc/{i:03d}": _blob(8 * _KiB + i, 100 + i) for i in range(n)}
        await asyncio.gather(*(tier.put(k, v) for k, v in blobs.items()))
        got = await asyncio.gather(*(tier.get(k) for k in blobs))
        for (key, expected), data in zip(blobs.items(), got, strict=True):
            assert_same_bytes(data, expected, key)
        assert await _listed(tier, "conc/") == sorted(blobs)
        await asyncio.gather(*(tier.delete(k) for k in blobs))
        assert await _listed(tier) == []

    async def test_reader_never_sees_a_partial_blob(self, tier: Tier) -> None:
        """Readers racing writers of one key always read one of the written blobs, whole."""
        blob_a = _blob(self.race_size, 20)
        blob_b = _blob(self.race_size + 4099, 21)
        await tier.put("race", blob_a)
        done = asyncio.Event()

        async def writer(first: bytes, second: bytes, *, reserve: bool) -> None:
            for i in range(self.race_rounds):
                await self._write(tier, "race", first if i % 2 == 0 else second, reserve=reserve)

        async def reader() -> int:
            reads = 0
            while not done.is_set():
                got = await tier.get("race")
                assert _equals(got, blob_a) or _equals(got, blob_b), (
                    f"read {_raw(got).nbytes} bytes that are neither blob"
                )
                reads += 1
                # A tier whose get never suspends would otherwise starve the writers.
                await asyncio.sleep(0)
            return reads

        readers = [asyncio.create_task(reader()) for _ in range(2)]
        try:
            await asyncio.gather(
                writer(blob_b, blob_a, reserve=False), writer(blob_a, blob_b, reserve=True)
            )
        finally:
            done.set()
        counts = await asyncio.gather(*readers)
        assert sum(counts) > 0
        final = await tier.get("race")
        assert _equals(final, blob_a) or _equals(final, blob_b)

    async def _write(self, tier: Tier, key: str, data: bytes, *, reserve: bool) -> None:
        """put, or with ``reserve`` reserve + commit on tiers that can."""
        if reserve and isinstance(tier, SupportsReserve):
            reservation = await tier.reserve(key, len(data))
            try:
                reservation.buffer[:] = data
                await reservation.commit()
            finally:
                reservation.release()
        else:
            await tier.put(key, data)

    async def test_failed_put_keeps_the_previous_blob(self, tier: Tier) -> None:
        """A put given something that is not a buffer raises TypeError and changes nothing."""
        await tier.put("keep", b"previous")
        bad_values: list[object] = [12345, "a str is not bytes", None, object()]
        for bad in bad_values:
            with pytest.raises(TypeError):
                await tier.put("keep", bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await tier.putv("keep", [b"ok", 12345])  # type: ignore[list-item]
        with pytest.raises(TypeError):
            await tier.put("fresh", 12345)  # type: ignore[arg-type]
        assert_same_bytes(await tier.get("keep"), b"previous")
        assert not await tier.exists("fresh")
        assert await _listed(tier) == ["keep"]

    # --- lifecycle ----------------------------------------------------------------------------

    async def test_use_after_aclose_raises_tier_closed(self, tier: Tier) -> None:
        """After aclose every operation raises TierClosed; aclose itself is idempotent."""
        await tier.put("kept", b"1")
        await tier.aclose()
        await tier.aclose()
        assert tier.closed
        calls: list[Callable[[], object]] = [
            lambda: tier.put("k", b"x"),
            lambda: tier.putv("k", [b"x"]),
            lambda: tier.get("kept"),
            lambda: tier.get_size("kept"),
            lambda: tier.exists("kept"),
            lambda: tier.delete("kept"),
        ]
        for call in calls:
            with pytest.raises(TierClosed):
                await call()  # type: ignore[misc]
        with pytest.raises(TierClosed):
            async for _ in tier.list():
                pass
        if isinstance(tier, SupportsReserve):
            with pytest.raises(TierClosed):
                await tier.reserve("k", 1)

    async def test_async_context_manager(self, tier: Tier) -> None:
        """``async with tier`` yields the tier and closes it on exit."""
        async with tier as entered:
            assert entered is tier
            await tier.put("ctx", b"1")
        assert tier.closed
        with pytest.raises(TierClosed):
            await tier.get("ctx")

    # --- closing and reopening (subclasses that define reopen_tier) ----------------------------

    async def _reopened(self, tier: Tier, tmp_path: Path) -> Tier:
        """Close ``tier`` and open its storage anew."""
        await tier.aclose()
        again = await self.reopen_tier(tier, tmp_path)
        assert again is not tier, "reopen_tier must return a new instance"
        assert not again.closed
        return again

    async def _assert_holds(self, tier: Tier, expected: dict[str, bytes], gone: list[str]) -> None:
        assert await _listed(tier) == sorted(expected)
        for key, data in expected.items():
            assert await tier.exists(key), key
            assert await tier.get_size(key) == len(data), key
            assert_same_bytes(await tier.get(key), data, key)
        for key in gone:
            assert not await tier.exists(key), key
            with pytest.raises(BlobNotFound):
                await tier.get(key)

    async def test_reopen_keeps_what_was_stored(self, tier: Tier, tmp_path: Path) -> None:
        """Blobs stored (put, putv, reserve), overwritten and deleted stay so after a reopen."""
        self._require("reopen_tier")
        expected = {
            "keep/small": _blob(1000, 60),
            "keep/empty": b"",
            "keep/deep/er/blob": _blob(2 * _MiB + 3, 61),
            "keep/vector": _blob(300, 62) + _blob(5000, 63),
            "keep/over": _blob(10, 64),
            UNUSUAL_KEYS[1]: UNUSUAL_KEYS[1].encode(),
        }
        for key in ("keep/small", "keep/empty", "keep/deep/er/blob", UNUSUAL_KEYS[1]):
            await tier.put(key, expected[key])
        await tier.putv("keep/vector", [_blob(300, 62), _blob(5000, 63)])
        await tier.put("keep/over", _blob(7000, 65))
        await tier.put("keep/over", expected["keep/over"])
        await tier.put("gone/deleted", b"deleted")
        await tier.delete("gone/deleted")
        if isinstance(tier, SupportsReserve):
            expected["keep/reserved"] = _blob(4096, 66)
            await self._write(tier, "keep/reserved", expected["keep/reserved"], reserve=True)
        again = await self._reopened(tier, tmp_path)
        try:
            await self._assert_holds(again, expected, ["gone/deleted"])
        finally:
            await again.aclose()

    async def test_reopen_keeps_changes_made_after_a_reopen(
        self, tier: Tier, tmp_path: Path
    ) -> None:
        """A reopened tier overwrites, deletes and adds, and a second reopen sees just that."""
        self._require("reopen_tier")
        await tier.put("a", b"first a")
        await tier.put("b/c", b"first b/c")
        await tier.put("d", b"first d")
        again = await self._reopened(tier, tmp_path)
        try:
            await again.put("a", b"second a")
            await again.delete("b/c")
            await again.put("e/f", b"new e/f")
            await self._assert_holds(
                again, {"a": b"second a", "d": b"first d", "e/f": b"new e/f"}, ["b/c"]
            )
            third = await self._reopened(again, tmp_path)
        finally:
            await again.aclose()
        try:
            await self._assert_holds(
                third, {"a": b"second a", "d": b"first d", "e/f": b"new e/f"}, ["b/c"]
            )
        finally:
            await third.aclose()

    async def test_reopen_shows_no_uncommitted_reservation(
        self, tier: Tier, tmp_path: Path
    ) -> None:
        """A reservation still open when the tier closes never becomes a blob, nor hides one."""
        self._require("reopen_tier")
        reserving = self._reserving(tier)
        await tier.put("res/old", b"old blob")
        fresh = await reserving.reserve("res/new", 4096)
        over = await reserving.reserve("res/old", 4096)
        try:
            fresh.buffer[:] = b"\x01" * 4096
            over.buffer[:] = b"\x02" * 4096
            again = await self._reopened(tier, tmp_path)
        finally:
            fresh.release()
            over.release()
        try:
            await self._assert_holds(again, {"res/old": b"old blob"}, ["res/new"])
        finally:
            await again.aclose()

    # --- the backing storage (subclasses that define raw_get and raw_put) ----------------------

    @pytest.mark.parametrize("size", [0, 1000, 2 * _MiB + 3])
    async def test_backing_storage_holds_what_put_stored(self, tier: Tier, size: int) -> None:
        """put and putv store their bytes in the backing storage, under the key given."""
        self._require("raw_get", "raw_put")
        data = _blob(size, 70)
        await tier.put("back/put", data)
        assert_same_bytes(await self._raw_stored(tier, "back/put", "put"), data, "backing put")
        half = size // 2
        await tier.putv("back/deep/putv", [data[:half], b"", data[half:]])
        stored = await self._raw_stored(tier, "back/deep/putv", "putv")
        assert_same_bytes(stored, data, "backing putv")
        assert await self._raw_missing(tier, "back/other")

    async def test_backing_storage_holds_a_committed_reservation(self, tier: Tier) -> None:
        """A reservation is absent from the backing storage until commit, then it is there."""
        self._require("raw_get", "raw_put")
        reserving = self._reserving(tier)
        data = _blob(_MiB + 5, 71)
        reservation = await reserving.reserve("back/reserved", len(data))
        try:
            reservation.buffer[:] = data
            assert await self._raw_missing(tier, "back/reserved")
            await reservation.commit()
        finally:
            reservation.release()
        stored = await self._raw_stored(tier, "back/reserved", "commit")
        assert_same_bytes(stored, data, "backing reserve")

    @pytest.mark.parametrize("size", [0, 1000, 2 * _MiB + 3])
    async def test_backing_storage_is_what_get_reads(self, tier: Tier, size: int) -> None:
        """Blobs put into the backing storage directly are found, sized, read and listed."""
        self._require("raw_get", "raw_put")
        data = _blob(size, 72)
        await self.raw_put(tier, "raw/blob", data)
        await self.raw_put(tier, "raw/deep/er", b"deeper")
        assert await tier.exists("raw/blob")
        assert await tier.get_size("raw/blob") == size
        assert_same_bytes(await tier.get("raw/blob"), data, "get of a raw blob")
        assert_same_bytes(await tier.get("raw/deep/er"), b"deeper", "get of a raw blob")
        assert await _listed(tier) == ["raw/blob", "raw/deep/er"]
        assert await _listed(tier, "raw/d") == ["raw/deep/er"]

    async def test_backing_storage_loses_what_delete_removed(self, tier: Tier) -> None:
        """delete removes the blob from the backing storage, whoever wrote it there."""
        self._require("raw_get", "raw_put")
        await tier.put("del/put", b"by put")
        await self.raw_put(tier, "del/raw", b"by the back door")
        await tier.delete("del/put")
        await tier.delete("del/raw")
        assert await self._raw_missing(tier, "del/put")
        assert await self._raw_missing(tier, "del/raw")
        assert await _listed(tier) == []

    async def test_backing_storage_follows_overwrites(self, tier: Tier) -> None:
        """An overwrite by put replaces what the back door wrote, and the other way round; a
        failed put changes nothing there."""
        self._require("raw_get", "raw_put")
        await self.raw_put(tier, "over/key", _blob(5000, 73))
        await tier.put("over/key", b"by put")
        stored = await self._raw_stored(tier, "over/key", "put")
        assert_same_bytes(stored, b"by put", "after put")
        with pytest.raises(TypeError):
            await tier.put("over/key", 12345)  # type: ignore[arg-type]
        stored = await self._raw_stored(tier, "over/key", "a failed put")
        assert_same_bytes(stored, b"by put", "after a failed put")
        await self.raw_put(tier, "over/key", b"by the back door")
        assert_same_bytes(await tier.get("over/key"), b"by the back door", "get after raw put")
        assert await tier.get_size("over/key") == len(b"by the back door")

    # --- keys ---------------------------------------------------------------------------------

    @pytest.mark.parametrize("key", UNUSUAL_KEYS)
    async def test_unusual_but_valid_keys(self, tier: Tier, key: str) -> None:
        """Keys with spaces, unicode, punctuation, dots and deep nesting work like any other."""
        data = key.encode()
        await tier.put(key, data)
        assert await tier.exists(key)
        assert await tier.get_size(key) == len(data)
        assert_same_bytes(await tier.get(key), data)
        assert await _listed(tier) == [key]
        head = key.rpartition("/")[0]
        assert await _listed(tier, head + "/" if head else key[:1]) == [key]
        await tier.delete(key)
        assert not await tier.exists(key)
        assert await _listed(tier) == []

    @pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
    async def test_invalid_keys_are_rejected(self, tier: Tier, key: object) -> None:
        """Invalid keys raise InvalidKey from put, putv, get, get_size, exists and delete."""
        bad: str = key  # type: ignore[assignment]
        calls: dict[str, Callable[[], object]] = {
            "put": lambda: tier.put(bad, b"x"),
            "putv": lambda: tier.putv(bad, [b"x"]),
            "get": lambda: tier.get(bad),
            "get_size": lambda: tier.get_size(bad),
            "exists": lambda: tier.exists(bad),
            "delete": lambda: tier.delete(bad),
        }
        if isinstance(tier, SupportsReserve):
            calls["reserve"] = lambda: tier.reserve(bad, 1)
        for op, call in calls.items():
            try:
                await call()  # type: ignore[misc]
            except InvalidKey:
                continue
            pytest.fail(f"{op} accepted the invalid key {key!r}")
        assert await _listed(tier) == []

    # --- reserve (tiers that implement SupportsReserve) ---------------------------------------

    def _reserving(self, tier: Tier) -> SupportsReserve:
        if not isinstance(tier, SupportsReserve):
            pytest.skip(f"{type(tier).__name__} does not implement SupportsReserve")
        return tier

    async def test_reserve_commit_publishes_the_buffer(self, tier: Tier) -> None:
        """What is written into a reservation's buffer is the blob once committed."""
        reserving = self._reserving(tier)
        data = _blob(3 * _MiB + 17, 30)
        reservation = await reserving.reserve("res/blob", len(data))
        try:
            assert reservation.key == "res/blob"
            assert reservation.buffer.nbytes == len(data)
            reservation.buffer[:] = data
            await reservation.commit()
            assert_same_bytes(await tier.get("res/blob"), data)
            assert await tier.get_size("res/blob") == len(data)
            assert_same_bytes(reservation.buffer, data, "buffer after commit")
        finally:
            reservation.release()
        assert_same_bytes(await tier.get("res/blob"), data)

    async def test_reserve_is_invisible_until_commit(self, tier: Tier) -> None:
        """Before commit, a new key is absent and an existing key still holds its old blob."""
        reserving = self._reserving(tier)
        await tier.put("res/old", b"old blob")
        fresh = await reserving.reserve("res/new", 10)
        again = await reserving.reserve("res/old", 10)
        try:
            fresh.buffer[:] = b"0123456789"
            again.buffer[:] = b"9876543210"
            assert not await tier.exists("res/new")
            with pytest.raises(BlobNotFound):
                await tier.get("res/new")
            assert_same_bytes(await tier.get("res/old"), b"old blob")
            assert await _listed(tier) == ["res/old"]
            await fresh.commit()
            await again.commit()
            assert_same_bytes(await tier.get("res/new"), b"0123456789")
            assert_same_bytes(await tier.get("res/old"), b"9876543210")
        finally:
            fresh.release()
            again.release()

    async def test_reserve_abort_leaves_nothing(self, tier: Tier) -> None:
        """An aborted reservation leaves no blob, no listing entry, and the old blob intact."""
        reserving = self._reserving(tier)
        await tier.put("res/kept", b"kept")
        for key in ("res/gone", "res/kept"):
            reservation = await reserving.reserve(key, 4096)
            try:
                reservation.buffer[:] = b"\xab" * 4096
                await reservation.abort()
            finally:
                reservation.release()
        assert not await tier.exists("res/gone")
        assert_same_bytes(await tier.get("res/kept"), b"kept")
        assert await _listed(tier) == ["res/kept"]

    async def test_reserve_release_without_commit_discards(self, tier: Tier) -> None:
        """Releasing a reservation that was neither committed nor aborted stores nothing."""
        reserving = self._reserving(tier)
        reservation = await reserving.reserve("res/dropped", 100)
        reservation.buffer[:] = b"\x01" * 100
        reservation.release()
        assert not await tier.exists("res/dropped")
        assert await _listed(tier) == []

    async def test_reserve_zero_bytes(self, tier: Tier) -> None:
        """A reservation of 0 bytes commits an empty blob."""
        reserving = self._reserving(tier)
        reservation = await reserving.reserve("res/zero", 0)
        try:
            assert reservation.buffer.nbytes == 0
            await reservation.commit()
        finally:
            reservation.release()
        assert await tier.exists("res/zero")
        assert_same_bytes(await tier.get("res/zero"), b"")

    async def test_reserve_after_delete_gives_correct_contents(self, tier: Tier) -> None:
        """Reusing memory after deletes (recycling) never mixes old bytes into new blobs."""
        reserving = self._reserving(tier)
        sizes = [2 * _MiB, 2 * _MiB, 3 * _MiB + 1, 512 * _KiB, 2 * _MiB, 1, 4 * _MiB]
        previous: str | None = None
        for i, size in enumerate(sizes):
            key = f"cycle/{i}"
            data = _blob(size, 40 + i)
            if i % 3 == 2:
                await tier.put(key, data)
            else:
                reservation = await reserving.reserve(key, size)
                try:
                    reservation.buffer[:] = data
                    await reservation.commit()
                finally:
                    reservation.release()
            assert_same_bytes(await tier.get(key), data, key)
            if previous is not None:
                await tier.delete(previous)
            previous = key
        assert await _listed(tier) == [f"cycle/{len(sizes) - 1}"]

    async def test_reserved_buffer_survives_delete_and_reuse(self, tier: Tier) -> None:
        """A committed, unreleased buffer keeps its bytes after its key is deleted and reused."""
        reserving = self._reserving(tier)
        size = 1 * _MiB
        first_data, second_data = _blob(size, 50), _blob(size, 51)
        first = await reserving.reserve("keep/first", size)
        try:
            first.buffer[:] = first_data
            await first.commit()
            await tier.delete("keep/first")
            second = await reserving.reserve("keep/second", size)
            try:
                second.buffer[:] = second_data
                await second.commit()
            finally:
                second.release()
            third = await reserving.reserve("keep/first", size)
            try:
                third.buffer[:] = second_data
                await third.commit()
            finally:
                third.release()
            assert_same_bytes(first.buffer, first_data, "the first, still-held buffer")
        finally:
            first.release()
        assert_same_bytes(await tier.get("keep/second"), second_data)
        assert_same_bytes(await tier.get("keep/first"), second_data)

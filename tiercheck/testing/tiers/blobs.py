"""Conformance tests of storing blobs: round trips, exists, size, delete, listing and keys."""

from __future__ import annotations

import array
import asyncio
from collections.abc import Callable

import pytest

from tiercheck.errors import BlobNotFound, InvalidKey
from tiercheck.testing.tiers.support import (
    INVALID_KEYS,
    UNUSUAL_KEYS,
    _as_kind,
    _blob,
    _listed,
    _MiB,
    _raw,
    _TierTestBase,
    assert_same_bytes,
)
from tiercheck.tiers.base import Buffer, FailureScope, SupportsReserve, Tier


class _BlobTests(_TierTestBase):
    """Identity, round trips, missing keys, listing and keys."""

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

"""The tier conformance suite: every tier, built-in or third-party, passes :class:`TierTests`.

The tests come in groups, one module each: :mod:`~tiercheck.testing.tiers.blobs` (round trips,
exists, size, delete, listing, keys), :mod:`~tiercheck.testing.tiers.concurrency`,
:mod:`~tiercheck.testing.tiers.lifecycle` (closing and reopening),
:mod:`~tiercheck.testing.tiers.backing` (through the back door),
:mod:`~tiercheck.testing.tiers.reserve`, :mod:`~tiercheck.testing.tiers.ranged` and
:mod:`~tiercheck.testing.tiers.fileread`;
:mod:`~tiercheck.testing.tiers.support` holds the hooks, the fixture and the test data they
share.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from tiercheck.testing.tiers.backing import _BackingTests
from tiercheck.testing.tiers.blobs import _BlobTests
from tiercheck.testing.tiers.concurrency import _ConcurrencyTests
from tiercheck.testing.tiers.fileread import _FileReadTests
from tiercheck.testing.tiers.lifecycle import _LifecycleTests
from tiercheck.testing.tiers.ranged import _RangedTests
from tiercheck.testing.tiers.reserve import _ReserveTests
from tiercheck.testing.tiers.support import INVALID_KEYS, UNUSUAL_KEYS, assert_same_bytes

__all__ = ["INVALID_KEYS", "UNUSUAL_KEYS", "TierTests", "assert_same_bytes"]


class TierTests(
    _BlobTests,
    _ConcurrencyTests,
    _LifecycleTests,
    _BackingTests,
    _ReserveTests,
    _RangedTests,
    _FileReadTests,
):
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
    ``test_reserve_*`` tests; the others skip them. Likewise a tier that implements
    :class:`~tiercheck.tiers.SupportsRangedGet` runs the ``test_get_range_*`` tests.
    """

    pytestmark: ClassVar = [pytest.mark.asyncio]

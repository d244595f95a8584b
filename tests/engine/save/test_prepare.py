"""Readying a new job's first save ahead of it (``Checkpointer.prepare``,
tiercheck/engine/save/stage.py ``Stager.prepare``), with real checkpointers on a real local tier.

The first save of a new job would size, back and fault in its shared memory inside the training
step. ``prepare(state)`` readies it in the background; the first save then takes it (the spare
file becomes the blob) -- and whatever ``prepare`` was given, every save stays bit-exact.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import assert_state_equal
from tiercheck import SyncCheckpointer, VersionError

N = 300_000


def state_of(version: int, n: int = N) -> dict[str, Any]:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(7, generator=g), "step": version}


def ckpt(root: Path, **kw: Any) -> SyncCheckpointer:
    kw.setdefault("tiers", ["local", "persistent"])
    return SyncCheckpointer(
        "job", local_root=root / "node", persistent=(root / "durable").as_uri(), **kw
    )


def spares_of(root: Path, size: int, timeout: float = 30.0) -> list[Path]:
    """The prepared spare files of ``size`` bytes, once one appears (or none by ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [p for p in root.rglob(".tiercheck#spares/*") if p.stat().st_size == size]
        if found:
            return found
        time.sleep(0.01)
    return []


def blob_size(root: Path, version: int) -> int:
    (found,) = (root / "node").rglob(f"v{version:012d}/r00000.full")
    return found.stat().st_size


def restored(root: Path, version: int, **kw: Any) -> dict[str, Any]:
    target = {"w": torch.zeros(N), "b": torch.zeros(7), "step": -1}
    with ckpt(root, **kw) as c:
        got = c.restore(target)
    assert got is not None
    assert got.version == version
    return target


@pytest.mark.parametrize("version", [0, 7, 1_000, 123_456_789])
def test_the_first_save_of_a_new_job_takes_the_memory_prepared_for_it(
    tmp_path: Path, version: int
) -> None:
    with ckpt(tmp_path) as c:
        readied = c.prepare(state_of(version), version=version)
        found = spares_of(tmp_path / "node", readied)
        assert found, "no memory was prepared"
        c.save(version, state_of(version))
        c.wait()
        assert not found[0].exists()  # taken by the save: renamed over its blob
        assert c.stats.layouts_reused >= 1  # the save reused the layout prepare found
    assert blob_size(tmp_path, version) == readied
    assert_state_equal(restored(tmp_path, version), state_of(version))
    assert_state_equal(restored(tmp_path, version, tiers=["persistent"]), state_of(version))


def test_a_state_that_changes_shape_before_the_first_save_is_still_saved_exactly(
    tmp_path: Path,
) -> None:
    """An optimizer before its first step has no moments yet: the room readied for that
    state does not fit the first save's, which allocates as before and loses nothing."""
    with ckpt(tmp_path) as c:
        readied = c.prepare(state_of(0, n=1000))
        assert readied > 0
        c.save(1, state_of(1))
        c.save(2, state_of(2))
        c.wait()
    assert_state_equal(restored(tmp_path, 2), state_of(2))


def test_nothing_is_readied_where_no_tier_copies_into_its_memory_or_a_save_reserved(
    tmp_path: Path,
) -> None:
    with ckpt(tmp_path, tiers=["persistent"]) as c:
        assert c.prepare(state_of(0)) == 0  # no tier lends its memory to a snapshot
        c.save(0, state_of(0))
        c.wait()
    with ckpt(tmp_path, tiers=["local", "persistent"], encodings={"local": "packed"}) as c:
        assert c.prepare(state_of(0)) == 0  # a packed blob is not the snapshot as is
    with ckpt(tmp_path / "again") as c:
        c.save(0, state_of(0))
        c.wait()
        assert c.prepare(state_of(1), version=1) == 0  # the saves ready their own now


def test_a_bad_version_is_refused_before_anything_is_opened(tmp_path: Path) -> None:
    c = ckpt(tmp_path)
    with pytest.raises(VersionError):
        c.prepare(state_of(0), version=-1)
    assert not (tmp_path / "node").exists()
    c.close()

"""Tiers built through the registry, and zero-copy staging chosen by capability."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from tiercheck import SyncCheckpointer
from tiercheck.tiers.base import TierSetup
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.registry import register_tier, unregister_tier


class _ScratchTier(LocalTier):
    """A reserving tier under another name than "local", built by the checkpointer."""

    name = "scratch"
    setups: ClassVar[list[TierSetup]] = []

    @classmethod
    def for_job(cls, setup: TierSetup) -> _ScratchTier:
        cls.setups.append(setup)
        return cls(setup.node_root / "scratch", name="scratch")


@pytest.fixture
def scratch() -> Iterator[type[_ScratchTier]]:
    _ScratchTier.setups.clear()
    register_tier("scratch", _ScratchTier)
    try:
        yield _ScratchTier
    finally:
        unregister_tier("scratch")


def _ckpt(tmp_path: Path, encoding: str) -> SyncCheckpointer:
    return SyncCheckpointer(
        "job",
        tiers=["scratch"],
        encodings={"scratch": encoding},  # type: ignore[dict-item]
        local_root=tmp_path / "shm",
        persistent=(tmp_path / "durable").as_uri(),
    )


@pytest.mark.parametrize(("encoding", "in_place"), [("full", True), ("packed", False)])
def test_a_named_tier_is_built_through_the_registry_and_reserves_by_capability(
    tmp_path: Path, scratch: type[_ScratchTier], encoding: str, in_place: bool
) -> None:
    with _ckpt(tmp_path, encoding) as ckpt:
        ckpt.save(0, {"w": torch.arange(1000, dtype=torch.float32)}).result("scratch")
        # Copied straight into the tier's own memory (a full blob in a reserving tier), or
        # through a staging buffer when the tier stores something else.
        assert (ckpt.stats.staging_bytes == 0) is in_place
        restored = ckpt.restore()
    assert restored is not None
    assert torch.equal(restored.state["w"], torch.arange(1000, dtype=torch.float32))
    [setup] = scratch.setups
    assert setup.job_id == "job"
    assert setup.node_root == tmp_path / "shm"
    assert any((tmp_path / "shm" / "scratch").rglob("v000000000000/r00000.*"))

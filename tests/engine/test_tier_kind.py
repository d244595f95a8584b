"""What a tier declares decides its kind, never its name: a third-party tier that survives the
cluster is durable (its policy, ``COMMIT`` records, retention, a restore after the nodes are
gone), and a tier registered under another name than its class's is refused at construction.

The same, with the plugin built and installed as a real package and read back by the command
line, is ``tests/tiers/test_installed_plugin.py``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiers.dict_tier import DictTier
from tests.tiers.vault_tier import ROOT_VARIABLE, VaultTier
from tiercheck import SyncCheckpointer
from tiercheck.engine.options import TierPolicy
from tiercheck.errors import ConfigError
from tiercheck.tiers import DelegatingTier, FailureScope, PersistentTier, registry
from tiercheck.tiers.base import TierSetup
from tiercheck.tiers.registry import register_tier


class _MemoTier(DictTier):
    """A third-party tier that survives the loss of a node (a memory tier)."""

    name = "memo"
    survives = FailureScope.NODE


class _RenamingTier(VaultTier):
    """Declares one name, builds tiers under another."""

    name = "renaming"

    @classmethod
    def for_job(cls, setup: TierSetup) -> VaultTier:
        tier = VaultTier("/nonexistent")
        tier.name = "elsewhere"
        return tier


class _ShrinkingTier(VaultTier):
    """Declares that it outlives the cluster, builds tiers that do not."""

    name = "shrinking"

    @classmethod
    def for_job(cls, setup: TierSetup) -> VaultTier:
        tier = cls("/nonexistent")
        tier.survives = FailureScope.NODE
        return tier


@pytest.fixture(autouse=True)
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The vault and memo tiers registered by name (the vault storing under tmp_path/vault);
    the registry as it was afterwards."""
    saved = dict(registry._registered)
    registry.clear_cache()
    for cls in (VaultTier, _MemoTier, _RenamingTier, _ShrinkingTier):
        register_tier(cls.name, cls)
    vault = tmp_path / "vault"
    monkeypatch.setenv(ROOT_VARIABLE, str(vault))
    yield vault
    registry._registered.clear()
    registry._registered.update(saved)
    registry.clear_cache()


def _options(tmp_path: Path, **kw: Any) -> dict[str, Any]:
    return {
        "local_root": tmp_path / "shm",
        "persistent": (tmp_path / "durable").as_uri(),
        "rank": 0,
        "world_size": 1,
        **kw,
    }


def test_a_tier_given_by_name_is_durable_by_what_it_declares(tmp_path: Path) -> None:
    ckpt = SyncCheckpointer("job", **_options(tmp_path, tiers=["local", "memo", "vault"]))
    assert ckpt.policies == {
        "local": TierPolicy(keep=2, encoding="full", versions="all"),
        "memo": TierPolicy(keep=2, encoding="full", versions="all"),
        "vault": TierPolicy(keep=3, encoding="packed", versions="base"),
    }
    alone = SyncCheckpointer("job", **_options(tmp_path, tiers=["vault"]))
    assert alone.policies == {"vault": TierPolicy(keep=3, encoding="packed", versions="all")}


def test_a_tier_given_as_an_instance_is_durable_by_what_it_declares(tmp_path: Path) -> None:
    archive = PersistentTier((tmp_path / "archive").as_uri(), name="archive")
    memo = DelegatingTier(DictTier(), name="memo2", survives=FailureScope.NODE)
    ckpt = SyncCheckpointer("job", **_options(tmp_path, tiers=[memo, archive]))
    assert ckpt.policies == {
        "memo2": TierPolicy(keep=2, encoding="full", versions="all"),
        "archive": TierPolicy(keep=3, encoding="packed", versions="base"),
    }


def test_a_name_its_class_does_not_declare_fails_at_construction(tmp_path: Path) -> None:
    register_tier("mydict", f"{DictTier.__module__}:DictTier")
    with pytest.raises(ConfigError, match=r"declares the name 'dict'.*register_tier\('dict'"):
        SyncCheckpointer("job", **_options(tmp_path, tiers=["local", "mydict"]))
    assert not (tmp_path / "shm").exists()
    assert not (tmp_path / "durable").exists()


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("renaming", "name 'elsewhere', survives CLUSTER, but the class declares name 'renaming'"),
        ("shrinking", "survives NODE, but the class declares name 'shrinking', survives CLUSTER"),
    ],
)
def test_a_tier_built_otherwise_than_its_class_declares_is_refused_at_opening(
    tmp_path: Path, name: str, match: str
) -> None:
    ckpt = SyncCheckpointer("job", **_options(tmp_path, tiers=["local", name]))
    with pytest.raises(ConfigError, match=match):
        ckpt.open()


def _state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "w": torch.randn(256, 64, generator=g),
        "b": torch.randn(64, generator=g).to(torch.bfloat16),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _commits(folder: Path) -> set[int]:
    return {int(p.parent.name[1:]) for p in folder.glob("v*/COMMIT")}


def test_a_durable_plugin_tier_holds_commits_keeps_three_and_outlives_the_nodes(
    tmp_path: Path, plugins: Path
) -> None:
    """Saved to local and vault (bases only there), retention keeps the vault's newest three
    bases, proven by COMMIT records beside a job record; with the node's memory gone, a new
    opening restores the newest one from the vault, bit for bit."""
    options = _options(tmp_path, tiers=["local", "vault"], base_every=2)
    with SyncCheckpointer("job", **options) as ckpt:
        for version in range(10):
            ckpt.save(version, _state(version))
        assert ckpt.wait()["vault"] == 8
    job = plugins / "job"
    assert _commits(job) == {4, 6, 8}
    assert sorted(p.name for p in job.glob("v*/r*")) == ["r00000.packed"] * 3
    assert (job / "JOB").is_file()
    assert list((job / "writers").iterdir())
    shutil.rmtree(tmp_path / "shm")  # the cluster is lost; the vault is not
    target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    with SyncCheckpointer("job", **options) as ckpt:
        restored = ckpt.restore(target)
    assert restored is not None
    assert (restored.version, restored.source_tier) == (8, "vault")
    for key, value in _state(8).items():
        assert torch.equal(_bits(target[key]), _bits(value)), key

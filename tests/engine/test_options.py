"""Configuration resolved into frozen groups (tiercheck.engine.options)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tiercheck.engine.options import TierPolicy, resolve_options
from tiercheck.errors import ConfigError


def test_defaults_are_filled_in_and_grouped(tmp_path: Path) -> None:
    options = resolve_options("job", local_root=tmp_path, rank=0, world_size=1)
    assert options.job.job_id == "job"
    assert options.job.node_root == tmp_path
    assert options.tiers.specs == ("local", "persistent")
    assert options.tier_names == ["local", "persistent"]
    assert options.tiers.policy("local") == TierPolicy(keep=2, encoding="full", versions="all")
    assert options.tiers.policy("persistent") == TierPolicy(
        keep=3, encoding="packed", versions="base"
    )
    assert options.schedule.base_every == 10
    assert options.encode.threads >= 1
    assert options.coordination.close_timeout == 30.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.schedule.base_every = 3  # type: ignore[misc]


def test_shorthands_and_full_policies(tmp_path: Path) -> None:
    options = resolve_options(
        "job",
        local_root=tmp_path,
        rank=0,
        world_size=1,
        keep={"persistent": 7},
        persist="all",
        encodings={"local": "packed"},
        policies={"local": TierPolicy(keep=1)},
    )
    assert options.tiers.policy("persistent") == TierPolicy(keep=7, versions="all")
    assert options.tiers.policy("local") == TierPolicy(keep=1)  # the full policy wins
    with pytest.raises(ConfigError, match="no policy for tier 'peer'"):
        options.tiers.policy("peer")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"base_every": 0}, "base_every"),
        ({"on_busy": "drop"}, "on_busy"),
        ({"overlap": 1}, "overlap"),
        ({"max_pending": 0}, "max_pending"),
        ({"stale_memory": "keep"}, "stale_memory"),
        ({"storage_options": ["key"]}, "storage_options"),
        ({"close_timeout": -1}, "close_timeout"),
        ({"tiers": []}, "at least one tier"),
        ({"tiers": [3]}, "a tier is a name"),
        ({"keep": {"peer": 2}}, "not in use"),
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve_options("job", local_root=tmp_path, rank=0, world_size=1, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("job_id", ["", "a/b", ".", "..", 3])
def test_a_job_id_must_name_a_folder(tmp_path: Path, job_id: object) -> None:
    with pytest.raises(ConfigError, match="job_id"):
        resolve_options(job_id, local_root=tmp_path, rank=0, world_size=1)  # type: ignore[arg-type]

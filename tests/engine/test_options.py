"""Configuration resolved into frozen groups (tiercheck.engine.options)."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from tiercheck.engine.core import CheckpointerCore
from tiercheck.engine.options import Options, TierPolicy
from tiercheck.errors import ConfigError


def resolve_options(job_id: str, **kwargs: Any) -> Options:
    """The options as the constructor resolves them: it declares them, once, with their
    defaults, and hands every one to :func:`tiercheck.engine.options.resolve_options`."""
    return CheckpointerCore(job_id, **kwargs)._config


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
    assert options.preemption.enabled
    assert options.preemption.grace == 20.0
    assert (options.coordination.durable_retry_delay, options.coordination.durable_retry_max) == (
        1.0,
        60.0,
    )
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


class _NotATier:
    name = "persistent"


# Every option of resolve_options (and so of both checkpointers) with values of the wrong type
# or out of range: each is a ConfigError saying what was expected, never a TypeError from deep
# inside, and never accepted.
BAD_OPTIONS: list[tuple[str, object]] = [
    *[("keep", v) for v in (1.5, True, 0, -1, "3", [2], {"local": 1.5}, {"local": True},
                            {"local": 0}, {"nope": 2})],
    *[("base_every", v) for v in (0, -1, 1.5, True, "10", None)],
    *[("max_pending", v) for v in (0, 1.5, True, "1", None)],
    *[("tier_queue", v) for v in (0, 2.0, False, "4")],
    *[("peer_replicas", v) for v in (0, True, 1.5, "1")],
    *[("peer_timeout", v) for v in (0, -1.0, "300", True, float("nan"), None)],
    *[("close_timeout", v) for v in (-1, True, float("nan"), "30", None)],
    *[("behind_saves", v) for v in (0, -1, 1.5, True, "10", None)],
    *[("behind_seconds", v) for v in (0, -1, True, float("nan"), "600", None)],
    *[("preemption", v) for v in (1, "yes", None)],
    *[("preemption_grace", v) for v in (0, -1, True, float("nan"), float("inf"), "20", None)],
    *[("durable_retry_delay", v) for v in (0, -1.0, True, float("nan"), "1", None)],
    # Unbounded, or shorter than the first wait.
    *[("durable_retry_max", v) for v in (0, True, float("inf"), 0.5, "60", None)],
    *[("threads", v) for v in (-1, 1.5, True, "4", None)],
    *[("local_capacity", v) for v in (-1, 1.5, True, "1GB")],
    *[("rank", v) for v in (-1, 1.5, True, "0")],
    *[("world_size", v) for v in (0, 1.5, True, "1")],
    *[("ranks_per_node", v) for v in (0, 1.5, True, "1")],
    *[("node", v) for v in ("a/b", "", "x::y", 3)],
    *[("tiers", v) for v in ("local", b"local", ["local", "local"], [""], [None], 3, {"local": 1},
                             ["local", "control"], ["preempt", "persistent"],
                             [_NotATier()])],
    *[("encodings", v) for v in ({"local": "zip"}, {"nope": "full"}, ["full"], "full")],
    *[("policies", v) for v in ({"local": {"keep": 1}}, {"nope": TierPolicy()}, "x")],
    *[("persist", v) for v in ("some", 3, True)],
    *[("on_busy", v) for v in ("drop", 3, None)],
    *[("overlap", v) for v in (1, "yes", None)],
    *[("allow_pickle", v) for v in (1, "no", None)],
    *[("elastic", v) for v in (0, "yes", None)],
    *[("stale_memory", v) for v in ("keep", 3, None)],
    *[("per_rank", v) for v in ("share", None)],
    *[("storage_options", v) for v in ("key=1", ["key"])],
    *[("codec", v) for v in ("zstd", 3)],
    *[("coordinator", v) for v in (object(), "gloo")],
    *[("persistent", v) for v in (3, "", "  ", Path("/tmp/x"))],
    *[("local_root", v) for v in (3, "")],
]  # fmt: skip


def _id(value: object) -> str:
    """A test id that is the same in every process (no memory address: pytest-xdist's workers
    must collect the same tests)."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))[:30]


@pytest.mark.parametrize(("option", "value"), BAD_OPTIONS, ids=_id)
def test_every_bad_option_is_a_config_error_at_construction(
    tmp_path: Path, option: str, value: object
) -> None:
    from tiercheck import SyncCheckpointer

    kwargs: dict[str, object] = {
        "local_root": tmp_path / "shm",
        "persistent": (tmp_path / "durable").as_uri(),
        "rank": 0,
        "world_size": 1,
    }
    kwargs[option] = value
    if option in ("rank", "world_size"):
        kwargs.pop("world_size" if option == "rank" else "rank")
    with pytest.raises(
        ConfigError, match=option.replace("_", "[_ ]?") if option != "tiers" else "tier"
    ):
        SyncCheckpointer("job", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "shm").exists()
    assert not (tmp_path / "durable").exists()


@pytest.mark.parametrize("keep", [True, 1.5, 0])
def test_a_tier_policy_refuses_a_keep_that_is_not_a_count(keep: object) -> None:
    with pytest.raises(ConfigError, match="keep"):
        TierPolicy(keep=keep)  # type: ignore[arg-type]


def test_durable_tiers_alone_take_every_version_by_default(tmp_path: Path) -> None:
    from tiercheck.tiers.persistent import PersistentTier

    def versions(**kw: object) -> dict[str, object]:
        options = resolve_options("job", local_root=tmp_path, rank=0, world_size=1, **kw)  # type: ignore[arg-type]
        return {name: p.versions for name, p in options.tiers.policies.items()}

    assert versions() == {"local": "all", "persistent": "base"}
    assert versions(tiers=["persistent"]) == {"persistent": "all"}
    durable = PersistentTier((tmp_path / "d").as_uri())
    assert versions(tiers=[durable]) == {"persistent": "all"}
    assert versions(tiers=["local", durable]) == {"local": "all", "persistent": "base"}
    assert versions(tiers=["persistent"], persist="all") == {"persistent": "all"}


@pytest.mark.parametrize(
    "kw",
    [
        {"tiers": ["persistent"], "persist": "base"},
        {"tiers": ["persistent"], "persist": lambda v: v % 3 == 0},
        {"policies": {"local": TierPolicy(versions="base")}},
    ],
    ids=["base", "predicate", "memory-tier-on-bases"],
)
def test_versions_stored_in_no_tier_are_warned_about_once_at_construction(
    tmp_path: Path, kw: dict[str, object]
) -> None:
    from tiercheck import SyncCheckpointer

    with pytest.warns(UserWarning, match="stored in no tier") as caught:
        SyncCheckpointer("job", local_root=tmp_path, rank=0, world_size=1, **kw)  # type: ignore[arg-type]
    assert len(caught) == 1
    assert caught[0].filename == __file__  # points at the caller's line


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"tiers": ["persistent"]},
        {"tiers": ["persistent"], "persist": "base", "base_every": 1},
        {"persist": "base"},
        {"persist": lambda v: False},
    ],
)
def test_no_warning_where_every_version_has_a_tier(tmp_path: Path, kw: dict[str, object]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_options("job", local_root=tmp_path, rank=0, world_size=1, **kw)  # type: ignore[arg-type]


def test_the_options_are_declared_once_and_both_faces_list_them_with_their_docs() -> None:
    import inspect
    import pydoc

    from tiercheck import Checkpointer, SyncCheckpointer

    # One constructor, inherited: the same signature for IDEs, mypy and help() on both faces.
    assert Checkpointer.__init__ is CheckpointerCore.__init__
    assert SyncCheckpointer.__init__ is CheckpointerCore.__init__
    params = inspect.signature(Checkpointer).parameters
    assert next(iter(params)) == "job_id"
    assert len(params) == 35
    assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "job_id")
    for face in (Checkpointer, SyncCheckpointer):
        text = pydoc.render_doc(face, renderer=pydoc.plaintext)
        signature, _, docs = text.partition(f"{face.__name__}(job_id: 'str', *, ")[2].partition(
            "\n"
        )
        for name in list(params)[1:]:
            assert f"{name}: " in signature, (face, name)
        args = docs.partition("Args:")[2]
        for name in params:
            assert f" {name}:" in args or f" {name}," in args, (face, name)

"""What a tier stores, read off the tier itself: helpers over a bare
:class:`~tiercheck.tiers.base.Tier`, below every part of the engine that holds one (the
pipeline, the claim, the timeline, the restorer), so that none of them imports another for them.
"""

from __future__ import annotations

import logging
from typing import Any

from tiercheck.consistency.abandoned import (
    ABANDONED_PREFIX,
    AbandonedSet,
    SetInfo,
    abandoned_key,
    parse_tag,
    set_record_key,
    tags_in,
)
from tiercheck.consistency.commit import CommitRecord
from tiercheck.consistency.keys import commit_key, parse_commit_key
from tiercheck.errors import ConfigError
from tiercheck.tiers.base import FailureScope, Tier, TierSetup
from tiercheck.tiers.registry import get_tier_class

__all__ = [
    "abandoned_sets",
    "build_tier",
    "commit_versions",
    "location",
    "writes_commit_records",
]

logger = logging.getLogger("tiercheck")


def build_tier(name: str, setup: TierSetup) -> Tier:
    """The tier registered under ``name``, built for this job (see :meth:`Tier.for_job`).

    Raises :class:`~tiercheck.errors.ConfigError` where the tier built is named otherwise, or
    survives another failure, than its class declares: the checkpointer's policy for it (what
    it keeps, whether it is durable) was decided from the class, under its name.
    """
    cls = get_tier_class(name)
    tier = cls.for_job(setup)
    if tier.name != name or tier.survives != cls.survives:
        built = f"name {tier.name!r}, survives {_scope(tier.survives)}"
        declared = f"name {name!r}, survives {_scope(cls.survives)}"
        raise ConfigError(
            f"{cls.__module__}.{cls.__qualname__}.for_job built a tier with {built}, but the "
            f"class declares {declared}; a tier built by name must be what its class declares "
            "(make for_job keep the class's name and survives, or construct the tier yourself "
            "and pass the instance in `tiers=[...]`)"
        )
    return tier


def _scope(survives: object) -> str:
    return survives.name if isinstance(survives, FailureScope) else repr(survives)


def writes_commit_records(tier: Tier) -> bool:
    """Whether ``tier`` outlives the cluster, so that its commits are proven by ``COMMIT``
    records in the tier itself rather than remembered in the nodes' manifests."""
    return tier.survives >= FailureScope.CLUSTER


async def commit_versions(tier: Tier) -> set[int]:
    """Versions with a ``COMMIT`` record in ``tier``."""
    found: set[int] = set()
    async for key in tier.list("v"):
        v = parse_commit_key(key)
        if v is not None:
            found.add(v)
    return found


async def abandoned_sets(tier: Tier) -> dict[str, SetInfo]:
    """The whole abandoned sets in ``tier`` (those with their ``SET`` record), with the versions
    each holds and the bases outside it its deltas need (see
    :mod:`tiercheck.consistency.abandoned`). A set whose records cannot be read is taken to
    hold every version from its first on and to need every older one: retention then keeps
    everything it might need."""
    keys = [key async for key in tier.list(ABANDONED_PREFIX)]
    out: dict[str, SetInfo] = {}
    for tag, inner in tags_in(keys).items():
        parsed = parse_tag(tag)
        if parsed is None or "SET" not in inner:
            continue
        first = parsed[0]
        try:
            record = AbandonedSet.from_bytes(bytes(await tier.get(set_record_key(tag))))
            versions = frozenset(record.versions)
            needs: set[int] = set()
            for version in versions:
                commit = CommitRecord.from_bytes(
                    bytes(await tier.get(abandoned_key(tag, commit_key(version))))
                )
                needs.update(
                    e.base for e in commit.entries if e.base is not None and e.base not in versions
                )
            out[tag] = SetInfo(first, versions, frozenset(needs))
        except Exception as exc:
            logger.warning(
                "tiercheck: the abandoned set %s in %r cannot be read (%r); retention keeps "
                "every version it might need",
                tag,
                tier.name,
                exc,
            )
            out[tag] = SetInfo(first, frozenset(range(first, first + 1)), frozenset(range(first)))
    return out


def location(tier: Tier) -> str:
    """Where a durable tier stores, as recorded in node identities."""
    inner: Any = tier
    while getattr(inner, "inner", None) is not None:  # wrappers (fault injection, ...)
        inner = inner.inner
    return str(getattr(inner, "url", None) or repr(inner))

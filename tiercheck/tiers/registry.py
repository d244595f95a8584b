"""Find tier classes by name: built-ins, entry-point plugins, and programmatic registrations.

A third-party package makes its tier available by declaring an entry point in the group
``tiercheck.tiers``::

    [project.entry-points."tiercheck.tiers"]
    mytier = "mypackage.tier:MyTier"

:func:`get_tier_class` then finds it by name. Entry points are collected once (without importing
anything); a plugin module is imported only when its name is first looked up, so a broken or
heavy plugin costs nothing until it is used. The built-in tiers resolve even where the package
metadata is missing (an uninstalled checkout).

Precedence: a programmatic :func:`register_tier` wins; otherwise the entry points and the
built-in table must agree on a name. Two different classes claimed under one name by different
distributions make the lookup fail with :class:`~tiercheck.errors.ConfigError` rather than
silently pick one; resolve it with ``register_tier(name, ..., replace=True)``.

A tier is registered under the name its class declares (:attr:`Tier.name
<tiercheck.tiers.Tier.name>`): a checkpointer configures a tier (``keep``, ``encodings``,
``policies``), builds it and reports it (``handle.result(name)``) under one name, so an entry
point ``mydict = "pkg:DictTier"`` whose ``DictTier.name`` is ``"dict"`` is refused, with a
:class:`~tiercheck.errors.ConfigError` that names the name to use (``register_tier`` refuses a
class at once, an entry point or a path when it is first looked up).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Final

from tiercheck.errors import ConfigError, PluginImportError, UnknownTier
from tiercheck.tiers.base import Tier

__all__ = [
    "ENTRY_POINT_GROUP",
    "available_tiers",
    "clear_cache",
    "get_tier_class",
    "register_tier",
    "unregister_tier",
]

#: The entry-point group third-party tiers register under.
ENTRY_POINT_GROUP: Final = "tiercheck.tiers"

_SELF: Final = "tiercheck"
# Where a registration made with register_tier() comes from, in place of a distribution.
_PROGRAMMATIC: Final = "register_tier()"

# The built-ins, for when the distribution's entry points cannot be read.
_BUILTIN: Final = {
    "local": "tiercheck.tiers.local:LocalTier",
    "persistent": "tiercheck.tiers.persistent:PersistentTier",
    "peer": "tiercheck.tiers.peer:PeerTier",
}


@dataclass(frozen=True, slots=True)
class _Spec:
    """Where a tier class comes from: ``module:attribute`` or the class itself."""

    name: str
    target: str
    distribution: str
    cls: type[Tier] | None = None


# Re-entrant: a plugin module may itself call register_tier while it is being imported.
_lock = threading.RLock()
_discovered: dict[str, list[_Spec]] | None = None
_registered: dict[str, _Spec] = {}
_loaded: dict[str, type[Tier]] = {}


def get_tier_class(name: str) -> type[Tier]:
    """The tier class registered under ``name``, importing its module on first use.

    Raises :class:`~tiercheck.errors.UnknownTier` (listing the known names) if there is none,
    :class:`~tiercheck.errors.PluginImportError` if its module fails to import or the object it
    names is not a :class:`~tiercheck.tiers.Tier` subclass, and
    :class:`~tiercheck.errors.ConfigError` if distributions disagree about the name or the class
    declares another name than the one it is registered under.
    """
    if not isinstance(name, str):
        raise UnknownTier(f"a tier name must be a str, got {type(name).__name__}")
    with _lock:
        cached = _loaded.get(name)
        if cached is not None:
            return cached
        spec = _resolve(name)
        cls = _load(spec)
        _check_declared_name(spec, cls)
        _loaded[name] = cls
        return cls


def available_tiers() -> list[str]:
    """Names of every known tier, sorted (built-in, entry points, registered). Imports nothing."""
    with _lock:
        return sorted(set(_BUILTIN) | set(_discover()) | set(_registered))


def register_tier(name: str, tier: type[Tier] | str, *, replace: bool = False) -> None:
    """Register a tier class, or a ``"module:Class"`` / ``"module.Class"`` path imported lazily.

    Raises :class:`~tiercheck.errors.ConfigError` if ``name`` is already known (built-in, entry
    point or registered) unless ``replace=True``, in which case the registration wins over them,
    and if ``name`` is not the name the class declares (:attr:`Tier.name
    <tiercheck.tiers.Tier.name>`; for a path, when it is first looked up).
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ConfigError(f"a tier name must be a non-empty str without outer spaces: {name!r}")
    if isinstance(tier, str):
        target = tier if ":" in tier else _dotted_to_target(tier)
        spec = _Spec(name, target, _PROGRAMMATIC)
    elif isinstance(tier, type) and issubclass(tier, Tier):
        spec = _Spec(name, f"{tier.__module__}:{tier.__qualname__}", _PROGRAMMATIC, tier)
        _check_declared_name(spec, tier)
    else:
        raise TypeError(
            f"register_tier needs a Tier subclass or a 'module:Class' path, got {tier!r}"
        )
    with _lock:
        if not replace and (name in _registered or name in _BUILTIN or name in _discover()):
            raise ConfigError(
                f"a tier named {name!r} is already registered; pass replace=True to override it"
            )
        _registered[name] = spec
        _loaded.pop(name, None)


def unregister_tier(name: str) -> None:
    """Undo :func:`register_tier` for ``name``; raises UnknownTier if it was not registered."""
    with _lock:
        if _registered.pop(name, None) is None:
            raise UnknownTier(f"no tier named {name!r} was registered with register_tier()")
        _loaded.pop(name, None)


def clear_cache() -> None:
    """Forget collected entry points and imported classes (registrations stay).

    The next lookup reads the installed distributions again, seeing packages installed since.
    """
    global _discovered
    with _lock:
        _discovered = None
        _loaded.clear()


def _dotted_to_target(path: str) -> str:
    module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ConfigError(f"not a 'module:Class' or 'module.Class' path: {path!r}")
    return f"{module}:{attr}"


def _discover() -> dict[str, list[_Spec]]:
    """Under the lock: the entry points of the group, by name (collected once)."""
    global _discovered
    if _discovered is None:
        found: dict[str, list[_Spec]] = {}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "an unknown distribution"
            target = f"{ep.module}:{ep.attr}"
            specs = found.setdefault(ep.name, [])
            # The same distribution may be visible twice (an editable install next to its
            # source checkout's metadata); identical claims are one claim.
            if all(s.target != target for s in specs):
                specs.append(_Spec(ep.name, target, dist))
        _discovered = found
    return _discovered


def _resolve(name: str) -> _Spec:
    """Under the lock: the one spec for ``name``, or a clear error."""
    registered = _registered.get(name)
    if registered is not None:
        return registered
    claims = list(_discover().get(name, []))
    builtin = _BUILTIN.get(name)
    if builtin is not None and all(s.target != builtin for s in claims):
        claims.append(_Spec(name, builtin, _SELF))
    if not claims:
        known = ", ".join(available_tiers()) or "none"
        raise UnknownTier(
            f"no tier named {name!r}; known tiers: {known}. A third-party tier must be installed "
            f"and declare an entry point in the group {ENTRY_POINT_GROUP!r}."
        )
    if len(claims) > 1:
        who = "; ".join(f"{s.distribution} ({s.target})" for s in claims)
        raise ConfigError(
            f"several distributions declare a tier named {name!r}: {who}. Uninstall one, or "
            "choose with register_tier(name, cls, replace=True)."
        )
    return claims[0]


def _check_declared_name(spec: _Spec, cls: type[Tier]) -> None:
    """Refuse a class registered under another name than the one it declares.

    A checkpointer looks a tier up by the name it is given, but configures, commits and reports
    the tier it built under that tier's own ``name``: two names would find no policy at opening.
    """
    declared = cls.name
    if declared == spec.name:
        return
    if spec.distribution == _PROGRAMMATIC:
        how = f"register it as register_tier({declared!r}, ...)"
    else:
        how = (
            f"declare its entry point under {declared!r} (in the pyproject.toml of "
            f'{spec.distribution!r}: [project.entry-points."{ENTRY_POINT_GROUP}"] '
            f'{declared} = "{spec.target}")'
        )
    raise ConfigError(
        f"the tier {spec.target} (from {spec.distribution}) is registered as {spec.name!r}, but "
        f"its class declares the name {declared!r}; a tier is configured, built and reported "
        f"under one name. To fix: {how}, or set `name = {spec.name!r}` on the class."
    )


def _load(spec: _Spec) -> type[Tier]:
    if spec.cls is not None:
        return spec.cls
    module_name, _, attr = spec.target.partition(":")
    install = (
        "the tiercheck installation looks incomplete; reinstall tiercheck"
        if spec.distribution == _SELF
        else f"install or repair the distribution {spec.distribution!r}"
    )
    try:
        obj: object = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        # A plugin's module may fail in any way while it runs; all of it means the same thing
        # to the caller, who gets the original error chained.
        raise PluginImportError(
            f"the tier {spec.name!r} ({spec.target}, from {spec.distribution}) could not be "
            f"imported: {type(exc).__name__}: {exc}. To fix: {install}."
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, Tier)):
        raise PluginImportError(
            f"the tier {spec.name!r} ({spec.target}, from {spec.distribution}) is {obj!r}, "
            f"not a subclass of tiercheck.tiers.Tier. To fix: {install}."
        )
    return obj

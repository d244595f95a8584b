"""The tier registry: built-ins, entry-point plugins (installed into tmp_path), registrations."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiercheck.errors import ConfigError, PluginImportError, UnknownTier
from tiercheck.testing import TierTests
from tiercheck.tiers import LocalTier, PersistentTier, Tier, registry
from tiercheck.tiers.registry import (
    available_tiers,
    clear_cache,
    get_tier_class,
    register_tier,
    unregister_tier,
)

from .dict_tier import DictTier

PLUGIN_MODULE = "tiercheck_test_plugin"


class _MineTier(DictTier):
    """The dict tier under a name of its own."""

    name = "mine"


class _LocalDictTier(DictTier):
    """The dict tier, named as the built-in local tier (to shadow it)."""

    name = "local"


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    """Every test starts and ends with a registry that has read nothing and registered nothing."""
    clear_cache()
    saved = dict(registry._registered)
    registry._registered.clear()
    yield
    registry._registered.clear()
    registry._registered.update(saved)
    clear_cache()


def install_distribution(
    site: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]
) -> None:
    """Write an installed distribution (``.dist-info`` + modules) into the folder ``site``."""
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[tiercheck.tiers]\n{lines}\n")
    for name, source in modules.items():
        (site / f"{name}.py").write_text(source)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on sys.path to install fake distributions into; their modules are unloaded after."""
    folder = tmp_path / "site-packages"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    before = set(sys.modules)
    yield folder
    for name in set(sys.modules) - before:
        if name.startswith(PLUGIN_MODULE):
            del sys.modules[name]


def plugin_source() -> str:
    """The dict tier's source, to be installed as a third party's module."""
    return (Path(__file__).parent / "dict_tier.py").read_text()


def test_builtin_tiers_resolve() -> None:
    """The built-in names give the built-in classes."""
    assert get_tier_class("local") is LocalTier
    assert get_tier_class("persistent") is PersistentTier


def test_available_tiers_lists_builtins_without_importing_plugins(site: Path) -> None:
    """available_tiers names built-ins and plugins, and imports no plugin module to do so."""
    install_distribution(
        site, "lazy-plugin", {"lazy": f"{PLUGIN_MODULE}:DictTier"}, {PLUGIN_MODULE: plugin_source()}
    )
    names = available_tiers()
    assert {"local", "persistent", "peer", "lazy"} <= set(names)
    assert names == sorted(names)
    assert PLUGIN_MODULE not in sys.modules


def test_unknown_name_raises_unknown_tier() -> None:
    """An unknown name raises UnknownTier, which is a LookupError."""
    with pytest.raises(UnknownTier) as info:
        get_tier_class("no-such-tier")
    assert isinstance(info.value, LookupError)


def test_non_str_name_raises_unknown_tier() -> None:
    """A name that is not a str is not a tier name."""
    with pytest.raises(UnknownTier):
        get_tier_class(42)  # type: ignore[arg-type]


async def test_third_party_tier_found_through_its_entry_point(site: Path) -> None:
    """A distribution's entry point is found, imported on first lookup, and its tier works."""
    install_distribution(
        site, "dict-plugin", {"dict": f"{PLUGIN_MODULE}:DictTier"}, {PLUGIN_MODULE: plugin_source()}
    )
    assert PLUGIN_MODULE not in sys.modules
    cls = get_tier_class("dict")
    assert PLUGIN_MODULE in sys.modules
    assert issubclass(cls, Tier)
    assert cls.__module__ == PLUGIN_MODULE
    assert get_tier_class("dict") is cls
    async with cls() as tier:
        await tier.put("v1/rank0", b"state")
        assert await tier.get("v1/rank0") == b"state"
        assert [key async for key in tier.list("v1/")] == ["v1/rank0"]
        await tier.delete("v1/rank0")
        assert not await tier.exists("v1/rank0")


def test_plugin_whose_module_fails_to_import(site: Path) -> None:
    """A plugin whose module raises on import gives PluginImportError with the cause chained."""
    install_distribution(
        site,
        "broken-plugin",
        {"broken": f"{PLUGIN_MODULE}_broken:Whatever"},
        {f"{PLUGIN_MODULE}_broken": "import a_module_that_is_not_installed_anywhere\n"},
    )
    with pytest.raises(PluginImportError) as info:
        get_tier_class("broken")
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_plugin_pointing_at_a_missing_module(site: Path) -> None:
    """An entry point naming a module that does not exist gives PluginImportError."""
    install_distribution(site, "ghost-plugin", {"ghost": "no_such_module_anywhere:Tier"}, {})
    with pytest.raises(PluginImportError):
        get_tier_class("ghost")


def test_plugin_that_is_not_a_tier(site: Path) -> None:
    """An entry point naming something other than a Tier subclass gives PluginImportError."""
    install_distribution(
        site,
        "odd-plugin",
        {"odd": f"{PLUGIN_MODULE}:NotATier", "odder": f"{PLUGIN_MODULE}:DictTier.name"},
        {PLUGIN_MODULE: plugin_source()},
    )
    with pytest.raises(PluginImportError):
        get_tier_class("odd")
    with pytest.raises(PluginImportError):
        get_tier_class("odder")


def test_two_distributions_claiming_one_name(site: Path) -> None:
    """Two distributions declaring different classes under one name is an error, not a guess."""
    source = plugin_source() + '\n\nclass TwinTier(DictTier):\n    name = "twin"\n'
    install_distribution(
        site, "first-plugin", {"twin": f"{PLUGIN_MODULE}:TwinTier"}, {PLUGIN_MODULE: source}
    )
    install_distribution(
        site,
        "second-plugin",
        {"twin": f"{PLUGIN_MODULE}_2:TwinTier"},
        {f"{PLUGIN_MODULE}_2": source},
    )
    with pytest.raises(ConfigError):
        get_tier_class("twin")
    register_tier("twin", f"{PLUGIN_MODULE}_2:TwinTier", replace=True)
    assert get_tier_class("twin").__module__ == f"{PLUGIN_MODULE}_2"


def test_builtins_resolve_without_package_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no entry points readable (an uninstalled checkout), built-ins still resolve."""
    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    clear_cache()
    assert get_tier_class("local") is LocalTier
    assert get_tier_class("persistent") is PersistentTier
    assert {"local", "peer", "persistent"} <= set(available_tiers())


def test_register_tier_class_and_path() -> None:
    """register_tier accepts a class or a lazily imported path; unregister_tier undoes it."""
    register_tier("dict", DictTier)
    assert get_tier_class("dict") is DictTier
    assert "dict" in available_tiers()
    for path in (f"{DictTier.__module__}.DictTier", f"{DictTier.__module__}:DictTier"):
        register_tier("dict", path, replace=True)
        assert get_tier_class("dict") is DictTier
    unregister_tier("dict")
    with pytest.raises(UnknownTier):
        get_tier_class("dict")
    with pytest.raises(UnknownTier):
        unregister_tier("dict")


def test_register_tier_refuses_to_shadow_without_replace() -> None:
    """Registering a known name needs replace=True; then the registration wins."""
    with pytest.raises(ConfigError, match="already registered"):
        register_tier("local", _LocalDictTier)
    register_tier("mine", _MineTier)
    with pytest.raises(ConfigError, match="already registered"):
        register_tier("mine", _MineTier)
    register_tier("local", _LocalDictTier, replace=True)
    assert get_tier_class("local") is _LocalDictTier
    unregister_tier("local")
    assert get_tier_class("local") is LocalTier


def test_a_class_registered_under_another_name_than_its_own_is_refused() -> None:
    """register_tier refuses a class under another name than it declares, and says which name
    to use; a path is refused likewise when it is first looked up."""
    with pytest.raises(ConfigError) as info:
        register_tier("mydict", DictTier)
    assert "register_tier('dict', ...)" in str(info.value)
    assert "name = 'mydict'" in str(info.value)
    assert "mydict" not in available_tiers()
    register_tier("mydict", f"{DictTier.__module__}:DictTier")
    with pytest.raises(ConfigError, match=r"register_tier\('dict', \.\.\.\)"):
        get_tier_class("mydict")
    # Refused every time, never cached as if it had resolved.
    with pytest.raises(ConfigError):
        get_tier_class("mydict")


def test_an_entry_point_under_another_name_than_its_class_is_refused(site: Path) -> None:
    """An entry point ``mydict = "pkg:DictTier"`` whose class is named "dict" is refused at
    lookup, with the entry-point line to write instead."""
    install_distribution(
        site,
        "misnamed-plugin",
        {"mydict": f"{PLUGIN_MODULE}:DictTier"},
        {PLUGIN_MODULE: plugin_source()},
    )
    assert "mydict" in available_tiers()  # listing imports nothing, so it cannot know yet
    with pytest.raises(ConfigError) as info:
        get_tier_class("mydict")
    message = str(info.value)
    assert "'misnamed-plugin'" in message
    assert f'dict = "{PLUGIN_MODULE}:DictTier"' in message
    assert "name = 'mydict'" in message


def test_register_tier_rejects_bad_arguments() -> None:
    """A non-Tier class is a TypeError; an empty name or a bare word path a ConfigError."""
    with pytest.raises(TypeError):
        register_tier("bad", int)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        register_tier("", DictTier)
    with pytest.raises(ConfigError):
        register_tier("bad", "justaword")


def test_registered_path_that_fails_to_import() -> None:
    """A registered path is imported at lookup; failing there gives PluginImportError."""
    register_tier("later", "no_such_module_anywhere.Tier")
    with pytest.raises(PluginImportError):
        get_tier_class("later")


def test_lazy_peer_attribute_of_the_tiers_package() -> None:
    """Unknown attributes of tiercheck.tiers raise AttributeError (PeerTier is resolved lazily)."""
    import tiercheck.tiers

    with pytest.raises(AttributeError):
        _ = tiercheck.tiers.NoSuchTier  # type: ignore[attr-defined]
    assert "PeerTier" in dir(tiercheck.tiers)


class TestPluginTierConformance(TierTests):
    """The conformance suite against the third-party dict tier, looked up by its entry point."""

    @pytest.fixture(autouse=True)
    def _install(self, site: Path) -> None:
        install_distribution(
            site,
            "dict-plugin",
            {"dict": f"{PLUGIN_MODULE}:DictTier"},
            {PLUGIN_MODULE: plugin_source()},
        )

    async def make_tier(self, tmp_path: Path) -> Tier:
        return get_tier_class("dict")()

    # The back door: the dict itself (a dict tier keeps nothing across instances: no reopen).
    async def raw_get(self, tier: Tier, key: str) -> bytes:
        blobs: dict[str, bytes] = tier.blobs  # type: ignore[attr-defined]
        try:
            return blobs[key]
        except KeyError:
            raise FileNotFoundError(key) from None

    async def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        tier.blobs[key] = bytes(data)  # type: ignore[attr-defined]


def test_plugin_module_source_is_importable_as_is() -> None:
    """The plugin source only uses public tiercheck names (so a third party could ship it)."""
    source = plugin_source()
    for line in source.splitlines():
        if line.startswith(("from tiercheck", "import tiercheck")):
            module = line.split()[1]
            assert module in {"tiercheck.errors", "tiercheck.tiers"}, textwrap.shorten(line, 80)

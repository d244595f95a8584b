"""The versioned stages of the codec, one small frozen dataclass each.

Every blob header lists the stages that produced it, in order, as ``[name, params]`` pairs with
names like ``"tiercheck.xor/1"``. The number after the slash is the stage's *major* version: a
reader refuses a stage it does not know, or a major version newer than its own, with
:class:`~tiercheck.errors.UnsupportedFormat`. A minor version (``"tiercheck.zstd/1.1"``) marks a
backwards-compatible addition and is accepted.

Order in a packed blob: ``flatten`` -> ``xor`` (deltas only) -> ``planes`` (optional) ->
``zstd`` (optional). A full blob has ``flatten`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from tiercheck.errors import FormatError, UnsupportedFormat

__all__ = [
    "FlattenStage",
    "PlanesStage",
    "Stage",
    "XorStage",
    "ZstdStage",
    "parse_stage",
]


class _Versioned:
    """What every stage has: a versioned name, ``BASE/MAJOR``, recorded in the header."""

    __slots__ = ()

    BASE: ClassVar[str]
    MAJOR: ClassVar[int]

    @property
    def name(self) -> str:
        """Versioned name recorded in the header."""
        return f"{self.BASE}/{self.MAJOR}"


class _Parameterless(_Versioned):
    """A stage that records no parameters: ``{}`` in the header, rebuilt from nothing."""

    __slots__ = ()

    def params(self) -> dict[str, Any]:
        """Parameters recorded in the header."""
        return {}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Self:
        """Rebuild from header parameters."""
        del params
        return cls()


@dataclass(frozen=True, slots=True)
class FlattenStage(_Parameterless):
    """``tiercheck.flatten/1``: msgpack skeleton + raw payload (see :mod:`.flatten`).

    ``tiercheck.flatten/2`` is the same format with one more skeleton extension, the DTensor
    record (:mod:`.dtensor`): blobs whose state holds a DTensor name it, so that a reader that
    predates DTensors refuses them as a newer format rather than calling them malformed. Every
    other blob still names ``/1``, byte for byte as before. ``tiercheck.flatten/3`` adds the
    replica reference (:class:`~.flatten.ReplicaRef`: replicated state another rank of the same
    save stores); only blobs holding one name it. This build reads all three.
    """

    major: int = 1

    BASE: ClassVar[str] = "tiercheck.flatten"
    MAJOR: ClassVar[int] = 3
    MAJORS: ClassVar[tuple[int, ...]] = (1, 2, 3)

    @classmethod
    def for_layout(cls, has_dtensors: bool, has_refs: bool = False) -> FlattenStage:
        """The stage that a blob of a layout (with or without DTensors, references) names."""
        return cls(3 if has_refs else 2 if has_dtensors else 1)

    @property
    def name(self) -> str:
        """Versioned name recorded in the header (this blob's major, not the newest)."""
        return f"{self.BASE}/{self.major}"

    @classmethod
    def from_params(cls, params: dict[str, Any], major: int = 1) -> Self:
        """Rebuild from header parameters."""
        del params
        return cls(major)


@dataclass(frozen=True, slots=True)
class XorStage(_Versioned):
    """``tiercheck.xor/1``: each tensor XORed bitwise with the same tensor of a base version.

    Records the base (its version and raw digest) that decoding needs.
    """

    base_version: int
    base_digest: int

    BASE: ClassVar[str] = "tiercheck.xor"
    MAJOR: ClassVar[int] = 1

    def params(self) -> dict[str, Any]:
        """Parameters recorded in the header."""
        return {"base_version": self.base_version, "base_digest": self.base_digest}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> XorStage:
        """Rebuild from header parameters."""
        version, digest = params.get("base_version"), params.get("base_digest")
        if type(version) is not int or type(digest) is not int:
            raise FormatError(f"bad tiercheck.xor parameters {params!r}")
        return cls(version, digest)


@dataclass(frozen=True, slots=True)
class PlanesStage(_Parameterless):
    """``tiercheck.planes/1``: elements split into byte planes (plane j = byte j of each element).

    The plane count of a tensor is its element size; the order of bytes is memory order, which
    is little-endian on every platform torch supports.
    """

    BASE: ClassVar[str] = "tiercheck.planes"
    MAJOR: ClassVar[int] = 1


@dataclass(frozen=True, slots=True)
class ZstdStage(_Versioned):
    """``tiercheck.zstd/1``: each plane zstd-compressed where a sample shows it pays, else raw.

    ``level`` and ``tuned`` (see :func:`~tiercheck.codec.resources.zstd_parameters`) are recorded
    for the record; decoding needs neither.
    """

    level: int
    tuned: bool = False

    BASE: ClassVar[str] = "tiercheck.zstd"
    MAJOR: ClassVar[int] = 1

    def params(self) -> dict[str, Any]:
        """Parameters recorded in the header."""
        return {"level": self.level, "tuned": self.tuned}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> ZstdStage:
        """Rebuild from header parameters."""
        level, tuned = params.get("level"), params.get("tuned", False)
        if type(level) is not int or type(tuned) is not bool:
            raise FormatError(f"bad tiercheck.zstd parameters {params!r}")
        return cls(level, tuned)


Stage = FlattenStage | XorStage | PlanesStage | ZstdStage

_KNOWN: dict[str, type[FlattenStage | XorStage | PlanesStage | ZstdStage]] = {
    cls.BASE: cls for cls in (FlattenStage, XorStage, PlanesStage, ZstdStage)
}


def parse_stage(name: object, params: object) -> Stage:
    """The stage recorded as ``name`` with ``params``; refuses unknown stages and versions."""
    if type(name) is not str or "/" not in name or not isinstance(params, dict):
        raise FormatError(f"malformed stage entry {name!r}")
    base, _, version = name.rpartition("/")
    major_text = version.split(".", 1)[0]
    if not major_text.isdigit():
        raise FormatError(f"malformed stage version in {name!r}")
    cls = _KNOWN.get(base)
    if cls is None:
        raise UnsupportedFormat(
            f"blob needs codec stage {name!r}, which this build of tiercheck does not know; "
            "upgrade tiercheck to read it"
        )
    if cls is FlattenStage:
        if int(major_text) not in FlattenStage.MAJORS:
            raise UnsupportedFormat(
                f"blob needs codec stage {name!r}; this build reads {base}/1 to "
                f"{base}/{FlattenStage.MAJOR} only. Use the tiercheck version that wrote it "
                "(or a newer one)."
            )
        return FlattenStage.from_params(params, int(major_text))
    if int(major_text) != cls.MAJOR:
        raise UnsupportedFormat(
            f"blob needs codec stage {name!r}; this build reads {base}/{cls.MAJOR} only. "
            "Use the tiercheck version that wrote it (or a newer one)."
        )
    return cls.from_params(params)

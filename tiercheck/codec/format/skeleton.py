"""The skeleton format (stage ``tiercheck.flatten``): its tags, and the one walk over it.

A blob's *skeleton* is the state with every tensor taken out: one msgpack object, in which
``None``, ``bool``, ``int`` (64-bit), ``float``, ``str``, ``bytes``, ``list`` and ``dict``
stand for themselves and everything else is a msgpack extension whose code -- a *tag*, the
``EXT_*`` constants below -- says what its data holds.
:func:`~tiercheck.codec.encode.flatten.flatten` and the cached plan
(:mod:`~tiercheck.codec.encode.plan`) write skeletons; everything that reads one goes through this
module:

* :func:`unpack` is *the* decoding of skeleton bytes (the format's msgpack options), given an
  extension hook: :func:`~tiercheck.codec.decode.rebuild.unflatten` turns every tag back into its
  object with it, :func:`ext_codes` lists the tags a skeleton holds.
* :func:`read_tree` gives the *tree* of a skeleton: containers opened (``list``, ``dict``,
  :class:`Tuple`, :class:`ODict`), DTensor records opened (:class:`DTensorNode`), every other
  extension kept as its exact bytes. :class:`Walker` is the one traversal of such a tree,
  which :mod:`~tiercheck.codec.replica` (resolving and making references) and
  :mod:`~tiercheck.codec.reshard.reshard` (via :func:`leaves`) parametrize; :func:`write_tree` packs
  a tree back, byte for byte what the writer made of it. :func:`child` and :func:`where` follow and
  name a path of steps; :func:`differences` compares two trees.

The tags are part of the format: never renumber one; a new tag comes only with a new stage
version (a reader of the old version refuses a skeleton holding it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import msgpack

from tiercheck.errors import FormatError

__all__ = [
    "EXT_BIGINT",
    "EXT_BYTEARRAY",
    "EXT_COMPLEX",
    "EXT_DEVICE",
    "EXT_DTENSOR",
    "EXT_DTYPE",
    "EXT_NDARRAY",
    "EXT_ODICT",
    "EXT_PICKLE",
    "EXT_REPLICA",
    "EXT_SIZE",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "INT_MAX",
    "INT_MIN",
    "META",
    "MISSING",
    "DTensorNode",
    "ODict",
    "Tuple",
    "Walker",
    "child",
    "differences",
    "encode_int",
    "ext",
    "ext_codes",
    "leaves",
    "pack",
    "read_tree",
    "unpack",
    "where",
    "write_tree",
]

# --- the tags --------------------------------------------------------------------------------

# : A tensor: data is a msgpack int, the index of its
# :class:`~tiercheck.codec.encode.flatten.TensorSpec`
#: in the layout (the tensor's bytes are in the payload).
EXT_TENSOR = 1
#: A ``tuple``: data is a msgpack array of its items (each a skeleton value).
EXT_TUPLE = 2
#: A ``collections.OrderedDict``: data is ``[mapping, metadata]``, ``metadata`` being its
#: ``_metadata`` attribute (what ``Module.state_dict()`` sets) or ``None``.
EXT_ODICT = 3
#: A ``torch.Size``: data is a msgpack array of ints.
EXT_SIZE = 4
#: An ``int`` outside ``[INT_MIN, INT_MAX]``: data is its two's complement, little-endian, in
#: ``bit_length() // 8 + 1`` bytes.
EXT_BIGINT = 5
#: A numpy array or scalar: data is ``[tensor index, numpy dtype string or None, shape,
#: scalar]``; the tensor holds its elements (``None``: a dtype torch has) or its raw bytes.
EXT_NDARRAY = 6
#: A ``complex``: data is 16 bytes, the real then the imaginary part as little-endian float64.
EXT_COMPLEX = 7
#: A ``torch.dtype``: data is its name without ``torch.`` (``b"bfloat16"``), UTF-8.
EXT_DTYPE = 8
#: A ``torch.device``: data is ``str(device)`` (``b"cuda:1"``), UTF-8.
EXT_DEVICE = 9
#: A ``bytearray``: data is its bytes.
EXT_BYTEARRAY = 10
#: A pickled object (written only with ``allow_pickle=True``): data is the pickle.
EXT_PICKLE = 11
#: A DTensor's local shard (added with ``tiercheck.flatten/2``): data is ``[tensor index,
#: layout record]`` (see :mod:`~tiercheck.codec.format.dtensor`).
EXT_DTENSOR = 12
#: A :class:`~tiercheck.codec.encode.flatten.ReplicaRef` (added with ``tiercheck.flatten/3``): data
#: is ``[rank, record]``, the rank of the same save whose blob stores the value, and for a
#: DTensor placed ``Replicate()`` everywhere this rank's own layout record (else ``None``).
EXT_REPLICA = 13

#: The ints a skeleton holds as msgpack ints; others are :data:`EXT_BIGINT`.
INT_MIN = -(1 << 63)
INT_MAX = (1 << 64) - 1


# --- bytes -----------------------------------------------------------------------------------


def pack(obj: Any) -> bytes:
    """``obj`` (skeleton values and :class:`msgpack.ExtType`) as skeleton bytes."""
    data = msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogatepass")
    assert isinstance(data, bytes)
    return data


def ext(code: int, data: bytes) -> bytes:
    """The skeleton bytes of one extension: tag ``code`` holding ``data``."""
    return pack(msgpack.ExtType(code, data))


def encode_int(value: int) -> Any:
    """How the skeleton holds the int ``value``: itself, or :data:`EXT_BIGINT` beyond 64 bits."""
    if INT_MIN <= value <= INT_MAX:
        return value
    return msgpack.ExtType(
        EXT_BIGINT, value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    )


def unpack(data: bytes, ext_hook: Callable[[int, bytes], Any], *, raw: bool = False) -> Any:
    """Decode skeleton bytes, each extension through ``ext_hook(tag, data)``.

    The format's msgpack options: lists for arrays, any key type, strings that are not valid
    UTF-8 kept (``surrogatepass``) -- or left as bytes with ``raw=True``. A hook that opens a
    container tag decodes its data with this function in turn.
    """
    return msgpack.unpackb(
        data,
        ext_hook=ext_hook,
        strict_map_key=False,
        raw=raw,
        use_list=True,
        unicode_errors="surrogatepass",
    )


def ext_codes(skeleton: bytes) -> frozenset[int]:
    """The tags a skeleton holds, containers opened (empty when it is malformed)."""
    found: set[int] = set()

    def hook(code: int, data: bytes) -> None:
        found.add(code)
        if code in (EXT_TUPLE, EXT_ODICT):
            unpack(data, hook, raw=True)

    try:
        unpack(skeleton, hook, raw=True)
    except (msgpack.UnpackException, ValueError, TypeError):
        return frozenset()
    return frozenset(found)


# --- the tree --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tuple:
    """A tuple of the skeleton (kept apart from lists, and hashable for dict keys)."""

    items: tuple[Any, ...]

    def __repr__(self) -> str:
        return repr(self.items)


@dataclasses.dataclass(frozen=True)
class ODict:
    """An ``OrderedDict`` of the skeleton (its mapping and ``_metadata``)."""

    mapping: Any
    meta: Any


@dataclasses.dataclass(frozen=True)
class DTensorNode:
    """A DTensor record of the skeleton: the index of its local tensor and the record."""

    index: int
    record: dict[str, Any]


def _tree_hook(code: int, data: bytes) -> Any:
    # Only the containers (which may hold DTensors) and DTensor records are opened; every
    # other extension (tensor references, big ints, dtypes...) stays as its exact bytes.
    if code == EXT_TUPLE:
        return Tuple(tuple(read_tree(data)))
    if code == EXT_ODICT:
        mapping, meta = read_tree(data)
        return ODict(mapping, meta)
    if code == EXT_DTENSOR:
        index, record = read_tree(data)
        if type(index) is not int or type(record) is not dict:
            raise FormatError(f"skeleton holds a malformed DTensor record {record!r}")
        return DTensorNode(index, record)
    return msgpack.ExtType(code, data)


def read_tree(skeleton: bytes) -> Any:
    """The tree of skeleton bytes (see the module docstring); msgpack's errors propagate."""
    return unpack(skeleton, _tree_hook)


def write_tree(tree: Any, dtensor: Callable[[DTensorNode], Any] | None = None) -> bytes:
    """The skeleton bytes of a tree from :func:`read_tree`, each DTensor record replaced by
    ``dtensor(record)`` when given (packed as a DTensor extension when that returns a
    :class:`DTensorNode`, as the value it is otherwise)."""

    def default(value: Any) -> Any:
        if type(value) is Tuple:
            return msgpack.ExtType(EXT_TUPLE, write_tree(list(value.items), dtensor))
        if type(value) is ODict:
            return msgpack.ExtType(EXT_ODICT, write_tree([value.mapping, value.meta], dtensor))
        if type(value) is DTensorNode:
            new = value if dtensor is None else dtensor(value)
            if type(new) is DTensorNode:
                return msgpack.ExtType(EXT_DTENSOR, write_tree([new.index, new.record], dtensor))
            return new
        raise TypeError(f"cannot pack {type(value).__name__}")

    data = msgpack.packb(tree, default=default, use_bin_type=True, unicode_errors="surrogatepass")
    assert isinstance(data, bytes)
    return data


#: The step into an :class:`ODict`'s ``_metadata`` (in the ``steps`` of :class:`Walker`).
META = object()
#: What :func:`child` returns for a step the node does not have.
MISSING = object()

C = TypeVar("C")


class Walker(Generic[C]):
    """The one traversal of a skeleton tree: depth first, in skeleton order, rebuilding it.

    :meth:`walk` enters the containers -- a ``dict`` (each value under its key), a ``list`` or
    :class:`Tuple` (each item under its index), an :class:`ODict` (its mapping, then its
    metadata under :data:`META`) -- and hands every other node to :meth:`leaf`; what they
    return is the new tree. ``steps`` is the path of the current node from the root (pushed
    and popped on the way); ``ctx`` travels down unchanged, for a walker whose subtrees belong
    to different owners (the rank whose tree it is, for :mod:`~tiercheck.codec.replica`).

    Parametrize by subclassing: :meth:`leaf` says what becomes of a leaf (a
    :class:`DTensorNode`, a :class:`msgpack.ExtType`, a plain value); overriding :meth:`walk`
    intercepts any node before it is entered (call ``super().walk`` to go on). With
    :attr:`walk_keys`, dict keys are walked too, each before its value.
    """

    #: Whether dict keys go through :meth:`walk` (they never hold tensors or references).
    walk_keys = False
    #: Whether :meth:`walk` builds the new tree (``False``: it only visits, and returns
    #: ``None`` for every container).
    rebuild = True

    def walk(self, node: Any, steps: list[Any], ctx: C) -> Any:
        """``node`` (at ``steps``) with its containers entered and its leaves replaced."""
        t = type(node)
        if t is not dict and t is not list and t is not Tuple and t is not ODict:
            return self.leaf(node, steps, ctx)
        # Bound once per container: these run once per node of trees of 100,000 nodes.
        walk, push, pop, rebuild = self.walk, steps.append, steps.pop, self.rebuild
        if t is dict:
            keys = self.walk_keys
            out: dict[Any, Any] | None = {} if rebuild else None
            for k, v in node.items():
                key = walk(k, steps, ctx) if keys else k
                push(k)
                value = walk(v, steps, ctx)
                pop()
                if out is not None:
                    out[key] = value
            return out
        if t is ODict:
            mapping = walk(node.mapping, steps, ctx)
            push(META)
            meta = walk(node.meta, steps, ctx)
            pop()
            return ODict(mapping, meta) if rebuild else None
        items = []
        for i, v in enumerate(node if t is list else node.items):
            push(i)
            items.append(walk(v, steps, ctx))
            pop()
        if not rebuild:
            return None
        return items if t is list else Tuple(tuple(items))

    def leaf(self, node: Any, steps: list[Any], ctx: C) -> Any:
        """What becomes of a leaf of the tree (kept as it is unless overridden)."""
        return node


class _Collect(Walker[None]):
    walk_keys = True
    rebuild = False

    def __init__(self, keep: Callable[[Any], bool]) -> None:
        self.keep = keep
        self.found: list[Any] = []

    def leaf(self, node: Any, steps: list[Any], ctx: None) -> Any:
        if self.keep(node):
            self.found.append(node)
        return node


def leaves(tree: Any, keep: Callable[[Any], bool]) -> list[Any]:
    """The leaves of ``tree`` (nodes other than containers) that ``keep`` accepts, in skeleton
    order, dict keys included."""
    collect = _Collect(keep)
    collect.walk(tree, [], None)
    return collect.found


def child(node: Any, step: Any) -> Any:
    """The node at ``step`` (a key, an index or :data:`META`) under ``node``, or
    :data:`MISSING`."""
    t = type(node)
    if step is META:
        return node.meta if t is ODict else MISSING
    if t is ODict:
        node, t = node.mapping, dict
    if t is dict:
        return node.get(step, MISSING) if _hashable(step) else MISSING
    if t is list or t is Tuple:
        items = node if t is list else node.items
        return items[step] if type(step) is int and 0 <= step < len(items) else MISSING
    return MISSING


def _hashable(obj: Any) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


def where(steps: Sequence[Any]) -> str:
    """A path of steps as the user reads it: ``state['model']['w']``."""
    return "state" + "".join("._metadata" if s is META else f"[{s!r}]" for s in steps)


def differences(a: Any, b: Any) -> list[str]:
    """The paths where trees ``a`` and ``b`` differ (DTensor records are compared by their
    local tensor's index only: their records are checked on their own)."""
    out: list[str] = []
    _differences(a, b, "", out)
    return out


def _differences(a: Any, b: Any, path: str, out: list[str]) -> None:
    ta, tb = type(a), type(b)
    if ta is not tb:
        out.append(path or "the state")
    elif ta is dict:
        if list(a) != list(b):
            only_a = [k for k in a if k not in b]
            only_b = [k for k in b if k not in a]
            at = path or "the state"
            if only_a or only_b:
                out.append(f"{at} (keys {only_a} against {only_b})")
                return
            # Taking old rank 0's would be harmless, but "the same on every rank" is the rule.
            out.append(f"{at} (the same keys in another order)")
        for k in a:
            _differences(a[k], b[k], f"{path}[{k!r}]", out)
    elif ta is list or ta is Tuple:
        items_a, items_b = (a, b) if ta is list else (a.items, b.items)
        if len(items_a) != len(items_b):
            out.append(f"{path} (length {len(items_a)} against {len(items_b)})")
            return
        for i, (x, y) in enumerate(zip(items_a, items_b, strict=True)):
            _differences(x, y, f"{path}[{i}]", out)
    elif ta is ODict:
        _differences(a.mapping, b.mapping, path, out)
        _differences(a.meta, b.meta, f"{path}._metadata", out)
    elif ta is DTensorNode:
        if a.index != b.index:
            out.append(path)
    elif write_tree(a) != write_tree(b):
        # Leaves compare by their packed bytes: exact for floats (NaN, -0.0) and extensions.
        out.append(path)

"""The state tree: restore a decoded state into live objects in place, and copy it out.

A decoded state (:meth:`~tiercheck.codec.RawState.state`, :func:`~tiercheck.codec.unflatten`)
is a tree of containers whose tensors are views into one payload buffer. This module works on
such trees once the codec has rebuilt them; it knows nothing of blobs or of the payload format.

* :func:`check_into` lists every reason why a decoded state cannot be restored into a live one
  (shapes, dtypes, keys, lengths), modifying neither;
* :func:`load_into` restores it in place after that check found nothing (else
  :class:`~tiercheck.errors.StateMismatch`, and nothing is written), so modules and optimizers
  keep their references, and tensors that alias each other in the target stay aliased;
* :func:`own_copy` copies every tensor and array out of the payload it views;
* :class:`Lenient` stands for a ``Stateful`` object's current ``state_dict()`` as a target.

Layering: this module may import the codec (it reads :class:`~tiercheck.codec.DTensorShard`);
the codec never imports it.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tiercheck.codec.format.containers import MAPPINGS
from tiercheck.codec.format.dtensor import DTensorShard, is_dtensor
from tiercheck.codec.format.layout import TensorSpec
from tiercheck.errors import StateMismatch

__all__ = ["Lenient", "check_into", "copy_all", "load_into", "own_copy", "pair_into"]

#: At most this many mismatch lines go into a :class:`~tiercheck.errors.StateMismatch` message.
_MAX_MISMATCH_LINES = 50


class Lenient:
    """The restore target standing for a ``Stateful`` object: its current ``state_dict()``.

    :func:`check_into` compares the version with ``template`` allowing keys that only one side
    holds (a fresh optimizer has no state yet), and reports a version that lacks the entry
    altogether; :func:`load_into` fills ``template`` in place and returns it, for the caller to
    hand to ``owner.load_state_dict`` (see :mod:`tiercheck.engine.stateful`).
    """

    __slots__ = ("owner", "template")

    def __init__(self, owner: Any, template: Any) -> None:
        self.owner = owner
        self.template = template


def _kind(obj: Any) -> str:
    """The structural kind of ``obj``: ``tensor``, ``dtensor`` (a live DTensor or a stored
    one), ``array``, ``mapping``, ``list``, ``tuple``, ``stateful`` (a
    :class:`Lenient` target), or ``leaf`` (a value, replaced whole by a restore)."""
    t = type(obj)
    if t is DTensorShard:
        return "dtensor"
    if t is TensorSpec:
        return "tensor"
    if isinstance(obj, torch.Tensor):
        return "tensor" if t in _PLAIN_TENSORS or not is_dtensor(obj) else "dtensor"
    if t is Lenient:
        return "stateful"
    if t is np.ndarray:
        return "array"
    if t in MAPPINGS:
        return "mapping"
    if t is list:
        return "list"
    if t is tuple:
        return "tuple"
    return "leaf"


def _an(word: str) -> str:
    return f"an {word}" if word[:1].lower() in "aeiou" else f"a {word}"


def _items(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _typed_shape(obj: torch.Tensor | TensorSpec | np.ndarray[Any, Any]) -> str:
    if isinstance(obj, (torch.Tensor, TensorSpec)):
        return f"{str(obj.dtype).removeprefix('torch.')}{tuple(obj.shape)}"
    return f"{obj.dtype}{tuple(obj.shape)}"


def _describe(obj: Any) -> str:
    """``obj`` in a few words, for a mismatch line."""
    kind = _kind(obj)
    if kind == "tensor":
        return f"a tensor {_typed_shape(obj)}"
    if kind == "dtensor":
        if type(obj) is DTensorShard:
            return obj.describe()
        return f"a DTensor {_typed_shape(obj)} placed {tuple(obj.placements)}"
    if kind == "stateful":
        return f"a Stateful {type(obj.owner).__qualname__}"
    if kind == "array":
        return f"a numpy array {_typed_shape(obj)}"
    if kind == "mapping":
        return f"{_an(type(obj).__name__)} of {_items(len(obj), 'key')}"
    if kind in ("list", "tuple"):
        return f"a {kind} of {_items(len(obj), 'item')}"
    if obj is None:
        return "None"
    return _an(f"{type(obj).__qualname__} value")


# A path in the state as nested pairs ``(parent, key)`` (``()`` is the root), formatted only
# when a mismatch is reported: building a string per visited node would cost more than the
# check itself in a state of thousands of tensors.
_Path = tuple[Any, ...]


def _where(path: _Path) -> str:
    keys = []
    while path:
        path, key = path
        keys.append(f"[{key!r}]")
    return "state" + "".join(reversed(keys))


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
#: What a version's tensor may be in a rebuilt state: a tensor (its bytes, or on the ``meta``
#: device its structure alone) or the layout's :class:`TensorSpec` (its structure, where the
#: bytes are read straight into the target later: no tensor is made for it).
_SOURCE_TENSORS = (torch.Tensor, TensorSpec)
_IS_CPU = operator.attrgetter("is_cpu")


def _meta_target(path: _Path, target: Any) -> str:
    # Copying into a tensor on the meta device does nothing: a restore would seem to work and
    # leave the model without its values.
    return (
        f"{_where(path)}: the target is a tensor on the meta device {_typed_shape(target)}, "
        "which holds no data and cannot receive the version's; materialize it first "
        "(module.to_empty(device=...))"
    )


def _check(target: Any, source: Any, path: _Path, strict: bool, out: list[str]) -> None:
    if type(source) in _SOURCE_TENSORS and type(target) in _PLAIN_TENSORS:
        # The common case, first (a restored tensor into a live one): same test as below.
        if target.shape != source.shape or target.dtype != source.dtype:
            out.append(
                f"{_where(path)}: the target holds {_typed_shape(target)}, "
                f"the version {_typed_shape(source)}"
            )
        elif target.is_meta:
            out.append(_meta_target(path, target))
        elif target.is_inference() and not torch.is_inference_mode_enabled():
            out.append(
                f"{_where(path)}: the target holds an inference tensor "
                f"{_typed_shape(target)}, which cannot be written outside "
                "torch.inference_mode()"
            )
        return
    tk, sk = _kind(target), _kind(source)
    if tk == "stateful":
        # A Stateful object's current state_dict(): a fresh object (an optimizer before its
        # first step) lacks entries the version holds, so keys only one side holds are fine;
        # its load_state_dict() judges what it is given.
        _check(target.template, source, path, False, out)
        return
    if tk != sk:
        # Two values of different types are not structure: the version's value replaces the
        # target's. Anything else (a tensor where the version holds an int...) is.
        if tk != "leaf" or sk != "leaf":
            out.append(
                f"{_where(path)}: the target holds {_describe(target)}, "
                f"the version {_describe(source)}"
            )
        return
    if tk == "tensor":
        # The device is not compared: copying across devices is how a restore reaches a GPU.
        if target.shape != source.shape or target.dtype != source.dtype:
            out.append(
                f"{_where(path)}: the target holds {_typed_shape(target)}, "
                f"the version {_typed_shape(source)}"
            )
        elif target.is_meta:
            out.append(_meta_target(path, target))
        elif target.is_inference() and not torch.is_inference_mode_enabled():
            out.append(
                f"{_where(path)}: the target holds an inference tensor "
                f"{_typed_shape(target)}, which cannot be written outside "
                "torch.inference_mode()"
            )
    elif tk == "dtensor":
        if type(target) is DTensorShard or type(source) is not DTensorShard:
            out.append(
                f"{_where(path)}: the target holds {_describe(target)}, "
                f"the version {_describe(source)}"
            )
            return
        differences = source.differences(target)
        if differences:
            out.append(
                f"{_where(path)}: the target's DTensor differs from the version's: "
                + "; ".join(differences)
                + " (the target's value first)"
            )
        elif target.device.type == "meta":
            out.append(_meta_target(path, target))
    elif tk == "array":
        if target.shape != source.shape or target.dtype != source.dtype:
            out.append(
                f"{_where(path)}: the target holds {_typed_shape(target)}, "
                f"the version {_typed_shape(source)}"
            )
        elif not target.flags.writeable and not np.shares_memory(target, source):
            out.append(
                f"{_where(path)}: the target holds a read-only numpy array {_typed_shape(target)}, "
                "which cannot be restored in place"
            )
    elif tk == "mapping":
        for key, value in source.items():
            if key in target:
                t = target[key]
                if (
                    type(value) in _SOURCE_TENSORS
                    and type(t) in _PLAIN_TENSORS
                    and t.shape == value.shape
                    and t.dtype == value.dtype
                    and not t.is_meta
                    and not t.is_inference()
                ):
                    continue  # the common case, that fits, without a call (a state of 100,000)
                _check(t, value, (path, key), strict, out)
            elif strict:
                out.append(f"{_where(path)}: the version holds key {key!r} that the target lacks")
        out.extend(
            f"{_where(path)}: the target holds a Stateful at key {key!r} that the version lacks "
            "(nothing to load into it)"
            for key, value in target.items()
            if not strict and type(value) is Lenient and key not in source
        )
        if strict:
            out.extend(
                f"{_where(path)}: the target holds key {key!r} that the version lacks"
                for key in target
                if key not in source
            )
    elif tk in ("list", "tuple"):
        if len(target) != len(source):
            out.append(
                f"{_where(path)}: the target holds {_describe(target)}, "
                f"the version {_describe(source)}"
            )
            return
        for i, (t, s) in enumerate(zip(target, source, strict=True)):
            _check(t, s, (path, i), strict, out)


def check_into(target: Any, source: Any, *, strict: bool = True) -> list[str]:
    """Every reason why ``source`` cannot be restored into ``target`` in place; ``[]`` if none.

    Walks both objects together and modifies neither. Each line names a path in the subscript
    style of :func:`flatten` and says what the target holds and what the version (``source``)
    holds, e.g. ``state['model']['0.weight']: the target holds float32(8, 8), the version
    float32(4, 4)``. Modelled on ``torch.nn.Module.load_state_dict(strict=...)``; a mismatch is:

    * two tensors of different shape or dtype (the device may differ: the copy crosses it), a
      target on the ``meta`` device (it holds no data: the copy would do nothing), or a target
      that is an inference tensor outside ``torch.inference_mode()``;
    * two numpy arrays of different shape or dtype, or a target array that is read-only;
    * a tensor, numpy array or container on one side and anything else on the other, or
      containers of different types. ``dict`` and ``OrderedDict`` are both mappings and match
      each other (a ``Module.state_dict()`` is an ``OrderedDict``; a plain ``dict`` target for
      it is fine). Subclasses (a ``defaultdict``) are not containers here;
    * lists or tuples of different lengths (``strict`` or not);
    * with ``strict=True``, a key in only one of two mappings, either way round. With
      ``strict=False`` such keys are allowed (:func:`load_into` adds the version's and keeps the
      target's), but the entries the two have in common must still match.

    Other values (numbers, strings, ``None``, ``torch.Size``...) are values, not structure: the
    version's replaces the target's whatever the two types, so they never mismatch each other.
    """
    out: list[str] = []
    _check(target, source, (), strict, out)
    return out


#: Targets and, in the same order, what each is filled from: a tensor, or a layout's
#: :class:`TensorSpec` where the bytes are read into the target later (:func:`pair_into`).
_Copies = tuple[list[torch.Tensor], list[Any]]


def _apply(
    target: Any, source: Any, copies: _Copies, own: Callable[[Any], Any] | None = None
) -> Any:
    """Restore ``source`` into ``target``, which :func:`check_into` found compatible.

    Tensor copies are not made here but listed in ``copies`` (targets, sources), in the order
    of the walk, for :func:`copy_all` to make in few calls. ``own(value)`` makes what a key
    only the version holds becomes in the target (default :func:`own_copy`).
    """
    if type(target) in _PLAIN_TENSORS and type(source) in _SOURCE_TENSORS:
        copies[0].append(target)
        copies[1].append(source)
        return target
    kind = _kind(target)
    if kind == "tensor" and isinstance(source, _SOURCE_TENSORS):
        copies[0].append(target)
        copies[1].append(source)
        return target
    if kind == "dtensor" and type(source) is DTensorShard:
        with torch.no_grad():
            copies[0].append(target.to_local())
        copies[1].append(source.local)
        return target
    if kind == "stateful":
        target.template = _apply(target.template, source, copies, own)
        return target.template
    if kind == "array" and type(source) is np.ndarray:
        if np.shares_memory(target, source):
            return source
        np.copyto(target, source)
        return target
    if kind == "mapping":
        for key, value in source.items():
            if key in target:
                t = target[key]
                if type(t) in _PLAIN_TENSORS and type(value) in _SOURCE_TENSORS:
                    copies[0].append(t)  # the common case without a call
                    copies[1].append(value)
                    continue
                merged = _apply(t, value, copies, own)
                if merged is not t:
                    target[key] = merged
            else:
                # A key only the version holds (strict=False): the target gets a copy of its
                # own, not views into the version's buffer, which may be reused later.
                target[key] = own_copy(value) if own is None else own(value)
        order = list(source) + [k for k in target if k not in source]
        if list(target) != order:
            items = [(k, target[k]) for k in order]
            target.clear()
            target.update(items)
        return target
    if kind == "list":
        for i, value in enumerate(source):
            merged = _apply(target[i], value, copies, own)
            if merged is not target[i]:
                target[i] = merged
        return target
    if kind == "tuple":
        merged_items = tuple(_apply(t, s, copies, own) for t, s in zip(target, source, strict=True))
        if all(m is t for m, t in zip(merged_items, target, strict=True)):
            return target
        return merged_items
    return source


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``target.copy_(source)`` for each pair, in order, in one call per pair of devices."""
    if not targets:
        return
    with torch.no_grad():
        if any(map(torch.Tensor.is_conj, targets)) or any(map(torch.Tensor.is_neg, targets)):
            # torch's foreach copy refuses conjugate and negative views among its targets
            # (a complex parameter's .conj()): one call each, still in order.
            for target, source in zip(targets, sources, strict=True):
                target.copy_(source)
            return
        if False not in map(_IS_CPU, targets) and False not in map(_IS_CPU, sources):
            torch._foreach_copy_(targets, sources)
            return
        # Across devices, one call per pair of devices (the order within each is kept; tensors
        # in two groups cannot alias each other).
        groups: dict[tuple[torch.device, torch.device], tuple[list[Any], list[Any]]] = {}
        for t, s in zip(targets, sources, strict=True):
            group = groups.setdefault((t.device, s.device), ([], []))
            group[0].append(t)
            group[1].append(s)
        for group_targets, group_sources in groups.values():
            torch._foreach_copy_(group_targets, group_sources)


def load_into(target: Any, source: Any, *, strict: bool = True, checked: bool = False) -> Any:
    """Restore ``source`` (an unflattened state) into the live object ``target``, in place.

    First :func:`check_into`: if ``source`` does not fit ``target``, this raises
    :class:`~tiercheck.errors.StateMismatch` listing every mismatching path, and nothing has
    been written into ``target``. Then ``target`` and ``source`` are walked together:

    * a tensor in both: ``target.copy_(source)`` under ``torch.no_grad()`` (across devices too),
      so modules and optimizers keep their references (and tensors that alias each other in
      ``target`` stay aliased);
    * a numpy array in both: copied in place;
    * a mapping (``dict`` / ``OrderedDict``) in both: mutated in place -- common keys merged
      recursively, and the key order becomes ``source``'s. With ``strict=False``, keys only in
      ``source`` are added (as copies of their own, so a fresh optimizer's empty ``state``
      receives the saved moments) and keys only in ``target`` are kept as they are, after
      ``source``'s;
    * a ``list`` in both (of the same length): mutated in place, items merged recursively;
    * a ``tuple`` in both (same length): rebuilt from the merged items (tuples cannot be
      mutated), so tensors inside a tuple are still restored in place;
    * any other value: ``source``'s replaces ``target``'s.

    Returns ``target`` itself where it could be updated in place, else the object that replaces
    it; the caller stores the result where it got ``target`` from (containers do this for their
    entries).

    The tensors are copied after the walk, in one ``torch._foreach_copy_`` (per pair of
    devices), in walk order. ``checked=True`` says the caller has just run :func:`check_into`
    on these same objects with the same ``strict`` and found nothing, and that neither changed
    since: the check is not repeated.
    """
    problems = [] if checked else check_into(target, source, strict=strict)
    if problems:
        shown = problems[:_MAX_MISMATCH_LINES]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more")
        listing = "\n  ".join(shown)
        hint = (
            ""
            if not strict
            else ", or pass strict=False to allow keys that only one side holds (shapes, "
            "dtypes and lengths must still match)"
        )
        raise StateMismatch(
            f"cannot restore in place: the state given does not match the stored version at "
            f"{_items(len(problems), 'place')}; nothing was written into it:\n  {listing}\n"
            "Build the state as it was saved (same model and optimizer configuration), or "
            "restore without a state (the result holds the version as saved) and load what "
            f"you need from it yourself{hint}."
        )
    copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    result = _apply(target, source, copies)
    copy_all(*copies)
    return result


def pair_into(
    target: Any, source: Any
) -> tuple[Any, list[torch.Tensor], list[torch.Tensor | TensorSpec]]:
    """:func:`load_into` without its copies: ``(result, targets, sources)``.

    ``target`` is updated as :func:`load_into` updates it (containers merged, values replaced;
    the caller has run :func:`check_into` and found nothing), except that no tensor's data is
    copied: the pairs are returned, in walk order, for the caller to fill each target with its
    source's bytes (``target.copy_(source)`` in order is what :func:`load_into` would do).
    ``source``'s tensors need no data (they may be on the ``meta`` device, or be the layout's
    :class:`~tiercheck.codec.format.layout.TensorSpec` records): where a key only the version
    holds is added, its tensors are new empty host tensors, paired with their sources like the
    others.
    """
    copies: _Copies = ([], [])

    def own(value: Any) -> Any:
        return _own_empty(value, copies)

    result = _apply(target, source, copies, own)
    return result, copies[0], copies[1]


def _own_empty(obj: Any, copies: _Copies) -> Any:
    """:func:`own_copy`'s structure with new empty host tensors, each listed in ``copies``."""

    def fresh(source: torch.Tensor | TensorSpec) -> torch.Tensor:
        made = torch.empty(source.shape, dtype=source.dtype)
        copies[0].append(made)
        copies[1].append(source)
        return made

    def no_array(_array: Any) -> Any:
        raise TypeError("a numpy array's bytes cannot be paired; restore it with load_into")

    return _rebuild(obj, fresh, no_array)


def own_copy(obj: Any) -> Any:
    """``obj`` with every tensor and numpy array in it copied out of the payload it views.

    Restored tensors are views of one payload buffer. Saved with ``torch.save`` as they are,
    each would drag that whole buffer along (it stores storages); handed to code that reads a
    tensor's storage from its start (``torch.Generator.set_state``), a view at an offset gives
    the wrong bytes. Containers are rebuilt (dicts, lists, tuples; an ``OrderedDict`` keeps its
    ``_metadata``, as a module's ``state_dict`` has); other leaves are returned as they are.
    """
    return _rebuild(obj, torch.Tensor.clone, np.ndarray.copy)


def _rebuild(obj: Any, tensor: Callable[[Any], torch.Tensor], array: Callable[[Any], Any]) -> Any:
    """``obj`` with its containers rebuilt (dicts, lists, tuples; an ``OrderedDict`` keeps its
    ``_metadata``), each tensor (a DTensor shard's local one too, a layout's
    :class:`~tiercheck.codec.format.layout.TensorSpec` standing for one) replaced by
    ``tensor(t)`` and each numpy array by ``array(a)``; other leaves as they are."""
    if type(obj) is DTensorShard:
        return dataclasses.replace(obj, local=tensor(obj.local))
    if isinstance(obj, _SOURCE_TENSORS):
        return tensor(obj)
    if isinstance(obj, np.ndarray):
        return array(obj)
    if type(obj) is collections.OrderedDict:
        out: collections.OrderedDict[Any, Any] = collections.OrderedDict(
            (k, _rebuild(v, tensor, array)) for k, v in obj.items()
        )
        metadata = getattr(obj, "_metadata", None)
        if metadata is not None:
            out._metadata = metadata  # type: ignore[attr-defined]
        return out
    if type(obj) is dict:
        return {k: _rebuild(v, tensor, array) for k, v in obj.items()}
    if type(obj) is list:
        return [_rebuild(v, tensor, array) for v in obj]
    if type(obj) is tuple:
        return tuple(_rebuild(v, tensor, array) for v in obj)
    return obj

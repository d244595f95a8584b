"""``Stateful`` objects in a state, and what a restore without a target gives for DTensors.

The protocol is that of ``torch.distributed.checkpoint.stateful.Stateful``: an object with
``state_dict()`` and ``load_state_dict(state_dict)`` (a module, an optimizer, a scheduler, a
stateful dataloader, :class:`~tiercheck.adapters.ModelAndOptimizer`,
:class:`~tiercheck.adapters.RNGState`, a user's own). Placed anywhere in the state handed to
``save`` -- as a value of a ``dict``/``OrderedDict``, an item of a ``list``/``tuple``, or the
state itself -- such an object is saved as its ``state_dict()`` (stored as it is: a Stateful
inside the returned value is not looked into).

``restore(state)`` in place treats each one as its current ``state_dict()`` (or, where the
object has one, what its ``tiercheck_restore_target()`` returns: a ``state_dict()`` without its
side effects, see :class:`~tiercheck.adapters.ModelAndOptimizer`): the version's
entry is checked against it and copied into its tensors like any target, except that keys
present on one side only are allowed there (a fresh optimizer has no state yet; its
``load_state_dict`` judges what it gets), and a version that lacks the entry is a
:class:`~tiercheck.errors.StateMismatch` before anything is written. Once the version is
restored, each object's ``load_state_dict`` is called with the filled value, in which every
tensor has storage of its own and every stored DTensor is rebuilt (see
:func:`~tiercheck.codec.format.dtensor.materialize`). If it raises,
:class:`~tiercheck.errors.StatefulError` names the object (the version stays restored: the
stored data is fine, the object refused it), and every other rank raises one too, naming the
ranks that failed: a job must not train on from a partial state.

:class:`Replicated` marks a part of the state that every rank holds alike (a DDP model and its
optimizer): saving treats ``Replicated(x)`` as ``x``, except that only the first rank of each
node stores it (the others store a reference to that rank's copy); restoring into a state that
holds ``Replicated(x)`` restores into ``x``.

The entry points (:class:`~tiercheck.Checkpointer` and :class:`~tiercheck.SyncCheckpointer`)
call :func:`for_save` and :func:`for_restore` / :func:`finish_restore`; the containers of the
caller's state are never modified on save, and only where a restore writes values back into
them on restore (as before).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tiercheck.codec.decode.statetree import Lenient
from tiercheck.codec.encode.flatten import MAX_DEPTH, ReplicaRef
from tiercheck.codec.format.containers import CONTAINERS, MAPPINGS
from tiercheck.codec.format.dtensor import materialize
from tiercheck.errors import StatefulError, UnsupportedObject

if TYPE_CHECKING:
    from tiercheck.engine.results import Restored

__all__ = [
    "Prepared",
    "Replicated",
    "finish_restore",
    "for_restore",
    "for_save",
    "is_stateful",
]

# Values that are never Stateful, tested first (most of a state's values are tensors).
_PLAIN = frozenset(
    {torch.Tensor, torch.nn.Parameter, int, float, str, bytes, bool, type(None), np.ndarray}
)


class Replicated:
    """Marks ``value`` as state that every rank holds alike, so it is stored once per node
    (in memory) and once in all (in durable tiers).

    Wrap the replicated part of the state handed to ``save`` and ``restore`` -- for a DDP job::

        state = {"model": tiercheck.Replicated(ModelAndOptimizer(model, opt)), "rng": RNGState()}

    ``value`` is anything a state may hold (a ``Stateful`` object such as a module, an
    optimizer or :class:`~tiercheck.adapters.ModelAndOptimizer`, a ``state_dict``, a tensor).
    Saving treats ``Replicated(x)`` as ``x`` on the first rank of each node (global rank
    ``node_index * ranks_per_node``), which stores it as usual; every other rank stores a small
    reference to that rank's copy in its place, so the node's shared memory (and the peer
    tier) holds one copy per node instead of one per rank. In the tiers that outlive the
    cluster the first rank of each node but node 0 refers to rank 0's blob in turn: one copy
    in all. Restoring into a state that holds ``Replicated(x)`` restores into ``x`` on every
    rank: a rank whose blob holds a reference reads the value from the blob it leads to, of
    the same version in the same tier (and falls back to the next tier, as for any damaged
    blob, when that one is missing or corrupt).

    **The promise is the caller's:** every rank must hold the same value there at each save
    (DDP keeps parameters and optimizer state identical across ranks). tiercheck does not
    compare the ranks' copies; a rank whose value differed gets the first rank's on restore.
    Per-rank state (RNG states, a data-loader position) must stay outside. On the other ranks
    a ``Stateful`` value's ``state_dict()`` is not called at save (nothing of it is stored
    there), so it must not be a collective. DTensors placed
    ``Replicate()`` on a mesh of all ranks are stored the same way without this wrapper.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Replicated({self.value!r})"


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` follows the ``Stateful`` protocol (``state_dict``, ``load_state_dict``).

    Containers, tensors, numpy arrays and classes (whose methods need an instance) are never
    Stateful here.
    """
    t = type(obj)
    if t in _PLAIN or t in CONTAINERS or isinstance(obj, (torch.Tensor, np.ndarray, type)):
        return False
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _rebuild(obj: Any, convert: Any) -> Any:
    """``obj`` with ``convert`` applied to its values; the same object where nothing changed
    (containers are copied only on the path to a change).

    Values of the plain types (most of a state: tensors, numbers) are skipped inline: a call
    per value would cost milliseconds per save in a state of tens of thousands of tensors.
    """
    plain = _PLAIN
    t = type(obj)
    if t in MAPPINGS:
        changed = {}
        for key, value in obj.items():
            if type(value) in plain:
                continue
            new = convert(value, key)
            if new is not value:
                changed[key] = new
        if not changed:
            return obj
        out = obj.copy()  # an OrderedDict's copy keeps its ``_metadata``
        if t is collections.OrderedDict and hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        out.update(changed)
        return out
    if t is list or t is tuple:
        items = None
        for i, value in enumerate(obj):
            if type(value) in plain:
                continue
            new = convert(value, i)
            if new is not value:
                if items is None:
                    items = list(obj)
                items[i] = new
        if items is None:
            return obj
        return items if t is list else tuple(items)
    return obj


@contextlib.contextmanager
def _refusing_cycles(state: Any, verb: str) -> Iterator[None]:
    """Turn the :class:`RecursionError` of a walk over ``state`` that met a reference cycle or
    an absurd nesting into an :class:`~tiercheck.errors.UnsupportedObject` naming the path.

    The walks check nothing per container (they run at every save, over every optimizer
    state's dict): a cycle makes them recurse until Python stops them, and only then is the
    state examined. A :class:`RecursionError` with another cause (a ``state_dict()`` of the
    caller's that recursed) is raised as it was.
    """
    try:
        yield
    except RecursionError as exc:
        problem = _nesting_error(state, verb)
        if problem is None:
            raise
        raise problem from exc


def _nesting_error(state: Any, verb: str) -> UnsupportedObject | None:
    """The path of the first reference cycle in ``state``'s containers, else of the first
    container nested deeper than :data:`MAX_DEPTH`, as an error; ``None`` when neither is.

    Iterative: the recursive walks are what just went too deep.
    """
    on_path: dict[int, str] = {}
    stack: list[tuple[bool, Any, str]] = [(False, state, "")]
    deepest = ""
    while stack:
        leaving, obj, path = stack.pop()
        if leaving:
            del on_path[id(obj)]
            continue
        t = type(obj)
        if t not in CONTAINERS and t is not Replicated:
            continue
        if id(obj) in on_path:
            return UnsupportedObject(
                f"cannot {verb} state{path}: it is state{on_path[id(obj)]} itself (a reference "
                "cycle); a checkpoint holds a tree of values: break the cycle"
            )
        if len(on_path) >= MAX_DEPTH:
            deepest = deepest or path
            continue
        on_path[id(obj)] = path
        stack.append((True, obj, path))
        if t is Replicated:
            stack.append((False, obj.value, path))
            continue
        items = list(obj.items() if t in MAPPINGS else enumerate(obj))
        for key, value in reversed(items):
            stack.append((False, value, f"{path}[{key!r}]"))
    if not deepest:
        return None
    return UnsupportedObject(
        f"cannot {verb} state{deepest}: containers nested more than {MAX_DEPTH} deep; flatten "
        "the structure"
    )


def for_save(
    state: Any,
    replica: ReplicaRef | None = None,
    replicated_paths: list[tuple[Any, ...]] | None = None,
) -> Any:
    """``state`` with each Stateful object replaced by its ``state_dict()``; ``state`` itself
    (the same object) when it holds none.

    Each :class:`Replicated` value is replaced by ``replica`` where given (on a rank that is
    not its node's first: the reference to that rank's copy), else by its value (converted
    likewise); then, with ``replicated_paths`` given, the path of keys and indices from the
    root to each such value is appended to it (what a node's first rank leaves out of its
    blob in durable tiers, see :func:`tiercheck.codec.replica.lean`).
    """
    steps: list[Any] = []
    inside = False  # within a Replicated value (a Replicated in it is part of it)

    def convert(obj: Any, _key: Any = None) -> Any:
        nonlocal inside
        t = type(obj)
        if t in _PLAIN:
            return obj
        if t in CONTAINERS:
            return _rebuild(obj, convert if replicated_paths is None else stepping)
        if t is Replicated:
            if replica is not None:
                return replica
            if replicated_paths is None or inside:
                return convert(obj.value)
            replicated_paths.append(tuple(steps))
            inside = True
            try:
                return convert(obj.value)
            finally:
                inside = False
        if is_stateful(obj):
            return obj.state_dict()
        return obj

    def stepping(obj: Any, key: Any) -> Any:
        steps.append(key)
        try:
            return convert(obj)
        finally:
            steps.pop()

    with _refusing_cycles(state, "store"):
        return convert(state)


@dataclasses.dataclass
class Prepared:
    """A restore target with its Stateful objects stood in for (see :func:`for_restore`)."""

    #: What the engine restores into.
    target: Any
    #: The stand-ins, in walk order.
    lenients: list[Lenient]
    #: id of each copied container of the caller's state -> its copy in ``target``.
    copies: dict[int, Any]


def for_restore(state: Any) -> Prepared:
    """The target to restore into for ``state``: each Stateful object stood in for by a
    :class:`~tiercheck.codec.decode.statetree.Lenient` holding its current ``state_dict()``."""
    lenients: list[Lenient] = []
    copies: dict[int, Any] = {}

    def convert(obj: Any, _key: Any = None) -> Any:
        t = type(obj)
        if t in _PLAIN:
            return obj
        if t in CONTAINERS:
            new = _rebuild(obj, convert)
            if new is not obj:
                copies[id(obj)] = new
            return new
        if t is Replicated:
            return convert(obj.value)
        if is_stateful(obj):
            target = getattr(obj, "tiercheck_restore_target", None)
            lenient = Lenient(obj, target() if callable(target) else obj.state_dict())
            lenients.append(lenient)
            return lenient
        return obj

    with _refusing_cycles(state, "restore into"):
        return Prepared(convert(state), lenients, copies)


def _write_back(orig: Any, filled: Any, prepared: Prepared) -> Any:
    """Carry what the restore put into the copies back into the caller's containers; returns
    the object that stands for ``orig`` in the result."""
    if is_stateful(orig):
        return orig
    if type(orig) is Replicated:
        orig.value = _write_back(orig.value, filled, prepared)
        return orig
    if prepared.copies.get(id(orig)) is None:
        return filled  # not a copy: restored in place (or replaced) as any target
    t = type(orig)
    if t in MAPPINGS:
        for key, value in filled.items():
            if key in orig:
                new = _write_back(orig[key], value, prepared)
                if new is not orig[key]:
                    orig[key] = new
            else:
                orig[key] = value
        return orig
    if t is list:
        for i, value in enumerate(filled):
            new = _write_back(orig[i], value, prepared)
            if new is not orig[i]:
                orig[i] = new
        return orig
    items = tuple(_write_back(o, f, prepared) for o, f in zip(orig, filled, strict=True))
    return orig if all(a is b for a, b in zip(items, orig, strict=True)) else items


def finish_restore(
    state: Any, prepared: Prepared | None, restored: Restored | None
) -> Restored | None:
    """Complete ``restored`` (a :class:`~tiercheck.Restored` or ``None``).

    Without a target (``state is None``), stored DTensors in ``restored.state`` are rebuilt
    where possible (see :func:`~tiercheck.codec.format.dtensor.materialize`). With one, each
    Stateful object's ``load_state_dict`` gets its filled value, and ``restored.state`` is the
    caller's own ``state`` with everything restored into it.
    """
    if restored is None:
        return restored
    if prepared is None or (not prepared.lenients and not prepared.copies):
        if state is None:
            return dataclasses.replace(restored, state=materialize(restored.state))
        return restored
    for lenient in prepared.lenients:
        value = materialize(lenient.template)
        try:
            lenient.owner.load_state_dict(value)
        except Exception as exc:
            raise StatefulError(
                f"{type(lenient.owner).__qualname__}.load_state_dict() refused the restored "
                f"value: {type(exc).__name__}: {exc}. The version itself was restored whole; "
                "build the object as it was when saved (same parameters, same optimizer "
                "configuration), or restore without a state and inspect what was saved."
            ) from exc
    result = _write_back(state, restored.state, prepared)
    return dataclasses.replace(restored, state=result)

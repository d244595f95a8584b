"""One naming rule for the public face (issue #31), as the standard library taught it:

* a method named for what it does blocks (or answers at once), and its twin that awaits without
  blocking the event loop is ``<name>_async`` (``SaveHandle.result`` / ``result_async``,
  ``staged`` / ``staged_async``, ``fence`` / ``fence_async``);
* ``done()``, ``committed()`` and ``is_staged`` answer at once, as
  :meth:`concurrent.futures.Future.done` does;
* :class:`~tiercheck.Checkpointer` is the asyncio face, whose I/O is all coroutines named as
  :class:`~tiercheck.SyncCheckpointer` names the blocking calls (``close`` there, ``aclose``
  here as :mod:`contextlib` names it).
"""

from __future__ import annotations

import inspect

from tiercheck import Checkpointer, SaveHandle, SyncCheckpointer


def _public(cls: type) -> dict[str, object]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and callable(member)
    }


def test_a_coroutine_of_a_blocking_face_ends_in_async_and_has_its_blocking_twin() -> None:
    for cls in (SaveHandle, SyncCheckpointer):
        methods = _public(cls)
        for name, member in methods.items():
            if inspect.iscoroutinefunction(member):
                assert name.endswith("_async"), f"{cls.__name__}.{name} is a coroutine"
                twin = name.removesuffix("_async")
                assert twin in methods, f"{cls.__name__}.{name} has no blocking {twin}"
                assert not inspect.iscoroutinefunction(methods[twin])
            else:
                assert not name.endswith("_async"), f"{cls.__name__}.{name} does not await"


def test_the_asyncio_face_awaits_what_the_blocking_face_blocks_on() -> None:
    blocking = _public(SyncCheckpointer)
    asynchronous = _public(Checkpointer)
    awaited = {n for n, m in asynchronous.items() if inspect.iscoroutinefunction(m)}
    assert {"open", "save", "restore", "wait", "versions", "aclose", "fence_async"} <= awaited
    for name in ("open", "save", "restore", "wait", "versions", "close", "fence"):
        assert not inspect.iscoroutinefunction(blocking[name]), name


def test_the_answers_at_once_are_not_coroutines() -> None:
    for name in ("done", "committed"):
        assert not inspect.iscoroutinefunction(getattr(SaveHandle, name))
    assert isinstance(SaveHandle.is_staged, property)

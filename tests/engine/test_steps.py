"""Each public call written once, as steps both faces drive (tiercheck.engine.steps)."""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import assert_state_equal
from tiercheck import Checkpointer, StorageError, SyncCheckpointer, TierClosed
from tiercheck.engine.steps import drive, drive_async


async def _run(result: Any) -> Any:
    """The result of a call of either face (awaited where it is a coroutine)."""
    return await result if inspect.isawaitable(result) else result


def _faces(tmp_path: Path, job: str) -> dict[str, Checkpointer | SyncCheckpointer]:
    durable = (tmp_path / "durable").as_uri()
    return {
        "async": Checkpointer(job, local_root=tmp_path / "shm-a", persistent=durable),
        "sync": SyncCheckpointer(job, local_root=tmp_path / "shm-s", persistent=durable + "-s"),
    }


def _loop_threads(job: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"tiercheck-{job}-")]


async def test_both_faces_give_the_same_answers_even_from_inside_a_running_loop(
    tmp_path: Path,
) -> None:
    """The blocking face called from inside a running event loop (this test's) works as the
    async one does: the same versions, the same newest versions, the same restored state, the
    same TierClosed after closing; and both leave no loop thread behind."""
    state = {"w": torch.arange(6.0), "step": 3}
    seen: dict[str, Any] = {}
    for name, ckpt in _faces(tmp_path, "twins").items():
        assert await _run(ckpt.restore()) is None  # a fresh start
        for version in range(3):
            await _run(ckpt.save(version, state))
        newest = await _run(ckpt.wait())
        versions = await _run(ckpt.versions())
        restored = await _run(ckpt.restore())
        await _run(ckpt.aclose() if isinstance(ckpt, Checkpointer) else ckpt.close())
        errors = []
        calls = (ckpt.restore, ckpt.wait, ckpt.versions, lambda c=ckpt: c.save(3, state))
        for call in calls:
            with pytest.raises(TierClosed) as caught:
                await _run(call())
            errors.append(str(caught.value))
        assert restored is not None
        assert_state_equal(restored.state, state)
        seen[name] = (newest, versions, restored.version, restored.source_tier, errors)
    assert seen["async"] == seen["sync"]
    assert seen["sync"][0] == {"local": 2, "persistent": 0}
    assert seen["sync"][4] == ["the checkpointer of job 'twins' is closed"] * 4
    assert _loop_threads("twins") == []


async def test_open_on_a_closed_checkpointer_keeps_each_face_s_answer(tmp_path: Path) -> None:
    """Kept as it was: the async ``open()`` of a checkpointer that was opened answers with
    itself even once closed (its other calls refuse); the blocking ``open()`` refuses."""
    faces = _faces(tmp_path, "reopen")
    for ckpt in faces.values():
        await _run(ckpt.open())
        await _run(ckpt.aclose() if isinstance(ckpt, Checkpointer) else ckpt.close())
    async_face, sync_face = faces["async"], faces["sync"]
    assert isinstance(async_face, Checkpointer)
    assert await async_face.open() is async_face
    with pytest.raises(TierClosed, match="the checkpointer of job 'reopen' is closed"):
        sync_face.open()
    with pytest.raises(TierClosed, match="the checkpointer of job 'reopen' is closed"):
        await async_face.save(0, {"w": torch.zeros(1)})


async def test_a_failed_opening_closes_at_once_on_both_faces(tmp_path: Path) -> None:
    """A durable location that is a file: the same StorageError from either face, then the
    checkpointer is closed (its loop thread stopped), and nothing is left in its memory."""
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_bytes(b"")
    messages = []
    for kind in (Checkpointer, SyncCheckpointer):
        node = tmp_path / kind.__name__
        ckpt = kind("failing", local_root=node, persistent=not_a_folder.as_uri())
        with pytest.raises(StorageError) as caught:
            await _run(ckpt.save(0, {"w": torch.zeros(1)}))
        messages.append(re.sub(r"probe/\S+", "probe/...", str(caught.value)))  # random names
        assert ckpt._loop is None
        assert ckpt._closed
        with pytest.raises(TierClosed):
            await _run(ckpt.versions())
        assert not node.exists()
    assert messages[0] == messages[1]
    assert _loop_threads("failing") == []
    assert not_a_folder.read_bytes() == b""


def _steps(log: list[object]) -> Generator[Any, Any, str]:
    """Two steps; the second one's error is caught here, then a third's value returned."""
    first = yield "one"
    log.append(first)
    try:
        yield "boom"
    except ValueError as exc:
        log.append(f"caught {exc}")
    third = yield "three"
    return f"done {third}"


async def test_both_drivers_send_results_in_and_throw_errors_in_at_their_step() -> None:
    def run_now(step: Any) -> str:
        if step == "boom":
            raise ValueError("at step two")
        return str(step).upper()

    async def run_later(step: Any) -> str:
        return run_now(step)

    blocking: list[object] = []
    assert drive(_steps(blocking), run_now) == "done THREE"
    awaited: list[object] = []
    assert await drive_async(_steps(awaited), run_later) == "done THREE"
    assert blocking == awaited == ["ONE", "caught at step two"]

"""A save's memory as the engine holds it (tiercheck/engine/jobs.py): the holder of a staged
snapshot frees it once, when its last user gives it back, and says so when given back more
often than held (a bug that would free memory a lane still reads)."""

from __future__ import annotations

import logging

import pytest

from tiercheck.engine.jobs import Holder


def test_the_memory_is_freed_once_by_its_last_user() -> None:
    freed: list[int] = []
    holder = Holder(lambda: freed.append(1))  # the encoder's own hold
    holder.acquire()  # a lane's
    holder.acquire()  # another lane's
    holder.drop()
    holder.drop()
    assert freed == []
    holder.drop()
    assert freed == [1]


def test_a_drop_without_a_hold_is_said_at_error_and_frees_nothing_twice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    freed: list[int] = []
    holder = Holder(lambda: freed.append(1))
    holder.drop()
    assert freed == [1]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    holder.drop()
    assert freed == [1]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "tiercheck: a snapshot's memory was given back more often than held"
    ]

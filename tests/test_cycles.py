"""No memory a checkpoint used waits for the garbage collector.

An object that holds a buffer (a snapshot copy, a staged payload, a blob read back) and sits in
a reference cycle lives until the collector runs: the next save then maps and faults a fresh
buffer, and memory grows with the collector's pace (an overlapped save's copy did: its
future's callback held it). Each way of saving -- blocking, overlapped, to the persistent tier
with deltas -- and a restore then more saves run with the collector off; what the collector
then finds in cycles must hold no buffer.
"""

from __future__ import annotations

import gc
import mmap
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck

from .helpers import TinyTrainer

MODES: dict[str, dict[str, Any]] = {
    "blocking": {},
    "overlap": {"overlap": True},
    "persistent-deltas": {"tiers": ["local", "persistent"], "persist": "all", "base_every": 3},
}


def _nbytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, memoryview):
        return obj.nbytes
    if isinstance(obj, (mmap.mmap, bytearray, bytes)):
        return len(obj)
    return 0


@pytest.mark.parametrize("mode", sorted(MODES))
def test_no_buffer_of_a_save_or_restore_waits_for_the_collector(tmp_path: Path, mode: str) -> None:
    options = {
        "tiers": ["local"],
        "local_root": tmp_path / "shm",
        "persistent": (tmp_path / "durable").as_uri(),
        "keep": 3,
        **MODES[mode],
    }
    t = TinyTrainer()
    t.step()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.disable()
    try:
        with tiercheck.SyncCheckpointer("job", **options) as ckpt:
            for version in range(8):
                ckpt.save(version, t.state())
                ckpt.fence()
                t.step()
            ckpt.wait()
        with tiercheck.SyncCheckpointer("job", **options) as ckpt:
            assert ckpt.restore(t.state()) is not None
            for version in range(8, 11):
                ckpt.save(version, t.state())
                ckpt.fence()
                t.step()
            ckpt.wait()
    finally:
        gc.enable()
        gc.collect()
        garbage = list(gc.garbage)
        gc.set_debug(0)
        gc.garbage.clear()
    held = [f"{type(o).__name__} of {_nbytes(o)} bytes" for o in garbage if _nbytes(o) > 1024]
    assert held == [], f"buffers left in reference cycles: {held[:10]}"

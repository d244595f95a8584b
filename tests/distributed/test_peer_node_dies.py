"""A peer node dies mid-training: the survivor exits promptly, and nothing committed is lost.

Two real ``torchrun`` launchers, one simulated node each (node 0's agent hosts the job's store).
After version ``KILL_AT - 1`` is committed in the peer tier, node 1 loses its memory root and
its rank is SIGKILLed, after step ``KILL_AT``'s all-reduce. Rank 0 saves ``KILL_AT`` -- its
peer put then waits for an answer from the dead holder -- and its next all-reduce fails, so it
leaves ``async with ckpt:`` on that exception with that save in flight. ``peer_timeout`` is
300 s: a close that waited on the dead holder would show.

One launcher per node rather than ``--standalone --nproc-per-node 2``: a single launcher stops
its surviving workers itself (SIGTERM) as soon as one worker dies, so the survivor's own way
out of the checkpointer would never run. With a launcher per node, as on a real cluster, the
survivor's launcher only learns that its worker ended.

Then a fresh job (same job id, same memory roots and durable storage) restores the newest
committed version bit-exact: rank 0 from its local tier, rank 1 -- whose memory is gone -- from
the replica that rank 0's node keeps for it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.distributed._launch import LAUNCHER_TIMEOUT, events, first, launch_nodes, memory_root

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS, KILL_AT = 8, 5
#: Far below peer_timeout (300 s); a survivor that waited on the dead peer would exceed it.
EXIT_BOUND_S = 60.0


def test_survivor_exits_promptly_and_the_job_restores(tmp_path: Path) -> None:
    root = memory_root(tmp_path, "dies")
    persistent = (tmp_path / "durable").as_uri()
    common = ["--steps", str(STEPS), "--dim", "16", "--peer-timeout", "300"]
    try:
        first_out = tmp_path / "first"
        ended = launch_nodes(
            nodes=2,
            root=root,
            persistent=persistent,
            out=first_out,
            worker_args=[*common, "--kill-at", str(KILL_AT)],
        )
        seen = events(first_out)
        kill = first(seen[1], "kill")
        left = first(seen[0], "left")
        exit_ = first(seen[0], "exit")
        assert kill is not None, "rank 1 was to kill itself"
        assert left is not None, f"rank 0 never left the checkpointer:\n{ended[0].stderr}"
        assert left["error"] is not None, "rank 0 was to leave on the failed all-reduce"
        assert exit_ is not None, f"rank 0's process did not end by itself:\n{ended[0].stderr}"
        elapsed = exit_["t"] - kill["t"]
        print(f"rank 0 exited {elapsed:.1f}s after rank 1 was killed")
        assert elapsed < EXIT_BOUND_S, f"rank 0 took {elapsed:.1f}s to exit after the kill"
        assert all(e.returncode not in (None, 0) for e in ended), (
            f"both launchers report the failure, none hangs ({LAUNCHER_TIMEOUT}s): "
            f"{[(e.node, e.returncode) for e in ended]}"
        )
        saved = {
            rank: {e["step"]: e["digest"] for e in seen[rank] if e["e"] == "step"}
            for rank in (0, 1)
        }
        assert max(saved[1]) == KILL_AT - 1
        assert max(saved[0]) == KILL_AT, "rank 0 had a save in flight towards the dead holder"

        again = tmp_path / "again"
        ended = launch_nodes(
            nodes=2, root=root, persistent=persistent, out=again, worker_args=common
        )
        assert [e.returncode for e in ended] == [0, 0], "\n".join(e.stderr for e in ended)
        seen = events(again)
        for rank, source in ((0, "local"), (1, "peer")):
            restored = first(seen[rank], "restored")
            assert restored is not None, f"rank {rank} restored nothing"
            assert restored["version"] == KILL_AT - 1
            assert restored["source"] == source
            assert restored["digest"] == saved[rank][KILL_AT - 1], "restored bit-exact"
            assert first(seen[rank], "final") is not None
    finally:
        shutil.rmtree(root, ignore_errors=True)

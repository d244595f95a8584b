"""A transfer that fails in the middle does not end transfers between the two ranks for good.

gloo closes the connection between two ranks when a transfer on it times out (a rank paused in
the middle of one, for longer than the tier's timeout); before pair epochs, no later transfer
between those two ranks could ever work, and the peer tier stopped committing for the rest of
the run (found by the chaos soak's ``pause-long``). Two real ranks, loopback gloo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.distributed._launch import free_port

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("peer_pair_worker.py")


def _run(tmp_path: Path, mode: str) -> dict[str, Any]:
    """Both ranks of the worker in ``mode``; rank 0's JSON line."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(port), str(tmp_path), mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    result: dict[str, Any] = json.loads(outs[0][0].strip().splitlines()[-1])
    return result


def test_after_a_transfer_failed_midway_the_pair_moves_to_a_new_epoch_and_works(
    tmp_path: Path,
) -> None:
    result = _run(tmp_path, "lost")
    # The transfer the sender never made fails (the holder refuses it once its wait timed out),
    # and moves the pair on from epoch 0.
    assert result["lost"] != "stored", result
    assert result["epoch_before"] == 0
    assert result["epoch_after"] >= 1, result
    # Later transfers work, over the pair's own group, and what was stored before is intact.
    # (The worker tries the next one for up to 30 s: the holder may still be waiting out the
    # lost transfer, or count as down for retry_after, for the first tries on a loaded machine.)
    assert result["a"] == "first"
    assert result["b"] == "second"
    assert result["exists_lost"] is False


def test_a_side_that_makes_the_pairs_group_after_the_other_gave_up_fails_soon_and_recovers(
    tmp_path: Path,
) -> None:
    """Rank 0 makes the pair's group of an epoch and gives up (rank 1 is not there); rank 1
    makes it only then, and finds an address nobody listens on. Before, gloo kept it
    connecting for its own connect timeout (ten seconds and more) -- on a holder's server
    thread, every request to that rank waited behind it, and the pair went from one broken
    epoch to the next (chaos soak seed 4101). Now each side waits at most twice the tier's
    timeout (1.5 s here), an epoch is never made twice, and the next transfer works."""
    result = _run(tmp_path, "late")
    assert result["made"] == "PeerUnavailable", result
    assert result["rank1"]["made"] == "PeerUnavailable", result
    # A bound on a hang, not a speed figure: 2 x 1.5 s, with room for a loaded machine; the
    # gloo connect timeout it replaces is 10 s and more.
    assert result["seconds"] < 6.0, result
    assert result["rank1"]["seconds"] < 6.0, result
    assert result["again"] == "PeerUnavailable", result
    assert result["rank1"]["again"] == "PeerUnavailable", result
    assert result["then"] == "third", json.dumps(result)

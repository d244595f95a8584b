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

import pytest

from tests.distributed._launch import free_port

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("peer_pair_worker.py")


def test_after_a_transfer_failed_midway_the_pair_moves_to_a_new_epoch_and_works(
    tmp_path: Path,
) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(port), str(tmp_path)],
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
    result = json.loads(outs[0][0].strip().splitlines()[-1])
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

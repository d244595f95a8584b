"""What the peer tier's two-rank workers share (``peer_pair_worker.py``,
``peer_pause_worker.py``, run as scripts from this folder): joining the loopback gloo group and
making the rank's peer tier."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from tiercheck.tiers.peer import PeerTier
from tiercheck.topology import Topology


def peer_tier(
    rank: int, port: int, root: Path, *, session: str, timeout: float, retry_after: float | None
) -> PeerTier:
    """Rank ``rank`` of two joins the gloo group at ``port``; its peer tier, holding under
    ``root/holder<rank>``."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    return PeerTier(
        topology=Topology(rank, 2, 1),
        holder_root=root / f"holder{rank}",
        session=session,
        timeout=timeout,
        retry_after=retry_after,
    )

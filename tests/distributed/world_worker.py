"""One rank of a small torchrun job that saves, restores, or is refused (see test_world_size.py).

``--save N`` saves versions 0..N-1 (each a pure function of version and rank);
``--restore`` restores and prints what came back, checking it bit for bit. A refusal by the
checkpointer (a typed tiercheck error at open) exits with code 3 after printing it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import tiercheck


def _say(line: str) -> None:
    # One write per line: with PYTHONUNBUFFERED, print writes the text and its newline apart,
    # and the two ranks' lines then interleave in the shared pipe.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def state_of(version: int, rank: int) -> dict[str, torch.Tensor | int]:
    g = torch.Generator().manual_seed(version * 1000 + rank)
    return {"w": torch.randn(4096, generator=g), "step": version}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--persistent", required=True)
    parser.add_argument("--save", type=int, default=0)
    parser.add_argument("--restore", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = rank // int(os.environ.get("TIERCHECK_RANKS_PER_NODE", "1"))
    ckpt = tiercheck.SyncCheckpointer(
        "world",
        local_root=args.root / f"node{node}",
        persistent=args.persistent,
        base_every=2,
        peer_timeout=60,
    )
    code = 0
    try:
        with ckpt:
            if args.restore:
                restored = ckpt.restore()
                assert restored is not None, "nothing restored"
                expected = state_of(restored.version, rank)
                assert torch.equal(restored.state["w"], expected["w"]), "bytes differ"
                _say(f"rank {rank} restored {restored.version} from {restored.source_tier}")
            for version in range(args.save):
                ckpt.save(version, state_of(version, rank))
            ckpt.wait()
    except tiercheck.TiercheckError as exc:
        _say(f"rank {rank} refused: {type(exc).__name__}: {exc}")
        code = 3
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())

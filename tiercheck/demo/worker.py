"""One rank of the demo's training job; torchrun starts several and restarts them on failure.

It trains :class:`~tiercheck.demo.model.TinyLM` data-parallel over gloo, checkpoints every
step through tiercheck, and on attempt *k* (torchrun's restart count) injects the *k*-th
failure of ``--plan``, a comma-separated list of ``kind@step``:

* ``process`` -- rank 1 is SIGKILLed (after the previous version committed locally);
* ``node`` -- the last node's ranks lose their memory root (their checkpoints and the replicas
  they keep for others) and are SIGKILLed, once the previous version committed in the peer tier;
* ``cluster`` -- every node's memory root is lost and every rank SIGKILLed;
* ``midsave`` -- rank 1 is SIGKILLed inside a save, as it publishes the blob in its local tier.

After each restart every rank restores through tiercheck and trains on. Each rank appends JSON
events (steps, commits, failures, restores with their digests, the final digest) to
``<out>/events-r<rank>.jsonl``; the demo and the tests read them.

Run as ``python -m torch.distributed.run ... -m tiercheck.demo.worker --root ... --out ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tiercheck
from tiercheck.defaults import NodeRoot
from tiercheck.demo.model import TinyLM, batch, corpus, digest
from tiercheck.testing.faults import FaultPlan, FaultyTier
from tiercheck.tiers import LocalTier

__all__ = ["main", "parse_plan"]

KINDS = ("process", "node", "cluster", "midsave")


def parse_plan(text: str) -> list[tuple[str, int]]:
    """``"process@12,node@30"`` -> ``[("process", 12), ("node", 30)]``."""
    plan = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        kind, _, step = item.partition("@")
        if kind not in KINDS or not step.isdigit():
            raise ValueError(f"bad failure {item!r}: expected KIND@STEP with KIND in {KINDS}")
        plan.append((kind, int(step)))
    return plan


class Events:
    """Appends one JSON object per line to this rank's event file."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def __call__(self, event: str, **fields: Any) -> None:
        self.file.write(json.dumps({"e": event, "t": time.time(), **fields}) + "\n")
        self.file.flush()


def _die(events: Events) -> None:
    events.file.flush()
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _wipe(node_root: Path) -> None:
    """Lose a node's memory at once, as a dead node does.

    The other nodes' ranks keep saving meanwhile and their replicas keep arriving in this node
    root, so removing it file by file races with those writes (``rmtree`` then fails with "not
    empty" and part of the node survives). A rename is atomic: what arrives later lands in a
    fresh, empty node root, as on a replacement node.
    """
    gone = node_root.with_name(f"lost-{node_root.name}-{os.getpid()}")
    node_root.rename(gone)
    for _ in range(20):  # a write that was already under way may still add a file to it
        try:
            shutil.rmtree(gone)
            return
        except OSError:
            time.sleep(0.05)
    shutil.rmtree(gone)


def _wait_for(paths: list[Path], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout}s for {[str(p) for p in paths]}")
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> None:
    """Train, checkpoint every step, fail as planned, restore, finish."""
    parser = argparse.ArgumentParser(prog="tiercheck.demo.worker")
    parser.add_argument("--root", type=Path, required=True, help="parent of the node roots")
    parser.add_argument("--persistent", required=True, help="fsspec URL of durable storage")
    parser.add_argument("--out", type=Path, required=True, help="folder for the event files")
    parser.add_argument("--job", default="tiercheck-demo")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--plan", default="", help="failures, e.g. process@15,node@30")
    parser.add_argument("--base-every", type=int, default=10)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--digests", action="store_true", help="record each step's digest")
    args = parser.parse_args(argv)

    plan = parse_plan(args.plan)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("TIERCHECK_RANKS_PER_NODE", "1"))
    node = rank // per_node
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    failure = plan[attempt] if attempt < len(plan) else None
    node_root = args.root / f"node{node}"
    args.out.mkdir(parents=True, exist_ok=True)
    events = Events(args.out / f"events-r{rank}.jsonl")
    events("start", rank=rank, attempt=attempt, world=world, node=node)

    torch.manual_seed(0)
    text = corpus()
    model = TinyLM(args.dim, args.layers, length=args.length)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(1000 + rank)  # each rank its own dropout stream, saved and restored

    tiers: list[Any] | None = None  # the defaults: local + peer (several nodes) + persistent
    if failure is not None and failure[0] == "midsave" and rank == 1:
        victim = f"v{failure[1]:012d}/"

        def die_mid_save() -> None:
            events("failure", kind="midsave", attempt=attempt, rank=rank)
            _die(events)

        fault = FaultPlan(
            die_on=lambda op, tier, key: op == "commit" and key.startswith(victim),
            on_death=die_mid_save,
        )
        local = FaultyTier.wrap(LocalTier(NodeRoot(node_root).blobs), fault)
        tiers = [local, *(["peer"] if world // per_node > 1 else []), "persistent"]

    ckpt = tiercheck.SyncCheckpointer(
        args.job,
        local_root=node_root,
        persistent=args.persistent,
        tiers=tiers,
        base_every=args.base_every,
        peer_timeout=60,
    )

    def state(step: int) -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "step": step,
            "rng": torch.get_rng_state(),
        }

    with ckpt:
        # Not restore(state(-1)): a restarted process has a fresh optimizer whose state_dict
        # holds no moments yet, so it does not match the saved one and an in-place restore
        # (strict) refuses it. The version as saved goes through load_state_dict instead.
        restored = ckpt.restore()
        start = 0
        if restored is not None:
            model.load_state_dict(restored.state["model"])
            opt.load_state_dict(restored.state["optim"])
            torch.set_rng_state(restored.state["rng"])
            start = restored.version + 1
            events(
                "restored",
                rank=rank,
                attempt=attempt,
                version=restored.version,
                source=restored.source_tier,
                sources={str(k): v for k, v in restored.source_tiers.items()},
                seconds=restored.seconds,
                digest=digest(state(restored.version)),
            )
        handles: dict[int, Any] = {}
        reported: dict[str, int] = {}
        for step in range(start, args.steps):
            tokens, targets = batch(text, step, rank, args.batch, args.length)
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]  # torch's stub lacks annotations
            # Data parallel by hand, one all-reduce per parameter in a fixed order: DDP regroups
            # its gradient buckets after a process's first step, so a resumed process would sum
            # in another order and differ in the last bits from an uninterrupted run.
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            if failure is not None and step == failure[1]:
                inject(
                    failure[0],
                    args,
                    rank=rank,
                    per_node=per_node,
                    world=world,
                    previous=handles.get(step - 1),
                    ckpt=ckpt,
                    attempt=attempt,
                    events=events,
                )
            handle = ckpt.save(step, state(step))
            handles[step] = handle
            fields: dict[str, Any] = {"step": step, "attempt": attempt, "loss": float(loss)}
            if rank == 0:
                fields["stall"] = handle.stats.stall_s
            if args.digests:
                fields["digest"] = digest(state(step))
            events("step", rank=rank, **fields)
            if rank == 0:
                _report_commits(handles, reported, events)
        ckpt.wait()
        if rank == 0:
            _report_commits(handles, reported, events)
    events("final", rank=rank, attempt=attempt, digest=digest(state(args.steps - 1)))
    dist.destroy_process_group()


def _report_commits(handles: dict[int, Any], reported: dict[str, int], events: Events) -> None:
    """Events for versions newly committed in each tier (rank 0 speaks for the job)."""
    for version in sorted(handles):
        handle = handles[version]
        for tier in handle.tiers:
            if version > reported.get(tier, -1) and handle.committed(tier):
                reported[tier] = version
                events("commit", tier=tier, version=version)
    for version in [v for v in handles if all(handles[v].committed(t) for t in handles[v].tiers)]:
        del handles[version]


def inject(
    kind: str,
    args: argparse.Namespace,
    *,
    rank: int,
    per_node: int,
    world: int,
    previous: Any,
    ckpt: tiercheck.SyncCheckpointer,
    attempt: int,
    events: Events,
) -> None:
    """The failure of this attempt, just before saving ``step``."""
    signals = args.root / f"signals-attempt{attempt}"
    signals.mkdir(parents=True, exist_ok=True)
    last_node = world // per_node - 1
    if kind == "process" and rank == 1:
        if previous is not None:
            previous.result("local", timeout=120)
        events("failure", kind=kind, attempt=attempt, rank=rank)
        _die(events)
    elif kind == "node" and rank // per_node == last_node:
        if previous is not None:
            previous.result("peer", timeout=120)
        (signals / f"ready-{rank}").touch()
        node_ranks = range(last_node * per_node, world)
        if rank == last_node * per_node:
            _wait_for([signals / f"ready-{r}" for r in node_ranks])
            _wipe(args.root / f"node{last_node}")
            (signals / "wiped").touch()
            events("failure", kind=kind, attempt=attempt, node=last_node)
        _wait_for([signals / "wiped"])
        _die(events)
    elif kind == "cluster":
        ckpt.wait()  # the newest base is durable in the persistent tier
        (signals / f"ready-{rank}").touch()
        if rank == 0:
            _wait_for([signals / f"ready-{r}" for r in range(world)])
            for node_root in list(args.root.glob("node*")):
                _wipe(node_root)
            (signals / "wiped").touch()
            events("failure", kind=kind, attempt=attempt)
        _wait_for([signals / "wiped"])
        _die(events)


if __name__ == "__main__":
    main()

"""One rank of the chaos soak's job: ``python -m tiercheck.testing.chaos.worker ...``.

Started by the driver (:mod:`tiercheck.testing.chaos.driver`) as a plain process with the
launcher's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), it joins a gloo group,
opens a :class:`~tiercheck.SyncCheckpointer` on the local, peer and persistent tiers, restores,
then trains :class:`~tiercheck.testing.chaos.model.Model` and saves every step until the ranks
agree to stop (the driver's stop file, seen by any rank, travels in the step's all-reduce).

It reports to its event file, one JSON object per line, each line written by one ``os.write``
(a kill can cut the last line short; the driver reads only whole lines): ``start`` (pid),
``restored`` (version, digest, source tiers) or ``fresh``, ``step`` (version saved, seconds the
save blocked), ``commit``/``fail`` (a version committed in, or failed for, a tier, as its save
handle says), ``final`` (digest, what ``wait`` returned), ``closed``. How it ends is its exit
code (:data:`EXIT_CODES`): 0 at the agreed end, 3 when the checkpointer refused to open or
restore with a typed error (``refused``), 17 when a collective of the training failed -- a peer
is gone (``left``) -- and 1 for anything else (``crashed``, with the traceback): storage reached
training.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tiercheck
from tiercheck.testing.chaos.model import CONTRIBUTION, Model, contribution

__all__ = [
    "EXIT_CODES",
    "EXIT_CRASHED",
    "EXIT_LEFT",
    "EXIT_REFUSED",
    "EXIT_RESTORE_FAILED",
    "PLANTS",
    "main",
]

EXIT_CRASHED = 1
EXIT_REFUSED = 3
EXIT_RESTORE_FAILED = 4
EXIT_LEFT = 17
#: What each exit code of a worker means.
EXIT_CODES = {
    0: "ended at the agreed step",
    EXIT_CRASHED: "crashed: an exception reached the training loop",
    EXIT_REFUSED: "refused: the checkpointer raised a typed error at open or restore",
    EXIT_RESTORE_FAILED: "restore failed: another error at open or restore (a peer gone?)",
    EXIT_LEFT: "left: a collective of the training failed (a peer is gone)",
}


#: Bugs the worker can plant in itself, to show that the oracle catches them: ``flip`` flips a
#: bit of the restored state (a restore that is not bit-exact); ``crash`` raises a storage error
#: out of the training loop three saves after the start (storage killing training).
PLANTS = ("flip", "crash")


class Events:
    """Appends JSON lines to one file, each in a single ``write`` (whole or not at all)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({"e": event, "t": time.time(), **fields}) + "\n"
        os.write(self.fd, line.encode())


class CollectiveFailed(Exception):
    """The training's all-reduce failed: another rank is gone."""


class Pending:
    """Save handles whose tiers have not all reported yet; reports each tier's outcome once."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self.handles: list[tuple[tiercheck.SaveHandle, set[str]]] = []

    def add(self, handle: tiercheck.SaveHandle) -> None:
        self.handles.append((handle, set(handle.tiers)))

    def report(self) -> None:
        kept = []
        for handle, open_tiers in self.handles:
            for tier in sorted(open_tiers):
                state = handle.stats.tiers[tier].state
                if handle.committed(tier):
                    self.events("commit", tier=tier, v=handle.version)
                elif state in ("failed", "skipped", "uncertain"):
                    error = handle.stats.tiers[tier].error
                    kind = "uncertain" if state == "uncertain" else "fail"
                    self.events(kind, tier=tier, v=handle.version, state=state, error=error)
                else:
                    continue
                open_tiers.discard(tier)
            if open_tiers:
                kept.append((handle, open_tiers))
        self.handles = kept


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tiercheck.testing.chaos.worker")
    p.add_argument("--job", required=True)
    p.add_argument("--root", type=Path, required=True, help="parent of the node roots")
    p.add_argument("--persistent", required=True)
    p.add_argument("--storage-options", default="{}", help="JSON")
    p.add_argument("--events", type=Path, required=True, help="this run's event folder")
    p.add_argument("--stop-file", type=Path, required=True)
    p.add_argument("--size", type=int, default=16384)
    p.add_argument("--base-every", type=int, default=4)
    p.add_argument("--peer-timeout", type=float, default=3.0)
    p.add_argument("--close-timeout", type=float, default=5.0)
    p.add_argument("--train-timeout", type=float, default=120.0)
    p.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument("--restore-only", action="store_true", help="restore, report, close")
    p.add_argument("--plant", choices=PLANTS, default=None, help="a bug to plant (tests only)")
    return p


def _all_reduce(tensor: torch.Tensor) -> None:
    try:
        dist.all_reduce(tensor)
    except Exception as exc:  # gloo's errors have no common type; any failure here is a peer's
        raise CollectiveFailed(f"{type(exc).__name__}: {exc}") from exc


def train(args: argparse.Namespace, events: Events) -> int:
    """Open, restore, train and save until the ranks agree to stop; the exit code."""
    rank = dist.get_rank()
    node = rank // int(os.environ.get("TIERCHECK_RANKS_PER_NODE", "1"))
    model = Model(rank, args.size)
    ckpt = tiercheck.SyncCheckpointer(
        args.job,
        local_root=args.root / f"node{node}",
        persistent=args.persistent,
        storage_options=json.loads(args.storage_options),
        tiers=["local", "peer", "persistent"],
        base_every=args.base_every,
        peer_timeout=args.peer_timeout,
        close_timeout=args.close_timeout,
        # A durable tier unreachable at opening is tried again with a backoff capped here:
        # with the default cap (60 s) a long outage could put the next try past the K saves
        # within which the oracle wants commits back.
        durable_retry_delay=0.5,
        durable_retry_max=2.0,
    )
    started = time.monotonic()
    try:
        ckpt.open()
        restored = ckpt.restore(model.state())
    except tiercheck.TiercheckError as exc:
        events("refused", error=type(exc).__name__, message=str(exc)[:2000])
        return EXIT_REFUSED
    except Exception as exc:
        events(
            "restore_failed",
            error=f"{type(exc).__name__}: {exc}"[:2000],
            tb=traceback.format_exc()[-4000:],
        )
        return EXIT_RESTORE_FAILED
    start = 0
    if restored is None:
        events("fresh", seconds=time.monotonic() - started)
    else:
        model.after_restore()
        if args.plant == "flip" and rank == 0:
            model.w.view(torch.int32)[0] ^= 1
        start = restored.version + 1
        events(
            "restored",
            v=restored.version,
            digest=model.digest(),
            source=restored.source_tier,
            sources={str(k): v for k, v in restored.source_tiers.items()},
            rejected={str(k): list(v)[:4] for k, v in restored.rejected.items()},
            seconds=time.monotonic() - started,
        )
    pending = Pending(events)
    with ckpt:
        step = start
        while not args.restore_only:
            reduced = torch.zeros(CONTRIBUTION + 1, dtype=torch.int64)
            reduced[:CONTRIBUTION] = contribution(step, rank)
            reduced[CONTRIBUTION] = int(args.stop_file.exists())
            try:
                _all_reduce(reduced)
            except CollectiveFailed as exc:
                events("collective_failed", v=step, error=str(exc)[:1000])
                raise
            model.advance(reduced)
            model.before_save()
            if args.plant == "crash" and step == start + 3:
                raise tiercheck.StorageError("planted: a storage error reached the training loop")
            t0 = time.monotonic()
            pending.add(ckpt.save(step, model.state()))
            events("step", v=step, stall=round(time.monotonic() - t0, 4))
            pending.report()
            if reduced[CONTRIBUTION] > 0:
                break
            step += 1
            time.sleep(args.step_seconds)
        newest = ckpt.wait()
        pending.report()
        if not args.restore_only:
            events("final", v=step, digest=model.digest(), newest=newest, stats=_stats(ckpt))
    events("closed")
    return 0


def _stats(ckpt: tiercheck.SyncCheckpointer) -> dict[str, Any]:
    s = ckpt.stats
    return {
        "saves": s.saves,
        "skipped": s.skipped,
        "failed": s.failed,
        "tier_skips": s.tier_skips,
        "last_committed": s.last_committed,
    }


def main() -> None:
    """Run one rank; leave with the exit code that says how it ended (:data:`EXIT_CODES`)."""
    args = _parser().parse_args()
    args.events.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    # Output to a file of this rank's own, whoever started it (under torchrun, the launcher's
    # output would mix every rank of the node).
    out = os.open(args.events / f"r{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    events = Events(args.events / f"r{rank}.jsonl")
    events("start", pid=os.getpid(), rank=rank)
    # The driver asks a rank that seems hung for every thread's stack (into its stderr file).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = EXIT_CRASHED
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.train_timeout))
        events("joined")
        code = train(args, events)
    except CollectiveFailed as exc:
        events("left", error=str(exc)[:1000])
        code = EXIT_LEFT
    except BaseException as exc:
        events("crashed", error=f"{type(exc).__name__}: {exc}"[:2000], tb=traceback.format_exc())
        traceback.print_exc()
        code = EXIT_CRASHED
    sys.stdout.flush()
    sys.stderr.flush()
    events("exit", code=code)
    # Leave at once: torch's C++ teardown at interpreter exit can abort a process whose peers
    # are gone, which would hide the code that says how this one ended.
    os._exit(code)


if __name__ == "__main__":
    main()

"""``tiercheck demo``: train, fail three ways, restore from the right tier, prove it bit-exact.

Several processes on this machine play a small cluster: ``--ranks`` ranks over ``--nodes``
simulated nodes (each node its own shared-memory root), talking over torch.distributed (gloo on
loopback), launched by torchrun. They train a tiny transformer on real text and checkpoint every
step through tiercheck's local, peer and persistent tiers.

The demo runs the job twice: once uninterrupted, recording a digest of the state at every
step, and once with failures injected in turn -- by default a process crash, then the loss of
a node, then the loss of the whole cluster's memory. After each, torchrun restarts the job, which
restores and carries on. The closing table shows, for each failure, which tier each node
restored from, how long it took, how many steps had to be redone, and whether the restored
state is bit for bit the state the uninterrupted run had at that step.

Nothing to set up: persistent storage is a local folder and the memory tiers live in
``/dev/shm`` (or a temporary folder); all of it is removed at the end unless ``--keep``, which
keeps the memory tiers too (node roots ``<memory>/<run>/tiercheck-demo/node<i>``, readable with
``tiercheck ls``). Ctrl-C stops the job (torchrun stops its workers) and cleans up the same way.

While it runs, a progress line reports a step once its checkpoint is committed, so no line ever
reports work that a failure then undoes: the failure and the restore come first, then the steps
trained after the restore.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercheck.cli.pipe import end_quietly
from tiercheck.defaults import SHM_DIR
from tiercheck.demo.worker import parse_plan

__all__ = ["main"]

DEFAULT_PLAN = "process@15,node@30,cluster@45"
#: The job's name (the worker's default): node roots are <memory>/<run>/<JOB>/node<i>, so the
#: command line (tiercheck ls) names the job as the checkpointer does.
JOB = "tiercheck-demo"
#: The exit code of an interrupted demo (as a shell reports SIGINT).
EXIT_INTERRUPTED = 130
DESCRIPTIONS = {
    "process": "process crash",
    "node": "node lost",
    "cluster": "cluster lost",
    "midsave": "crash mid-save",
}


@dataclass
class Run:
    """One torchrun job of the demo and what its ranks reported."""

    name: str
    out: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def load(self) -> None:
        self.events = EventFeed(self.out).new()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["e"] == kind]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tiercheck demo",
        description="Train a tiny transformer on a simulated cluster, fail it three ways, and "
        "restore each time from the tier that survived.",
    )
    p.add_argument("--ranks", type=int, default=4, help="training processes (default 4)")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument(
        "--plan",
        default=DEFAULT_PLAN,
        help=f"failures in turn, KIND@STEP (kinds: {', '.join(DESCRIPTIONS)}); "
        f"default {DEFAULT_PLAN}",
    )
    p.add_argument("--base-every", type=int, default=10, help="a base every N saves")
    p.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--workdir", type=Path, default=None, help="where logs and storage go")
    p.add_argument("--keep", action="store_true", help="keep checkpoints and logs afterwards")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when every restore was bit-exact, 1 otherwise, 2 on bad options, 130
    when interrupted, 141 (quietly, the job stopped) when the reader of its output goes away."""
    try:
        return _main(argv)
    except BrokenPipeError:
        return end_quietly(sys.stdout)


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    try:
        plan = parse_plan(args.plan)
    except ValueError as exc:
        print(f"tiercheck demo: {exc}", file=sys.stderr)
        return 2
    if args.nodes < 2 or args.ranks % args.nodes:
        print("tiercheck demo: --nodes must be at least 2 and divide --ranks", file=sys.stderr)
        return 2
    if any(step >= args.steps for _, step in plan) or any(
        a[1] >= b[1] for a, b in itertools.pairwise(plan)
    ):
        print("tiercheck demo: failure steps must increase and stay below --steps", file=sys.stderr)
        return 2

    work = args.workdir or Path(tempfile.mkdtemp(prefix="tiercheck-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    shm = Path(SHM_DIR) if Path(SHM_DIR).is_dir() else work
    memory = Path(tempfile.mkdtemp(prefix="tiercheck-demo-memory-", dir=shm))
    print(
        f"tiercheck demo: {args.ranks} ranks on {args.nodes} simulated nodes, {args.steps} steps, "
        f"checkpointing every step to local + peer + persistent.\n"
        f"  memory tiers under {memory}, persistent storage under {work}\n"
    )
    try:
        reference = _launch(args, work, memory / "reference", "reference", plan="", restarts=0)
        if reference is None:
            return 1
        failing = _launch(
            args, work, memory / "failures", "failures", plan=args.plan, restarts=len(plan)
        )
        if failing is None:
            return 1
        return _report(args, plan, reference, failing)
    except KeyboardInterrupt:
        print("\ntiercheck demo: interrupted; the job was stopped", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        _clean_up(args, work, memory)


def _clean_up(args: argparse.Namespace, work: Path, memory: Path) -> None:
    """Remove what the demo made, or with ``--keep`` say where it is and how to look at it."""
    if args.keep:
        print(
            f"\nkept:\n  logs and persistent storage: {work}\n"
            f"    (tiercheck ls {work / 'durable-failures'})\n"
            f"  memory tiers: {memory}\n"
            f"    (tiercheck ls {memory}; they hold memory until removed: rm -r {memory})"
        )
        return
    shutil.rmtree(memory, ignore_errors=True)
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


def _launch(
    args: argparse.Namespace, work: Path, root: Path, name: str, *, plan: str, restarts: int
) -> Run | None:
    """Run one torchrun job, showing its progress; ``None`` if it failed."""
    run = Run(name, work / name)
    if run.out.exists():
        shutil.rmtree(run.out)
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={args.ranks}", f"--max-restarts={restarts}",
        "--monitor-interval=0.1",
        "-m", "tiercheck.demo.worker",
        "--root", str(root / JOB), "--persistent", (work / f"durable-{name}").as_uri(),
        "--job", JOB,
        "--out", str(run.out), "--steps", str(args.steps), "--plan", plan,
        "--base-every", str(args.base_every), "--dim", str(args.dim),
        "--layers", str(args.layers), "--batch", str(args.batch),
        "--digests",
    ]  # fmt: skip
    env = {
        **os.environ,
        "TIERCHECK_RANKS_PER_NODE": str(args.ranks // args.nodes),
        # torchrun shares its rendezvous store with the workers by default; a restarted group
        # can then pick up the dead group's addresses (pytorch/pytorch#135712).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }
    title = "uninterrupted run (the reference)" if not plan else "run with failures"
    print(f"{title}:")
    log = work / f"{name}.log"
    started = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        stop, closed = threading.Event(), threading.Event()
        watcher = threading.Thread(target=_watch, args=(run, args.steps, stop, closed), daemon=True)
        watcher.start()
        try:
            code = _wait(proc, closed)
        except KeyboardInterrupt:
            _stop(proc)
            raise
        finally:
            stop.set()
            watcher.join()
    run.seconds = time.monotonic() - started
    run.load()
    if code != 0 or len(run.of("final")) != args.ranks:
        print(f"\n  the job failed (exit code {code}); its log: {log}")
        print("".join(log.read_text().splitlines(keepends=True)[-30:]))
        return None
    print(f"  done in {run.seconds:.1f} s\n")
    return run


def _wait(proc: subprocess.Popen[bytes], closed: threading.Event) -> int:
    """The job's exit code; when the reader of the output goes away meanwhile (``closed``),
    the job is stopped and :class:`BrokenPipeError` raised."""
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            if closed.is_set():
                _stop(proc, signalled=False)
                raise BrokenPipeError("the demo's output was closed") from None


def _stop(proc: subprocess.Popen[bytes], *, signalled: bool = True) -> None:
    """Stop the torchrun job after an interrupt, bounded; torchrun stops its workers itself.

    A Ctrl-C at a terminal reached torchrun too (same process group), so it is given a moment
    to stop on its own; an interrupt of the demo alone needs a SIGTERM; SIGKILL is the last
    resort. Another Ctrl-C meanwhile moves on to the next, stronger step. Without
    ``signalled`` (the demo stops on its own account) the SIGTERM comes at once.
    """
    steps = ((None, 5.0),) if signalled else ()
    for sig, seconds in (*steps, (signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        if sig is not None and proc.poll() is None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=seconds)
            return
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:
            continue  # asked again: escalate now rather than wait


class EventFeed:
    """The events of a run not read yet, each once, in the order its rank wrote them.

    Each rank's file is read on from where the last read ended, whole lines only (a line being
    written is read next time), and the new events are merged by time.
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self._read: dict[Path, int] = {}

    def new(self) -> list[dict[str, Any]]:
        """Events written since the last call."""
        events: list[dict[str, Any]] = []
        for path in sorted(self.out.glob("events-r*.jsonl")):
            start = self._read.get(path, 0)
            with path.open("rb") as f:
                f.seek(start)
                data = f.read()
            whole = data.rfind(b"\n") + 1
            self._read[path] = start + whole
            for line in data[:whole].decode(errors="replace").splitlines():
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    # Half a line left by a rank killed mid-write, joined with the next
                    # attempt's first event: neither is needed (the attempt's start).
                    continue
        events.sort(key=lambda e: e["t"])  # stable: one rank's events keep their order
        return events


class ProgressLines:
    """What the demo prints while a run goes: failures, restores, and every tenth step once
    its checkpoint is committed (rank 0 reports commits for the job)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._step_info: dict[int, dict[str, Any]] = {}  # rank 0's newest event of each step
        self._done = -1  # the newest version committed, or restored

    def lines(self, events: list[dict[str, Any]]) -> list[str]:
        """The lines ``events`` call for."""
        out = []
        for event in events:
            kind = event["e"]
            if kind == "failure":
                what = DESCRIPTIONS[event["kind"]]
                out.append(f"  ✗ {what} (attempt {event['attempt'] + 1})")
            elif kind == "restored" and event["rank"] == 0:
                tiers = sorted(set(event["sources"].values()))
                out.append(
                    f"  ↺ restored version {event['version']} "
                    f"(tiers: {', '.join(tiers)}) in {event['seconds']:.3f} s"
                )
                self._done = event["version"]
            elif kind == "step" and event["rank"] == 0:
                self._step_info[event["step"]] = event
            elif kind == "commit" and event["version"] > self._done:
                version, last = event["version"], self._done
                self._done = version
                if version // 10 != last // 10 or version == self.steps - 1:
                    out.append(self._step_line(version))
        return out

    def _step_line(self, version: int) -> str:
        info = self._step_info.get(version, {})
        loss = f"  loss {info['loss']:.3f}" if "loss" in info else ""
        stall = f"  save blocked {info['stall'] * 1e3:.1f} ms" if "stall" in info else ""
        return f"    step {version + 1:>4}/{self.steps}{loss}{stall}"


def _watch(run: Run, steps: int, stop: threading.Event, closed: threading.Event) -> None:
    """Print the run's progress as its ranks write their events, until ``stop``; set
    ``closed`` and return if the reader of the output goes away."""
    feed, progress = EventFeed(run.out), ProgressLines(steps)
    while True:
        finished = stop.is_set()
        try:
            for line in progress.lines(feed.new()):
                print(line, flush=True)
        except BrokenPipeError:
            closed.set()  # the main thread stops the job and ends quietly
            return
        if finished:
            return
        time.sleep(0.2)


def _report(
    args: argparse.Namespace, plan: list[tuple[str, int]], reference: Run, failing: Run
) -> int:
    """Print the closing table; 0 when every restore and the end state are bit-exact."""
    expected = {(e["rank"], e["step"]): e["digest"] for e in reference.of("step")}
    per_node = args.ranks // args.nodes
    rows = []
    all_exact = True
    for attempt, (kind, step) in enumerate(plan, start=1):
        restores = [e for e in failing.of("restored") if e["attempt"] == attempt]
        if len(restores) != args.ranks:
            rows.append((DESCRIPTIONS[kind], str(step), "-", "not restored", "-", "-", "no"))
            all_exact = False
            continue
        version = restores[0]["version"]
        exact = all(expected.get((e["rank"], e["version"])) == e["digest"] for e in restores)
        exact = exact and len({e["version"] for e in restores}) == 1
        all_exact &= exact
        by_node: dict[str, list[int]] = {}
        for e in restores:
            by_node.setdefault(e["source"], []).append(e["rank"] // per_node)
        sources = ", ".join(
            f"{tier} (node{'s' if len(set(n)) > 1 else ''} {','.join(map(str, sorted(set(n))))})"
            for tier, n in sorted(by_node.items())
        )
        seconds = max(e["seconds"] for e in restores)
        rows.append(
            (
                DESCRIPTIONS[kind],
                str(step),
                str(version),
                sources,
                f"{seconds:.3f}",
                str(step - version),
                "yes" if exact else "NO",
            )
        )
    final = {e["digest"] for e in failing.of("final")} == {
        e["digest"] for e in reference.of("final")
    }
    all_exact &= final
    header = (
        "failure",
        "at step",
        "restored",
        "from (tier)",
        "restore s",
        "steps lost",
        "bit-exact",
    )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print("result:")
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    print(
        f"\n  final model after {args.steps} steps, vs the uninterrupted run: "
        f"{'bit-exact' if final else 'DIFFERENT'}"
    )
    stalls = [e["stall"] for e in failing.of("step") if "stall" in e]
    if stalls:
        stalls.sort()
        print(
            f"  save blocked training for {stalls[len(stalls) // 2] * 1e3:.1f} ms per step (median)"
        )
    return 0 if all_exact else 1

"""The soak's command line: ``python -m tiercheck.testing.chaos --seed N --minutes M``.

It prints its seed, the fault list and the first episodes of the schedule, then one line per
episode as it runs and what the oracle saw after it. It stops at the first invariant that does
not hold, and prints the command that replays that seed's schedule up to it; the run's folder
(each incarnation's events and output, the S3 server's log) is kept then, removed otherwise.

``--catalog`` runs each fault of the catalog alone, a few episodes each, and prints a table:
``pass``, ``FAIL`` (expected to pass), ``xfail`` (expected to fail today, and did) or ``XPASS``
(expected to fail, but passed: its mark is out of date).

Exit codes: 0 every invariant held (``--catalog``: every fault as expected), 1 an invariant did
not hold, 2 bad options, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from tiercheck.testing.chaos.catalog import CATALOG, passing, schedule
from tiercheck.testing.chaos.faults import HANDLERS, finish
from tiercheck.testing.chaos.oracle import Finding
from tiercheck.testing.chaos.soak import Settings, Soak, remove_run

__all__ = ["Outcome", "main", "run"]

PLANTS = ("flip", "crash", "lose-newest")


class Outcome:
    """How a soak went."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.episodes = 0
        self.finding: Finding | None = None
        self.episode: str | None = None
        #: The catalog name of the fault the finding came after (``None``: the start or end).
        self.fault: str | None = None
        self.seconds = 0.0
        self.final: int | None = None
        self.workdir: Path | None = None
        self.memory: Path | None = None

    @property
    def ok(self) -> bool:
        """Whether every invariant held."""
        return self.finding is None

    def remove(self) -> None:
        """Remove the run's folder and node roots, kept after a finding."""
        if self.workdir is not None and self.memory is not None:
            remove_run(self.workdir, self.memory)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def replay_command(settings: Settings, episodes: int) -> str:
    """The command that replays ``settings``' schedule up to episode ``episodes``."""
    args = ["python", "-m", "tiercheck.testing.chaos", "--seed", str(settings.seed)]
    args += ["--episodes", str(episodes), "--faults", ",".join(settings.faults)]
    defaults = Settings(seed=0, faults=())
    names = ("launcher", "nodes", "ranks_per_node", "size", "base_every", "peer_timeout")
    for name in (*names, "step_seconds", "resume_within", "tmpfs_mb", "plant"):
        value = getattr(settings, name)
        if value != getattr(defaults, name):
            args += [f"--{name.replace('_', '-')}", str(value)]
    return shlex.join(args)


def run(settings: Settings, log: Callable[[str], None] = _say) -> Outcome:
    """Run one soak, reporting through ``log``; return how it went (never raises a
    :class:`Finding`)."""
    outcome = Outcome(settings)
    episodes = schedule(settings.seed, settings.faults, settings.world, settings.nodes)
    p = settings.peer_timeout
    log(
        f"chaos soak: seed {settings.seed}; faults {','.join(settings.faults)}; "
        f"{settings.nodes} nodes x {settings.ranks_per_node} ranks; peer_timeout {p} s; "
        f"base_every {settings.base_every}; K = {settings.resume_within} saves"
        + (f"; planted bug: {settings.plant}" if settings.plant else "")
    )
    first = list(
        itertools.islice(
            schedule(settings.seed, settings.faults, settings.world, settings.nodes),
            settings.episodes or 12,
        )
    )
    log(
        "schedule: "
        + "; ".join(e.describe(p) for e in first)
        + ("" if settings.episodes else "; ...")
    )
    started = time.monotonic()
    deadline = None if settings.minutes is None else started + 60 * settings.minutes
    soak = Soak(settings, log)
    outcome.workdir, outcome.memory = soak.workdir, soak.memory
    try:
        log(f"  start (run folder {soak.workdir})")
        soak.start()
        for ep in episodes:
            if settings.episodes is not None and ep.index >= settings.episodes:
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            outcome.episode, outcome.fault = ep.describe(p), ep.fault
            log(f"  [{time.monotonic() - started:7.1f}s] {ep.describe(p)}")
            soak.run_to(soak.job.min_step() + ep.after)
            HANDLERS[ep.fault](soak, ep)
            outcome.episodes += 1
        outcome.episode, outcome.fault = "the end", None
        log(f"  [{time.monotonic() - started:7.1f}s] the end")
        outcome.final = finish(soak)
    except Finding as finding:
        outcome.finding = finding
    finally:
        outcome.seconds = time.monotonic() - started
        soak.close(keep=settings.keep or outcome.finding is not None)
    if outcome.finding is None:
        log(
            f"ok: seed {settings.seed}, {outcome.episodes} episodes, {soak.incarnations} "
            f"launches, {soak.oracle.restores} restores checked, final v{outcome.final}, "
            f"{outcome.seconds:.0f} s; longest save stall {soak.oracle.max_stall:.2f} s "
            "(a rank's own SIGSTOP not counted)"
        )
    else:
        fault = CATALOG.get(outcome.fault or "")
        log(f"FAILED at {outcome.episode}: {outcome.finding}")
        if fault is not None and fault.fails_today:
            log(f"  (expected today: {fault.fails_today})")
        log(f"  replay: {replay_command(settings, outcome.episodes + 1)}")
        log(f"  run folder (kept): {soak.workdir}; node roots (kept): {soak.memory}")
        if soak.tmpfs_refused is None:
            log(f"  (a tmpfs is still mounted there: umount {soak.memory} once done)")
    return outcome


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tiercheck.testing.chaos",
        description="A seeded chaos soak: a real multi-process job, faults from a catalog, an "
        "oracle after every recovery.",
    )
    p.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: random)")
    p.add_argument("--minutes", type=float, default=None, help="run episodes for this long")
    p.add_argument("--episodes", type=int, default=None, help="run this many episodes")
    p.add_argument(
        "--faults",
        default="passing",
        help="comma-separated catalog names, 'passing' (default: those expected to pass today) "
        "or 'all'",
    )
    p.add_argument(
        "--catalog",
        action="store_true",
        help="each fault alone (those --faults names, else the whole catalog); a table",
    )
    p.add_argument("--list", action="store_true", help="print the catalog and exit")
    p.add_argument(
        "--launcher",
        choices=["plain", "torchrun"],
        default="plain",
        help="start the ranks directly (default) or by one torchrun per node",
    )
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--size", type=int, default=16384, help="fp32 weights per rank")
    p.add_argument("--base-every", type=int, default=4)
    p.add_argument("--peer-timeout", type=float, default=3.0)
    p.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument("--resume-within", type=int, default=24, help="K, in saves")
    p.add_argument(
        "--tmpfs-mb", type=int, default=64, help="a tmpfs of this size for the node roots (0: none)"
    )
    p.add_argument("--workdir", type=Path, default=None, help="parent of the run folder")
    p.add_argument("--keep", action="store_true", help="keep the run folder even on success")
    p.add_argument("--plant", choices=PLANTS, default=None, help="plant a bug (tests the oracle)")
    return p


def _faults(spec: str, launcher: str) -> tuple[str, ...]:
    if spec == "passing":
        return passing(launcher)
    if spec == "all":
        return tuple(CATALOG)
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    unknown = [n for n in names if n not in CATALOG]
    if unknown or not names:
        raise ValueError(f"unknown faults: {unknown} (see --list)")
    return names


def catalog_run(settings: Settings, episodes: int, names: Sequence[str] | None = None) -> int:
    """Each fault of ``names`` (default: the whole catalog) alone for ``episodes`` episodes; a
    table; 0 when every fault did as expected."""
    rows = []
    for name in names if names is not None else CATALOG:
        fault = CATALOG[name]
        if fault.torchrun_only and settings.launcher != "torchrun":
            rows.append((name, "skip", "", "needs --launcher torchrun"))
            continue
        got = run(replace(settings, faults=(name,), episodes=episodes, minutes=None))
        if got.ok:
            verdict = "pass" if fault.fails_today is None else "XPASS"
        else:
            verdict = "FAIL" if fault.fails_today is None else "xfail"
        detail = "" if got.finding is None else f"[{got.finding.check}] {got.finding.message}"
        rows.append(
            (name, verdict, f"{got.seconds:.0f}s", detail.splitlines()[0][:150] if detail else "")
        )
    _say(f"\ncatalog (seed {settings.seed}, {episodes} episodes each):")
    for name, verdict, secs, detail in rows:
        _say(f"  {name:22} {verdict:6} {secs:>5}  {detail}")
    return 0 if all(v in ("pass", "xfail", "skip") for _, v, _, _ in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak from the command line; the exit code (see the module docstring)."""
    args = _parser().parse_args(list(argv) if argv is not None else None)
    if args.list:
        for name, fault in CATALOG.items():
            mark = "passes" if fault.fails_today is None else f"FAILS TODAY ({fault.fails_today})"
            _say(f"{name:22} {fault.description}\n{'':22} {mark}")
        return 0
    try:
        faults = _faults(args.faults, args.launcher)
    except ValueError as exc:
        _say(f"chaos: {exc}")
        return 2
    if args.nodes < 2 or args.ranks_per_node < 1:
        _say("chaos: --nodes must be at least 2 (the peer tier needs another node)")
        return 2
    missing = [m for m in ("moto", "boto3", "s3fs") if importlib.util.find_spec(m) is None]
    if missing:
        _say(f"chaos: {', '.join(missing)} missing: pip install 'tiercheck[test,s3]'")
        return 2
    seed = args.seed if args.seed is not None else int.from_bytes(__import__("os").urandom(3))
    settings = Settings(
        seed=seed,
        faults=faults,
        minutes=args.minutes,
        episodes=args.episodes if args.episodes is not None or args.minutes else 8,
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        launcher=args.launcher,
        size=args.size,
        base_every=args.base_every,
        peer_timeout=args.peer_timeout,
        step_seconds=args.step_seconds,
        resume_within=args.resume_within,
        tmpfs_mb=args.tmpfs_mb,
        workdir=args.workdir,
        keep=args.keep,
        plant=args.plant,
    )
    try:
        if args.catalog:
            chosen = None if args.faults in ("passing", "all") else faults
            return catalog_run(settings, args.episodes or 3, chosen)
        return 0 if run(settings).ok else 1
    except KeyboardInterrupt:
        _say("chaos: interrupted")
        return 130

"""The soak's mechanics: start the job, watch it, crash it, restart it, end it -- each step
checked by the :class:`~tiercheck.testing.chaos.oracle.Oracle`.

:class:`Soak` holds the run: the S3 server, the memory folder, the current incarnation of the
job, the oracle. The faults themselves (:mod:`tiercheck.testing.chaos.faults`) are written with
its few verbs: :meth:`Soak.run_to`, :meth:`Soak.crash`, :meth:`Soak.restart`,
:meth:`Soak.wait`, :meth:`Soak.expect_resume`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercheck.defaults import MANIFEST_DIR, SHM_DIR
from tiercheck.testing.chaos.catalog import TIERS
from tiercheck.testing.chaos.cluster import (
    VANISHED,
    Incarnation,
    JobSpec,
    Launcher,
    RankProcess,
    kill_manifest,
)
from tiercheck.testing.chaos.model import Reference
from tiercheck.testing.chaos.oracle import Finding, Oracle, Restore
from tiercheck.testing.chaos.s3 import S3
from tiercheck.testing.chaos.worker import EXIT_LEFT, EXIT_REFUSED, EXIT_RESTORE_FAILED

__all__ = ["Settings", "Soak", "remove_run", "restores_of"]

TICK = 0.05


@dataclass(frozen=True)
class Settings:
    """Everything a soak is run with (the command line's options)."""

    seed: int
    faults: tuple[str, ...]
    minutes: float | None = None
    episodes: int | None = None
    nodes: int = 2
    ranks_per_node: int = 1
    launcher: Launcher = "plain"
    size: int = 16384
    base_every: int = 4
    peer_timeout: float = 3.0
    close_timeout: float = 5.0
    step_seconds: float = 0.05
    #: Saves within which commits must resume in every tier after a transient fault...
    resume_within: int = 24
    #: ...and at least this many seconds: a durable tier's storage calls back off when they
    #: fail (up to 1.5 s each by RetryPolicy's defaults) and a commit takes several, so at
    #: 20 saves a second K saves alone would be shorter than one call's retries.
    resume_seconds: float = 6.0
    stall_limit: float = 10.0
    #: Seconds without a save by every rank (no rank stopped) that count as a hang.
    hang_s: float = 60.0
    open_timeout: float = 120.0
    exit_timeout: float = 45.0
    #: Size of the tmpfs mounted for the node roots (0: none; they live in /dev/shm itself).
    tmpfs_mb: int = 64
    workdir: Path | None = None
    keep: bool = False
    plant: str | None = None

    @property
    def world(self) -> int:
        """Ranks of the job."""
        return self.nodes * self.ranks_per_node


class Soak:
    """One soak run: its processes, its job, its oracle."""

    def __init__(self, settings: Settings, log: Callable[[str], None]) -> None:
        self.settings = settings
        self.log = log
        run = f"chaos-{settings.seed}-{uuid.uuid4().hex[:8]}"
        base = settings.workdir or Path(tempfile.gettempdir())
        self.workdir = base / run
        self.workdir.mkdir(parents=True)
        shm = Path(SHM_DIR)
        self.memory = (shm if shm.is_dir() else self.workdir) / run
        self.s3 = S3(self.workdir)
        self.reference = Reference(settings.world, settings.size)
        self.oracle = Oracle(self.reference, stall_limit=settings.stall_limit)
        self.spec = JobSpec(
            job="chaos",
            memory=self.memory,
            persistent=self.s3.url(run),
            storage_options=self.s3.storage_options(),
            out=self.workdir,
            ranks_per_node=settings.ranks_per_node,
            size=settings.size,
            base_every=settings.base_every,
            peer_timeout=settings.peer_timeout,
            close_timeout=settings.close_timeout,
            step_seconds=settings.step_seconds,
            plant=settings.plant,
        )
        self.prefix = f"{run}/"
        #: Why the node roots are not on a tmpfs of their own (``None``: they are).
        self.tmpfs_refused: str | None = "no tmpfs asked for (--tmpfs-mb 0)"
        self.inc: Incarnation | None = None
        self.incarnations = 0
        self.progress_at = time.monotonic()
        self.progress_step = -1
        #: Versions whose blobs in S3 a fault damaged (they bind no restore).
        self.damaged: set[int] = set()
        #: Commits of the current incarnation held until its restore is checked.
        self.unchecked: list[tuple[int, dict[str, Any]]] | None = None

    # --- processes ---------------------------------------------------------------------------

    def start(self) -> None:
        """Mount the memory tmpfs, start S3 and the first incarnation (a fresh start)."""
        self.memory.mkdir(parents=True)
        if self.settings.tmpfs_mb:
            self.tmpfs_refused = _mount(self.memory, self.settings.tmpfs_mb)
            if self.tmpfs_refused is not None:
                self.log(f"  node roots on {SHM_DIR} itself: {self.tmpfs_refused}")
        self.s3.start()
        self.restart((), "the first start")

    def launch(self, world: int | None = None, *, restore_only: bool = False) -> Incarnation:
        """Start a new incarnation of the job (the previous one must have ended)."""
        if self.inc is not None:
            assert not self.inc.alive()
            # A launcher outliving its ranks waits in torch's exit barrier for a launcher that is
            # gone (killed by a fault): torch's to answer for, not the job's; it is ended.
            codes = self.inc.reap_agents(10.0)
            if None in codes:
                self.log(f"    (launchers still waiting 10 s after their ranks ended: {codes})")
        self.inc = Incarnation(
            self.spec,
            self.incarnations,
            world or self.settings.world,
            restore_only=restore_only,
            launcher=self.settings.launcher,
        )
        self.incarnations += 1
        self.progress_at, self.progress_step = time.monotonic(), -1
        self.unchecked = []
        self.oracle.new_incarnation()
        return self.inc

    @property
    def job(self) -> Incarnation:
        """The current incarnation."""
        assert self.inc is not None
        return self.inc

    def tick(self, *, exits_allowed: bool = False) -> None:
        """Read the ranks' new events into the oracle; check that no rank ended unasked and
        that training makes progress."""
        inc = self.job
        self._feed()
        inc.alive()  # marks the ranks a dead launcher never started
        if not exits_allowed:
            for r in inc.ranks:
                if r.poll() is not None and not r.signalled:
                    self._feed()  # its last words (a crash) say more than its exit code
                    raise Finding("unexpected-exit", self.exit_story(r))
        step = inc.min_step()
        now = time.monotonic()
        if step > self.progress_step or any(r.stopped for r in inc.ranks):
            self.progress_at, self.progress_step = now, step
        elif now - self.progress_at > self.settings.hang_s and inc.alive():
            inc.dump_stacks()
            raise Finding(
                "hung",
                f"no rank saved a version for {now - self.progress_at:.0f} s "
                f"(every rank at or past version {step}); stacks are in the ranks' output",
            )

    def _feed(self) -> None:
        """The ranks' new events into the oracle. Commits reported by an incarnation whose
        restore is not checked yet wait: they belong to the timeline after that restore, while
        the check compares the restore with what was committed before it."""
        for rank, event in self.job.read():
            if self.unchecked is not None and event["e"] == "commit":
                self.unchecked.append((rank, event))
            else:
                self.oracle.see(rank, event)

    def release(self) -> None:
        """The restore of this incarnation is checked (or never will be): its commits count."""
        held, self.unchecked = self.unchecked or [], None
        for rank, event in held:
            self.oracle.see(rank, event)

    def exit_story(self, r: RankProcess) -> str:
        code = r.poll()
        last = r.events.events[-1] if r.events.events else {}
        return (
            f"rank {r.rank} exited with code {code} although the driver did not signal it; "
            f"its last event: {last}\n--- its output:\n{r.tail()}"
        )

    def wait(self, seconds: float, *, exits_allowed: bool = False) -> None:
        """Watch the job for ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.tick(exits_allowed=exits_allowed)
            time.sleep(TICK)

    def until(self, done: Callable[[], bool], what: str) -> None:
        """Watch (exits allowed) until ``done()``; a hang after ``open_timeout`` seconds."""
        deadline = time.monotonic() + self.settings.open_timeout
        while not done():
            if time.monotonic() > deadline:
                self.job.dump_stacks()
                raise Finding("hung", f"waited {self.settings.open_timeout:.0f} s for {what}")
            self.tick(exits_allowed=True)
            time.sleep(TICK)

    def run_to(self, version: int) -> None:
        """Watch until every rank saved ``version``."""
        while self.job.min_step() < version:
            self.tick()
            time.sleep(TICK)

    def crash(
        self,
        ranks: Sequence[RankProcess],
        sig: int,
        *,
        restoring: bool = False,
        closing: bool = False,
    ) -> None:
        """Send ``sig`` to ``ranks``; wait until every rank has ended. The others must leave
        because a collective failed (or, ``restoring``, because their restore did; or,
        ``closing``, because they were ending anyway)."""
        inc = self.job
        for r in ranks:
            r.send(sig)
        deadline = time.monotonic() + self.settings.exit_timeout
        while inc.alive() and time.monotonic() < deadline:
            self.tick(exits_allowed=True)
            time.sleep(TICK)
        if inc.alive():
            stuck = [r.rank for r in inc.alive()]
            inc.dump_stacks()
            inc.kill()
            raise Finding(
                "did-not-leave",
                f"ranks {stuck} were still alive {self.settings.exit_timeout:.0f} s after "
                f"{[r.rank for r in ranks]} got signal {sig}; their stacks:\n"
                + "\n".join(inc.ranks[s].tail(60) for s in stuck),
            )
        self.tick(exits_allowed=True)
        allowed = {EXIT_LEFT} | ({EXIT_REFUSED, EXIT_RESTORE_FAILED} if restoring else set())
        allowed |= {0} if closing else set()
        if self.settings.launcher == "torchrun":
            allowed.add(VANISHED)  # its launcher ended it once a rank of its node failed
        for r in inc.ranks:
            if not r.signalled and r.returncode not in allowed:
                raise Finding("unexpected-exit", self.exit_story(r))

    def started(self, *, exits_allowed: bool = False) -> dict[int, dict[str, Any]]:
        """Wait until every rank reported how its open and restore went; by rank."""
        inc = self.job
        kinds = ("restored", "fresh", "refused", "restore_failed")
        deadline = time.monotonic() + self.settings.open_timeout
        while True:
            self.tick(exits_allowed=True)
            found = {r.rank: e for r in inc.ranks for e in r.events.events if e["e"] in kinds}
            if len(found) == len(inc.ranks):
                return found
            gone = [r for r in inc.ranks if r.poll() is not None and r.rank not in found]
            if gone and not exits_allowed:
                raise Finding("unexpected-exit", self.exit_story(gone[0]))
            if time.monotonic() > deadline:
                inc.dump_stacks()
                raise Finding(
                    "hung",
                    f"ranks {sorted(set(range(inc.world)) - set(found))} did not finish "
                    f"opening and restoring within {self.settings.open_timeout:.0f} s",
                )
            time.sleep(TICK)

    def restart(
        self,
        survivors: Sequence[str],
        after: str,
        floor: tuple[int, str] | None = None,
        *,
        degrade: bool = False,
    ) -> int | None:
        """Start the job again; check its restore against the tiers that survived (and
        ``floor``: a version known whole elsewhere, and where); return the version it restored
        (``None``: fresh). ``degrade``: the fault destroyed copies in memory, so what memory
        held before it binds no later restore (only what the job commits from now on)."""
        self.oracle.lose(set(TIERS) - set(survivors))
        t0 = time.monotonic()
        self.launch()
        got = self.started()
        failed = {r: e for r, e in got.items() if e["e"] in ("refused", "restore_failed")}
        if failed:
            rank, event = min(failed.items())
            raise Finding(
                "refused",
                f"after {after} rank {rank} could not open or restore: {event.get('error')}: "
                f"{event.get('message', '')}{event.get('tb', '')}",
            )
        restores = restores_of(got)
        bound = max(filter(None, [self.oracle.bound(survivors), floor]), default=None)
        version = self.oracle.check_restore(restores, survivors, after, floor)
        if degrade:
            self.oracle.lose(["local", "peer"])
        self.release()
        sources = ",".join(str(r.source) for r in restores)
        self.log(
            f"    restored {'nothing (fresh)' if version is None else f'v{version}'}"
            f"{f' from {sources}' if version is not None else ''}; newest committed in a "
            f"surviving tier: {'none' if bound is None else f'v{bound[0]} ({bound[1]})'}; "
            f"{time.monotonic() - t0:.1f} s"
        )
        return version

    def expect_resume(self, what: str) -> None:
        """After a transient fault: every tier commits a version newer than any it had
        committed when the fault ended, before the job saved :attr:`Settings.resume_within`
        more (and :attr:`Settings.resume_seconds` passed). (A tier that lags -- it commits the
        oldest versions it queued first -- passes as long as it commits; one that stopped does
        not.)"""
        inc = self.job
        self.tick()
        after = inc.max_step()
        newest = dict(self.oracle.known)
        since = len(self.oracle.commits)
        limit = after + self.settings.resume_within
        not_before = time.monotonic() + self.settings.resume_seconds
        while True:
            self.tick()
            self.oracle.check_agreement()
            done = self.oracle.resumed(newest, since)
            if done >= set(TIERS):
                self.log(
                    f"    commits resumed in every tier by v{inc.max_step()} "
                    f"(the fault ended at v{after})"
                )
                return
            if inc.min_step() >= limit and time.monotonic() >= not_before:
                stuck = {t: newest[t] for t in TIERS if t not in done}
                raise Finding(
                    "no-resume",
                    f"after {what}, which ended at version {after}, no tier of {sorted(stuck)} "
                    f"committed a version newer than it had by then ({stuck}) before every rank "
                    f"saved version {limit} (K = {self.settings.resume_within} saves) and "
                    f"{self.settings.resume_seconds:.0f} s passed",
                )
            time.sleep(TICK)

    def close(self, *, keep: bool) -> None:
        """Stop every process; remove the run's files unless ``keep``."""
        if self.inc is not None:
            self.inc.kill()
        self.s3.close()
        if not keep:
            remove_run(self.workdir, self.memory)


def remove_run(workdir: Path, memory: Path) -> None:
    """Remove a run's folder and its node roots (unmounting their tmpfs, if it has one)."""
    # The nodes' manifest processes outlive the ranks (a few seconds idle) and hold their
    # environment open: a tmpfs they are in cannot be unmounted until they are gone.
    for folder in memory.glob(f"*/{MANIFEST_DIR}"):
        kill_manifest(folder)
    shutil.rmtree(memory, ignore_errors=True)  # what is in it, a mount point stays
    if memory.is_dir() and os.path.ismount(memory):
        subprocess.run(["umount", str(memory)], check=False)
    shutil.rmtree(memory, ignore_errors=True)
    shutil.rmtree(workdir, ignore_errors=True)


def restores_of(got: dict[int, dict[str, Any]]) -> list[Restore]:
    """What each rank reported about its restore (``fresh``: no version)."""
    return [
        Restore(rank, e.get("v"), e.get("digest"), e.get("source"))
        for rank, e in sorted(got.items())
    ]


def _mount(folder: Path, megabytes: int) -> str | None:
    """Mount a tmpfs of ``megabytes`` on ``folder``; why not, if the machine refuses."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    return None if done.returncode == 0 else f"mount refused: {done.stderr.strip()}"

r"""Timelines and world sizes, fuzzed: any sequence of runs on any number of ranks restores right.

A Hypothesis state machine plays a job's life as an operator would: runs of 1, 2 or 3 ranks
(threads of this process, one node, every run ``elastic=True``), each restoring -- the newest
version, or going back to an older one -- and saving a few versions, some killed before they
close (the process stops dead: nothing flushed, nothing closed), the node's memory sometimes
wiped in between (a lost node). Every version's tensors are a function of the version *and of the
run that saved it*, so a version of an abandoned timeline restored in place of the current one's
is caught, as is a version read as saved by another number of ranks than saved it.

The oracle, after every run:

1. a restore never fails when a version is committed on the run's timeline in durable storage,
   and never with a ``ReshardError`` or ``StateMismatch`` (the world-size history is true);
2. what it restores is, bit for bit, each new rank's share of what the run that saved that
   version saved;
3. it is at least the newest version committed durably on the current timeline (a version
   going back abandoned is not on it); a restore of a version asked for gives exactly that one;
4. the versions a going-back left behind are never deleted by a restore: until the run saves
   again, the durable tier holds everything it held.

``tests/distributed``-style real kills of the same sequence run in
:func:`test_the_reported_sequence_with_real_kills` (SIGKILL of a process holding the ranks).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests.test_never_lose import run_ranks
from tiercheck import ReshardError, RestoreError, StateMismatch, SyncCheckpointer
from tiercheck.codec.format.dtensor import DTensorShard
from tiercheck.testing import LocalGroup
from tiercheck.testing.faults import abandon

ROWS, COLS = 7, 3
KEEP = {"local": 2, "persistent": 3}


def weight(run: int, version: int) -> torch.Tensor:
    """The global tensor run ``run`` saves as ``version``."""
    g = torch.Generator().manual_seed(run * 100_003 + version)
    return torch.randn(ROWS, COLS, generator=g)


def rows(rank: int, world: int) -> slice:
    chunk = math.ceil(ROWS / world)
    start = min(rank * chunk, ROWS)
    return slice(start, min(start + chunk, ROWS))


def state_of(run: int, version: int, rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s state in a ``world``-rank run: a Shard(0) piece, as FSDP2 stores it."""
    full, part = weight(run, version), rows(rank, world)
    return {
        "w": DTensorShard(
            local=full[part].clone(),
            shape=tuple(full.shape),
            stride=tuple(full.stride()),
            placements=(("shard", 0),),
            mesh=(world,),
            names=None,
            device="cpu",
            coord=(rank,),
            offset=(part.start, 0),
        ),
        "step": version,
    }


def job(root: Path, rank: int, world: int, group: LocalGroup) -> SyncCheckpointer:
    return SyncCheckpointer(
        "job",
        rank=rank,
        world_size=world,
        ranks_per_node=world,
        coordinator=group.coordinator(rank),
        local_root=root / "node",
        persistent=(root / "durable").as_uri(),
        tiers=["local", "persistent"],
        base_every=2,
        persist="all",
        keep=KEEP,
        elastic=True,
        threads=1,
    )


def local(value: Any) -> torch.Tensor:
    """The local shard of a DTensor restored without a state (a tensor, or a record of it)."""
    return value if isinstance(value, torch.Tensor) else value.local


def durable_files(root: Path) -> dict[str, bytes]:
    folder = root / "durable" / "job"
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and p.relative_to(folder).parts[0].startswith("v")
    }


class TimelineMachine(RuleBasedStateMachine):
    """Runs of any size, going back, kills, lost memory; the oracle is in the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tiercheck-timelines-"))
        self.runs = 0
        #: The current timeline: version -> the run that saved it.
        self.timeline: dict[int, int] = {}
        #: (run, version) pairs reported committed in the durable tier.
        self.durable: set[tuple[int, int]] = set()
        self.story: list[str] = []

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _note(self, line: str) -> None:
        self.story.append(line)
        note(line)

    def _floor(self) -> int:
        return max((v for v, run in self.timeline.items() if (run, v) in self.durable), default=-1)

    @rule(
        world=st.integers(1, 3),
        saves=st.integers(0, 3),
        back=st.one_of(st.none(), st.integers(0, 3)),
        killed=st.booleans(),
        wipe=st.booleans(),
    )
    def run(self, world: int, saves: int, back: int | None, killed: bool, wipe: bool) -> None:
        if wipe:
            shutil.rmtree(self.root / "node", ignore_errors=True)
        self.runs += 1
        me = self.runs
        floor = self._floor()
        newest = max(self.timeline, default=-1)
        ask = None if back is None or newest - back < 0 else newest - back
        before = durable_files(self.root)
        group = LocalGroup(world)
        outcome: dict[int, Any] = {}

        def one(rank: int) -> None:
            ckpt = job(self.root, rank, world, group)
            try:
                try:
                    restored = ckpt.restore(version=ask)
                    asked = ask
                except RestoreError:
                    if ask is None:
                        raise
                    restored, asked = ckpt.restore(), None
                outcome[rank] = (restored, asked)
                start = -1 if restored is None else restored.version
                handles = []
                for v in range(start + 1, start + 1 + saves):
                    handles.append(ckpt.save(v, state_of(me, v, rank, world)))
                if killed:
                    abandon(ckpt)
                    ckpt = None
                    outcome[rank] += (handles,)
                    return
                ckpt.wait()
                outcome[rank] += (handles,)
            finally:
                if ckpt is not None:
                    ckpt.close()

        try:
            run_ranks(world, one)
        except (ReshardError, StateMismatch) as exc:
            raise AssertionError(
                f"run {me} on {world} ranks could not restore: {exc}\n" + "\n".join(self.story)
            ) from exc
        except RestoreError as exc:
            refused = exc
        else:
            refused = None
        if refused is not None:
            assert floor < 0, f"run {me}: RestoreError with v{floor} durable: {refused}"
            self._note(f"run {me} ({world} ranks): RestoreError {refused}")
            return
        restored, asked, handles = outcome[0]
        got = -1 if restored is None else restored.version
        self._note(
            f"run {me}: {world} ranks, wipe={wipe}, asked {asked}, restored {got}"
            f"{'' if restored is None else f' from {restored.source_tier}'}, saved {saves}, "
            f"killed={killed}"
        )
        if restored is None:
            assert floor < 0, f"run {me} restored nothing, v{floor} is durable"
        else:
            assert got in self.timeline, (got, self.timeline)
            if asked is not None:
                assert got == asked
            else:
                assert got >= floor, (got, floor)
            saver = self.timeline[got]
            for rank in range(world):
                r = outcome[rank][0]
                assert r.version == got
                expected = weight(saver, got)[rows(rank, world)]
                assert torch.equal(local(r.state["w"]), expected), (rank, got, saver)
        if saves == 0:
            # A restore alone changes nothing stored.
            assert durable_files(self.root) == before
            return
        self.timeline = {v: run for v, run in self.timeline.items() if v <= got}
        for v in range(got + 1, got + 1 + saves):
            self.timeline[v] = me
        # A version commits in a tier for every rank at once: rank 0's handles say.
        self.durable.update((me, h.version) for h in handles if h.committed("persistent"))

    @rule(wipe=st.booleans())
    def damage_the_job_record_and_repair_it(self, wipe: bool) -> None:
        """An operator's slip tears the job record; `tiercheck repair-job` rebuilds it from the
        COMMIT records (the next run's checks then hold as before), maybe with the memory gone
        too."""
        from tiercheck.cli import main as cli

        record = self.root / "durable" / "job" / "JOB"
        if not record.exists():
            return
        record.write_bytes(record.read_bytes()[:17])
        if wipe:
            shutil.rmtree(self.root / "node", ignore_errors=True)
        assert cli(["repair-job", (self.root / "durable").as_uri(), "--job", "job"]) == 0
        self._note(f"job record torn and repaired (memory wiped: {wipe})")

    @invariant()
    def abandoned_sets_are_whole(self) -> None:
        """Every set a going-back left, with its SET record, holds a COMMIT record and every
        rank's blob for each version it lists."""
        from tiercheck.consistency.abandoned import AbandonedSet
        from tiercheck.consistency.commit import CommitRecord

        for record in (self.root / "durable" / "job").glob("abandoned/*/SET"):
            listed = AbandonedSet.from_bytes(record.read_bytes())
            for v in listed.versions:
                commit = record.parent / f"v{v:012d}" / "COMMIT"
                assert commit.exists(), commit
                parsed = CommitRecord.from_bytes(commit.read_bytes())
                for entry in parsed.entries:
                    assert (record.parent / entry.key).exists(), entry.key


TestTimelines = TimelineMachine.TestCase
TestTimelines.settings = settings(max_examples=50, stateful_step_count=8, deadline=None)


def test_a_fresh_start_records_its_world_over_a_history_of_versions_never_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the machine above: 2 ranks save v0 only in memory and die; 1 rank restores it
    from memory, saves v1 (the history: v0 by 2 ranks, v1 on by 1) and dies; the node's memory
    is lost, so the next 1-rank run starts fresh and saves v0 again -- which the history still
    said 2 ranks saved, so no later run could restore it. A run's first save now records its
    world from that version on whenever the history says otherwise."""
    monkeypatch.setattr(sys.modules[__name__], "note", lambda _line: None)
    machine = TimelineMachine()
    try:
        for world, saves, killed, wipe in [
            (2, 0, False, False),
            (1, 0, False, False),
            (2, 2, True, False),
            (1, 1, True, False),
            (1, 1, False, True),
            (1, 0, False, False),
        ]:
            machine.run(world=world, saves=saves, back=None, killed=killed, wipe=wipe)
            machine.abandoned_sets_are_whole()
        assert machine.story[-1].startswith("run 6: 1 ranks, wipe=False, asked None, restored 0")
    finally:
        machine.teardown()


REPORTED = textwrap.dedent(
    """
    import os, sys, math, signal, torch
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from tests.test_timelines import job, state_of, run_ranks
    from tiercheck.testing import LocalGroup

    root, world, run, first, last, kill = Path(sys.argv[1]), *map(int, sys.argv[2:7])
    group = LocalGroup(world)

    def one(rank):
        ckpt = job(root, rank, world, group)
        r = ckpt.restore()
        # One write per line: the ranks are threads of this process, and print() writes its
        # words and its newline apart, so two ranks' lines could interleave.
        sys.stdout.write("restored " + str(None if r is None else r.version) + "\\n")
        sys.stdout.flush()
        for v in range(first, last + 1):
            ckpt.save(v, state_of(run, v, rank, world))
        ckpt.wait()
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.close()

    run_ranks(world, one)
    """
)


@pytest.mark.slow
def test_the_reported_sequence_with_real_kills(tmp_path: Path) -> None:
    """#19's sequence, each run a process of its own: 2 ranks save v0-6; 1 rank restores
    (elastic) and is SIGKILLed; 2 ranks restore v6 and save v7-9; then a 2-rank restart and a
    1-rank restart both restore v9 bit-exact."""
    script = tmp_path / "run.py"
    script.write_text(REPORTED.format(repo=str(Path(__file__).resolve().parents[1])))

    def launch(world: int, run: int, first: int, last: int, kill: bool) -> str:
        done = subprocess.run(
            [
                sys.executable,
                str(script),
                str(tmp_path),
                str(world),
                str(run),
                str(first),
                str(last),
                str(int(kill)),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if kill:
            assert done.returncode == -signal.SIGKILL, done.stderr
        else:
            assert done.returncode == 0, done.stderr
        return done.stdout

    launch(2, 1, 0, 6, False)
    assert "restored 6" in launch(1, 2, 7, 6, True)  # restores, saves nothing, killed
    assert "restored 6" in launch(2, 3, 7, 9, False)
    for world in (2, 1):
        group = LocalGroup(world)

        def check(rank: int, world: int = world, group: LocalGroup = group) -> None:
            with job(tmp_path, rank, world, group) as ckpt:
                r = ckpt.restore()
                assert r is not None
                assert r.version == 9
                assert torch.equal(local(r.state["w"]), weight(3, 9)[rows(rank, world)])

        run_ranks(world, check)
    assert os.path.exists(tmp_path / "durable" / "job" / "JOB")

"""The chaos soak (tiercheck/testing/chaos): its schedule, its oracle, and short real runs.

The fast tests check the parts that need no processes: the schedule is a pure function of the
seed (in this process and in another one), every fault of the catalog has a handler and an
honest mark, and each check of the oracle fails on the evidence it exists to catch. The slow
ones run the real thing -- ranks as processes in a gloo group on loopback, a moto S3 server
behind a proxy the soak takes down, shared memory under /dev/shm -- for a short fixed-seed
schedule that must pass, and with bugs planted in the job that the oracle must report.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tiercheck.testing.chaos.catalog import CATALOG, PASSING, TIERS, Episode, schedule
from tiercheck.testing.chaos.driver import Outcome, replay_command, run
from tiercheck.testing.chaos.faults import HANDLERS
from tiercheck.testing.chaos.model import Reference
from tiercheck.testing.chaos.oracle import Finding, Oracle, Restore
from tiercheck.testing.chaos.soak import Settings

# --- the schedule ---------------------------------------------------------------------------


def first(seed: int, n: int = 40, faults: tuple[str, ...] = PASSING) -> list[Episode]:
    return list(itertools.islice(schedule(seed, faults, 4, 2), n))


def test_the_schedule_is_a_pure_function_of_the_seed() -> None:
    assert first(7) == first(7)
    assert first(7) != first(8)
    # The order the faults are named in does not matter; the list itself does.
    assert first(7) == first(7, faults=tuple(reversed(PASSING)))
    assert first(7) != first(7, faults=PASSING[:-1])
    # Nothing of this process leaks in (hash seeds, import order): another one draws the same.
    code = (
        "import itertools, json, dataclasses\n"
        "from tiercheck.testing.chaos.catalog import PASSING, schedule\n"
        "eps = itertools.islice(schedule(7, PASSING, 4, 2), 40)\n"
        "print(json.dumps([dataclasses.asdict(e) for e in eps]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [e.__dict__ for e in first(7)]


def test_the_schedule_draws_every_fault_it_is_given_and_no_other() -> None:
    drawn = {e.fault for e in first(1, 400)}
    assert drawn == set(PASSING)
    assert {e.fault for e in first(1, 50, ("kill-rank",))} == {"kill-rank"}
    with pytest.raises(ValueError, match="unknown faults"):
        next(schedule(1, ("explode",), 2, 2))


def test_every_fault_has_a_handler_and_an_honest_mark() -> None:
    assert set(HANDLERS) == set(CATALOG)
    assert set(PASSING) == {n for n, f in CATALOG.items() if f.fails_today is None}
    for fault in CATALOG.values():
        # An expected failure says why: the issue that will fix it, or that it has none yet.
        assert fault.fails_today is None or "issue" in fault.fails_today
        assert fault.survivors is None or set(fault.survivors) <= set(TIERS)


def test_a_replay_command_names_everything_the_schedule_depends_on() -> None:
    settings = Settings(seed=5, faults=("kill-rank", "s3-blip"), ranks_per_node=2)
    command = replay_command(settings, 3)
    assert "--seed 5" in command
    assert "--episodes 3" in command
    assert "--faults kill-rank,s3-blip" in command
    assert "--ranks-per-node 2" in command


def test_the_command_line_lists_the_catalog_and_refuses_bad_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tiercheck.cli import main as tiercheck_main

    assert tiercheck_main(["chaos", "--list"]) == 0
    listed = capsys.readouterr().out
    for name, fault in CATALOG.items():
        assert name in listed
        if fault.fails_today:
            assert fault.fails_today in listed
    for bad in (["--faults", "explode"], ["--nodes", "1"]):
        assert tiercheck_main(["chaos", *bad]) == 2
        assert "chaos:" in capsys.readouterr().out


# --- the oracle, on evidence made by hand ----------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference(world=2, size=256)


def restores(reference: Reference, version: int, source: str = "local") -> list[Restore]:
    return [Restore(r, version, reference.digest(version, r), source) for r in range(2)]


def committed(oracle: Oracle, **newest: int) -> None:
    for tier, version in newest.items():
        oracle.see(0, {"e": "commit", "tier": tier, "v": version})


def test_the_oracle_passes_a_restore_of_the_newest_surviving_version(
    reference: Reference,
) -> None:
    oracle = Oracle(reference, stall_limit=5)
    committed(oracle, local=9, peer=8, persistent=8)
    assert oracle.check_restore(restores(reference, 9), TIERS, "a kill") == 9
    # Only persistent survives a cluster loss: version 8 is enough then.
    oracle.lose(["local", "peer"])
    assert oracle.check_restore(restores(reference, 8), ["persistent"], "a loss") == 8


def test_the_oracle_catches_a_restore_of_an_older_version(reference: Reference) -> None:
    oracle = Oracle(reference, stall_limit=5)
    committed(oracle, local=9, peer=8)
    with pytest.raises(Finding) as caught:
        oracle.check_restore(restores(reference, 8), TIERS, "a kill")
    assert caught.value.check == "lost-committed"
    # A fresh start when something survived is a loss too.
    with pytest.raises(Finding) as caught:
        oracle.check_restore([Restore(r, None, None, None) for r in range(2)], TIERS, "a kill")
    assert caught.value.check == "lost-committed"


def test_the_oracle_catches_bytes_that_differ(reference: Reference) -> None:
    oracle = Oracle(reference, stall_limit=5)
    wrong = restores(reference, 4)
    wrong[1] = Restore(1, 4, reference.digest(5, 1), "peer")  # another version's bytes
    with pytest.raises(Finding) as caught:
        oracle.check_restore(wrong, TIERS, "a kill")
    assert caught.value.check == "not-bit-exact"


def test_the_oracle_catches_ranks_that_disagree(reference: Reference) -> None:
    oracle = Oracle(reference, stall_limit=5)
    mixed = [restores(reference, 4)[0], restores(reference, 5)[1]]
    with pytest.raises(Finding) as caught:
        oracle.check_restore(mixed, TIERS, "a kill")
    assert caught.value.check == "inconsistent-restore"


def test_the_oracle_catches_a_crash_and_a_stall(reference: Reference) -> None:
    oracle = Oracle(reference, stall_limit=5)
    with pytest.raises(Finding) as caught:
        oracle.see(1, {"e": "crashed", "error": "StorageError: x", "tb": ""})
    assert caught.value.check == "killed-by-storage"
    oracle.see(1, {"e": "step", "v": 3, "stall": 4.0})
    with pytest.raises(Finding) as caught:
        oracle.see(1, {"e": "step", "v": 4, "stall": 6.0})
    assert caught.value.check == "stalled"


def test_a_stall_is_what_a_save_took_less_the_time_its_own_rank_was_stopped(
    reference: Reference,
) -> None:
    """A SIGSTOP that lands inside a save is the fault, not a stall the save caused; time the
    rank was not stopped still counts, and another rank's stop does not excuse it."""
    oracle = Oracle(reference, stall_limit=5)
    oracle.was_stopped(1, 100.0, 108.0)
    oracle.see(1, {"e": "step", "v": 3, "stall": 8.5, "t": 108.2})  # 8 s of it stopped
    assert oracle.max_stall == pytest.approx(0.5)
    with pytest.raises(Finding) as caught:
        oracle.see(1, {"e": "step", "v": 4, "stall": 14.0, "t": 110.0})  # stopped 8 of 14
    assert caught.value.check == "stalled"
    with pytest.raises(Finding) as caught:
        oracle.see(0, {"e": "step", "v": 3, "stall": 8.5, "t": 108.2})  # rank 0 ran
    assert caught.value.check == "stalled"


def test_commits_resume_only_with_newer_versions_in_the_tier(reference: Reference) -> None:
    oracle = Oracle(reference, stall_limit=5)
    committed(oracle, local=3, peer=3, persistent=0)
    newest, since = dict(oracle.known), len(oracle.commits)
    committed(oracle, local=4, peer=3, persistent=0)  # the peer and persistent ones again
    assert oracle.resumed(newest, since) == {"local"}
    committed(oracle, peer=4, persistent=2)  # persistent lags, but moves
    assert oracle.resumed(newest, since) == set(TIERS)
    # A tier that had committed nothing resumes with any version.
    assert oracle.resumed({**newest, "peer": None}, len(oracle.commits) - 2) >= {"peer"}


def test_the_oracle_catches_ranks_whose_handles_disagree(reference: Reference) -> None:
    oracle = Oracle(reference, stall_limit=5)
    oracle.see(0, {"e": "commit", "tier": "local", "v": 9})
    oracle.see(1, {"e": "fail", "tier": "local", "v": 8, "error": "x"})  # another version
    oracle.see(1, {"e": "commit", "tier": "peer", "v": 9})
    # A rank that lost the round's last exchange is uncertain: that agrees with anything.
    oracle.see(2, {"e": "uncertain", "tier": "local", "v": 9, "error": "lost the exchange"})
    oracle.check_agreement()
    oracle.see(1, {"e": "fail", "tier": "local", "v": 9, "error": "timed out"})
    with pytest.raises(Finding) as caught:
        oracle.check_agreement()
    assert caught.value.check == "split-decision"
    assert "timed out" in caught.value.message
    # A new incarnation saves the same numbers anew.
    oracle.new_incarnation()
    oracle.see(1, {"e": "fail", "tier": "local", "v": 9, "error": "x"})
    oracle.check_agreement()


def test_the_reference_is_the_models_own_uninterrupted_run() -> None:
    """Two references agree; a state one step off does not (the digests see every step)."""
    a, b = Reference(2, 512), Reference(2, 512)
    assert [a.digest(s, 1) for s in range(6)] == [b.digest(s, 1) for s in range(6)]
    assert len({a.digest(s, 0) for s in range(6)} | {a.digest(s, 1) for s in range(6)}) == 12


# --- real runs ----------------------------------------------------------------------------------

pytest.importorskip("moto.server", reason="moto[server] is not installed (the test extra)")
pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'tiercheck[s3]')")

#: The faults CI draws from: those that pass today without torchrun, named here rather than
#: taken from the catalog, so that a mark changed there does not change CI's schedule.
CI_FAULTS = (
    "kill-rank", "kill-all", "kill-restoring", "term-rank", "term-all", "node-lost",
    "cluster-lost", "damage-blob", "damage-s3-blob", "manifest-cut", "manifest-kill",
    "manifest-cut-live", "fill-memory", "kill-closing", "wipe-live", "damage-live",
    "world-size", "pause-short",
)  # fmt: skip
#: A seed whose first episodes are eight different faults, the three of the node's manifest
#: among them (six restarts and two transient faults, as the schedule before them had).
CI_SEED = 50803
CI_SCHEDULE = [
    "node-lost", "manifest-cut", "world-size", "manifest-cut-live",
    "kill-rank", "cluster-lost", "damage-blob", "manifest-kill",
]  # fmt: skip


def soak(tmp_path: Path, **kw: object) -> tuple[Outcome, list[str]]:
    lines: list[str] = []
    options: dict[str, object] = {"seed": CI_SEED, "faults": CI_FAULTS, "workdir": tmp_path}
    return run(Settings(**{**options, **kw}), lines.append), lines  # type: ignore[arg-type]


def test_ci_draws_what_it_says() -> None:
    assert set(CI_FAULTS) <= set(PASSING)
    drawn = [e.fault for e in itertools.islice(schedule(CI_SEED, CI_FAULTS, 2, 2), 8)]
    assert drawn == CI_SCHEDULE
    assert next(schedule(8, ("kill-all",), 2, 2)).after == 6


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_short_schedule_passes(tmp_path: Path) -> None:
    outcome, lines = soak(tmp_path, episodes=len(CI_SCHEDULE))
    report = "\n".join(lines)
    assert outcome.ok, report
    assert outcome.episodes == len(CI_SCHEDULE), report
    assert outcome.final is not None
    assert outcome.final > 0
    assert not list(tmp_path.iterdir()), "the run's folder is removed after a pass"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("plant", "check"),
    [("flip", "not-bit-exact"), ("lose-newest", "lost-committed"), ("crash", "killed-by-storage")],
)
def test_the_oracle_catches_a_planted_bug(tmp_path: Path, plant: str, check: str) -> None:
    # Seed 8: the job saves 6 versions before the kill, so something is committed by then.
    outcome, lines = soak(tmp_path, seed=8, faults=("kill-all",), episodes=1, plant=plant)
    try:
        assert outcome.finding is not None, "\n".join(lines)
        assert outcome.finding.check == check, "\n".join(lines)
        assert any(line.startswith("  replay: ") and f"--plant {plant}" in line for line in lines)
        assert outcome.workdir is not None
        assert outcome.workdir.is_dir()  # kept for a look
    finally:
        outcome.remove()
    assert outcome.memory is not None
    assert not outcome.memory.exists()


@pytest.mark.multiprocess
def test_an_s3_outage_is_real_and_loses_nothing(tmp_path: Path) -> None:
    from tiercheck.testing.chaos.s3 import S3

    s3 = S3(tmp_path)
    s3.start()
    try:
        s3.client().put_object(Bucket="tiercheck-chaos", Key="k", Body=b"v")
        s3.stop_proxy()
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", s3.proxy_port)) != 0  # refused
        s3.start_proxy()
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", s3.proxy_port)) == 0
        assert list(s3.objects("")) == ["k"]
    finally:
        s3.close()

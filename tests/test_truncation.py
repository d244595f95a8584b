"""Files someone else cuts short: the node's memory truncated while training runs, for real.

An operator's cleanup script, ``truncate``, a second job pointed at the same folder: anything
that can open the files of a node's memory can cut them short while a training process uses
them. A process that touches a mapping of such a file past its new end dies of ``SIGBUS``; no
training process maps any of them (the manifest's ``data.mdb`` is mapped by the node's manifest
process alone, which may die of it and is started again), so these tests hunt the whole class
rather than one case: a training loop in a child process saves every step while this process
truncates files of every kind the node root holds (committed blobs, the blob being written,
spares and prepared memory, the manifest's ``data.mdb``, the identity record, the writers'
locks), picked by a seeded random schedule at random moments, to random sizes. Then:

* the child never dies of a signal, finishes training, and every version still commits in the
  tier nobody touched (the durable one), while the local tier keeps committing what it can;
* a restart -- attacked the same way while it reads -- restores the newest version bit-exact,
  falling back from a damaged local blob to the durable tier; a damaged identity record is
  reported as damaged (``StaleMemory.damaged``), not as another run's memory, and touches
  nothing: with the record put back the memory is used again (and discarding it restores from
  the durable tier, :func:`test_a_damaged_identity_is_reported_as_damaged`).

The manifest's own damage cases (cut to nothing, a few bytes, half; garbled) are in
``tests/consistency/test_manifest.py``, and under a real job in ``tests/test_manifest_faults.py``;
the local tier's, one by one, in ``tests/tiers/test_local.py``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tiercheck import StaleMemory, SyncCheckpointer
from tiercheck.consistency.manifest import JOURNAL, Manifest
from tiercheck.consistency.manifestd import DATA, LOCK
from tiercheck.consistency.records import record_fields
from tiercheck.testing.chaos.cluster import kill_manifest

from .consistency.test_manifest import raw_frame
from .test_never_lose import job, save_versions, state_of

WORKER = r"""
import json, sys, time
from pathlib import Path
import torch
from tiercheck import StaleMemory, SyncCheckpointer

root, mode = Path(sys.argv[1]), sys.argv[2]

def state_of(v):
    g = torch.Generator().manual_seed(v)
    return {"w": torch.randn(1 << 19, generator=g), "h": torch.randn(4096, generator=g).half(),
            "step": v}

def ckpt(**kw):
    return SyncCheckpointer("job", local_root=root / "node0",
                            persistent=(root / "durable").as_uri(),
                            tiers=["local", "persistent"], base_every=3, persist="all",
                            tier_queue=100, **kw)

if mode == "train":
    steps = int(sys.argv[3])
    saved = []
    with ckpt() as c:
        for v in range(steps):
            handle = c.save(v, state_of(v))
            saved.append((v, time.monotonic(), handle))
            time.sleep(0.005)
        c.wait()
        stats = c.stats
    print(json.dumps({
        "errors": {v: {n: s.error for n, s in h.stats.tiers.items() if s.error}
                   for v, _, h in saved},
        "saved": [[v, t, {tier: h.committed(tier) for tier in ("local", "persistent")}]
                  for v, t, h in saved],
        "tier_skips": stats.tier_skips, "failed": stats.failed, "skipped": stats.skipped,
        "manifest_errors": stats.manifest_errors}))
else:
    # The identity record as it was written (sys.argv[3]): put back after a refusal, as the
    # operator told of a damaged record would.
    refused = None
    try:
        with ckpt() as c:
            got = c.restore()
    except StaleMemory as exc:
        refused = {"stale": str(exc), "damaged": list(exc.damaged)}
        (root / "node0" / "identity.json").write_bytes(Path(sys.argv[3]).read_bytes())
        with ckpt() as c:
            got = c.restore()
    want = state_of(got.version)
    exact = all(torch.equal(got.state[k], want[k]) for k in ("w", "h"))
    print(json.dumps({"version": got.version, "source": got.source_tier, "refused": refused,
                      "exact": exact and got.state["step"] == got.version}))
"""

KINDS = (
    "committed-blob",
    "blob-being-written",
    "spare-or-prepared",
    "manifest",
    "identity",
    "lock",
)


def files_of(node: Path, kind: str) -> list[Path]:
    """The files of ``kind`` in the node root now (the tree changes while it is walked)."""
    if kind == "manifest":
        found = [node / "manifest" / DATA]
    elif kind == "identity":
        found = [node / "identity.json"]
    elif kind == "lock":
        found = [Path(d, f) for d, _, fs in os.walk(node / "locks") for f in fs]
    else:
        found = []
        for folder, _, names in os.walk(node / "blobs"):
            spares = ".tiercheck#spares" in folder
            for name in names:
                internal = "#" in name
                if (
                    (kind == "committed-blob" and not internal)
                    or (kind == "blob-being-written" and internal and not spares)
                    or (kind == "spare-or-prepared" and internal and spares)
                ):
                    found.append(Path(folder, name))
    return sorted(p for p in found if p.exists())


class Attacker:
    """Truncates files of the node root on a seeded random schedule; remembers what it did."""

    def __init__(self, node: Path, seed: int) -> None:
        self.node = node
        self.rng = random.Random(seed)
        self.done: list[tuple[float, str, str, int]] = []

    def strike(self, kinds: tuple[str, ...] = KINDS) -> None:
        """Wait a random moment, then cut one file of a random kind (the first to show up
        within 50 ms: a file being written exists only briefly) to a random size."""
        rng = self.rng
        kind = rng.choice(kinds)
        time.sleep(rng.uniform(0, 0.02))
        give_up = time.monotonic() + 0.05
        while time.monotonic() < give_up:
            files = files_of(self.node, kind)
            if not files:
                continue
            target = rng.choice(files)
            try:
                size = target.stat().st_size
                new = rng.choice([0, rng.randint(1, 16), size // 2, rng.randrange(size + 1)])
                os.truncate(target, min(new, size))
            except FileNotFoundError:
                continue  # renamed or removed meanwhile: look again
            self.done.append((time.monotonic(), kind, str(target.relative_to(self.node)), new))
            return

    def while_running(self, proc: Worker, kinds: tuple[str, ...] = KINDS) -> None:
        while proc.poll() is None:
            self.strike(kinds)


@dataclass
class Worker:
    """A worker process and the files its output goes to (a pipe nobody reads while the
    attack lasts would fill up and stall it)."""

    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def poll(self) -> int | None:
        return self.proc.poll()


def start(root: Path, mode: str, *args: str) -> Worker:
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    n = len(list(logs.iterdir())) // 2
    out_file, err_file = logs / f"{n}.out", logs / f"{n}.err"
    with out_file.open("w") as out, err_file.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(root), mode, *args], stdout=out, stderr=err
        )
    return Worker(proc, out_file, err_file)


def outcome(worker: Worker) -> dict[str, Any]:
    worker.proc.wait(timeout=300)
    out, err = worker.out.read_text(), worker.err.read_text()
    # A signal (SIGBUS above all) is a negative return code.
    assert worker.proc.returncode == 0, f"rc={worker.proc.returncode}\n{out}\n{err[-4000:]}"
    result: dict[str, Any] = json.loads(out.splitlines()[-1])
    return result


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("seed", [1, 2])
def test_files_truncated_while_training_never_kill_it(tmp_path: Path, seed: int) -> None:
    steps = 40
    node = tmp_path / "node0"
    attacker = Attacker(node, seed)
    trainer = start(tmp_path, "train", str(steps))
    identity = node / "identity.json"
    while trainer.poll() is None and not (identity.exists() and identity.stat().st_size):
        time.sleep(0.001)
    whole_identity = identity.read_bytes()  # written at opening, before the first save
    attacker.while_running(trainer)
    trained = outcome(trainer)

    kinds = {kind for _, kind, _, _ in attacker.done}
    assert len(attacker.done) > 20
    assert {"committed-blob", "manifest", "identity", "lock"} <= kinds
    saved = trained["saved"]
    assert [v for v, _, _ in saved] == list(range(steps))  # training went to its end
    assert trained["skipped"] == 0
    # The tier nobody touched got every version (its queue is long enough for this machine).
    assert all(c["persistent"] for _, _, c in saved), trained["errors"]
    first = min(t for t, _, _, _ in attacker.done)
    assert any(c["local"] for _, t, c in saved if t > first)  # the local tier went on

    # The newest local blob is cut short; a restart is attacked the same way while it reads.
    for path in files_of(node, "committed-blob"):
        if path.parent.name == f"v{steps - 1:012d}":
            os.truncate(path, path.stat().st_size // 2)
    damaged = identity.read_bytes() != whole_identity
    (tmp_path / "identity.json").write_bytes(whole_identity)
    restarted = start(tmp_path, "restore", str(tmp_path / "identity.json"))
    attacker.while_running(restarted, ("committed-blob", "manifest", "lock"))
    got = outcome(restarted)
    if damaged:
        # The identity record was cut: reported as damaged, not as another run's memory, and
        # nothing was touched; with the record put back, the memory is used again.
        refused = got["refused"]
        assert refused["damaged"] == [0], got
        assert "damaged" in refused["stale"]
        assert "another run" not in refused["stale"]
    else:
        assert got["refused"] is None
    # The newest version, bit-exact, from the durable tier: its local blob is damaged.
    assert got["version"] == steps - 1, got
    assert got["exact"]
    assert got["source"] == "persistent"


def test_a_damaged_identity_is_reported_as_damaged(tmp_path: Path) -> None:
    """An identity record cut short is damage, told apart from memory of another run
    (``StaleMemory.damaged``); nothing is changed, and discarding the memory restores the job
    from its durable tier bit-exact. Over a node whose memory holds nothing, the record is
    simply written anew."""
    save_versions(tmp_path, 1, range(3))
    identity = tmp_path / "node0" / "identity.json"
    whole = identity.read_bytes()
    os.truncate(identity, len(whole) // 2)
    before = sorted(p.name for p in (tmp_path / "node0").rglob("*"))
    with pytest.raises(StaleMemory, match="damaged") as info, job(tmp_path, 0, 1, None) as ckpt:
        ckpt.restore()
    assert info.value.damaged == (0,)
    assert "another run" not in str(info.value)
    assert sorted(p.name for p in (tmp_path / "node0").rglob("*")) == before
    os.truncate(identity, 0)
    with job(tmp_path, 0, 1, None, stale_memory="discard") as ckpt:
        restored = ckpt.restore()
    assert restored is not None
    assert restored.version == 2
    assert restored.source_tier == "persistent"
    assert torch_equal_state(restored.state, state_of(2))
    # A damaged record over empty memory: nothing to protect, the job opens.
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "identity.json").write_bytes(whole[:7])
    with SyncCheckpointer(
        "job", local_root=empty, persistent=(tmp_path / "durable").as_uri(), base_every=2
    ) as ckpt:
        assert ckpt.restore() is not None
    assert (empty / "identity.json").read_bytes() != whole[:7]


def torch_equal_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a["step"] == b["step"] and all(torch.equal(a[k], b[k]) for k in ("w", "h"))


REOPEN_JOBS = r"""
import json, sys
from pathlib import Path
import torch
from tests.test_never_lose import job, state_of

out = {}
for folder in sys.argv[1:]:
    with job(Path(folder), 0, 1, None) as ckpt:
        got = ckpt.restore()
        want = state_of(got.version, 0)
        out[folder] = {
            "version": got.version,
            "source": got.source_tier,
            "exact": all(torch.equal(got.state[k], want[k]) for k in ("w", "h"))
            and got.state["step"] == want["step"],
            "manifest_errors": ckpt.stats.manifest_errors,
            "set_aside": ckpt.stats.manifest_set_aside,
        }
        ckpt.save(got.version + 1, state_of(got.version + 1, 0))  # and the job goes on
        ckpt.wait()
print(json.dumps(out))
"""

JOURNAL_DAMAGE = ["zero", "few-bytes", "half", "garbled-format", "garbled-record", "lmdb-garbled"]


def as_journal_of_0_1(node: Path) -> Path:
    """Make the node root ``node`` one tiercheck 0.1 left: its manifest's records in a
    ``journal`` (written from its specification), no LMDB environment. Returns the journal."""
    folder = node / "manifest"
    with Manifest(folder) as m:
        records = list(m.log())
    assert records
    kill_manifest(folder)  # the job is over: nothing serves the environment any more
    for name in (DATA, LOCK):
        (folder / name).unlink()
    path = folder / JOURNAL
    path.write_bytes(
        raw_frame({"meta": {"format": 1, "compacted": 0}})
        + b"".join(raw_frame({"records": [record_fields(r)]}) for r in records)
    )
    return path


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_damaged_journal_of_0_1_costs_history_never_data(tmp_path: Path) -> None:
    """A node root tiercheck 0.1 left, its manifest journal cut to nothing, to a few bytes, to
    half, garbled in its format frame or in a record -- or whole, beside an LMDB ``data.mdb`` of
    garbage cut in half: reopening the job (in a child process, where a SIGBUS would be a
    negative return code) restores the newest version bit-exact and goes on saving. What can be
    read of the journal is carried over (``journal.carried-over``); one with nothing readable is
    set aside (``journal.damaged-*``); the garbage environment is set aside
    (``stats.manifest_set_aside``). None of it is a manifest error: the job never runs without
    its manifest."""
    folders = []
    for damage in JOURNAL_DAMAGE:
        root = tmp_path / damage
        save_versions(root, 1, range(5))
        path = as_journal_of_0_1(root / "node0")
        size = path.stat().st_size
        if damage in ("zero", "few-bytes", "half"):
            os.truncate(path, {"zero": 0, "few-bytes": 5, "half": size // 2}[damage])
        elif damage == "lmdb-garbled":
            (path.parent / DATA).write_bytes(os.urandom(65536))
            os.truncate(path.parent / DATA, 32768)
        else:
            data = bytearray(path.read_bytes())
            data[2 if damage == "garbled-format" else size // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        folders.append(root)
    run = subprocess.run(
        [sys.executable, "-c", REOPEN_JOBS, *map(str, folders)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, f"rc={run.returncode}\n{run.stdout}\n{run.stderr[-4000:]}"
    got = json.loads(run.stdout.splitlines()[-1])
    for damage, root in zip(JOURNAL_DAMAGE, folders, strict=True):
        outcome = got[str(root)]
        assert outcome["version"] == 4, (damage, outcome)
        assert outcome["exact"], damage
        assert outcome["manifest_errors"] == 0, (damage, outcome)
        assert outcome["set_aside"] == (damage == "lmdb-garbled"), (damage, outcome)
        folder = root / "node0" / "manifest"
        left = sorted(p.name for p in folder.iterdir() if p.name.startswith(JOURNAL))
        readable = damage in ("half", "garbled-record", "lmdb-garbled")
        assert len(left) == 1, (damage, left)
        assert left[0].startswith(
            f"{JOURNAL}.carried-over" if readable else f"{JOURNAL}.damaged-"
        ), (damage, left)
    assert "running without a manifest" not in run.stderr
    # And every one of them still restores in this process too, the saved version included.
    for root in folders:
        with job(root, 0, 1, None) as ckpt:
            restored = ckpt.restore()
        assert restored is not None
        assert restored.version == 5
        assert torch_equal_state(restored.state, state_of(5))

"""The soak's processes: one incarnation of the job (its ranks, real processes in a gloo group
on loopback), their event files, signals, exits, and the nodes' memory roots.

Ranks are started as a launcher would start them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``; rank 0 hosts the group's store), ``ranks_per_node`` per
simulated node, each node with a memory root of its own under the run's folder in
``/dev/shm``. Every rank's output goes to a file of its own in the run's folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tiercheck.consistency.manifestd import DATA
from tiercheck.testing.chaos.s3 import S3_ENV, free_port
from tiercheck.testing.chaos.worker import PLANTS as WORKER_PLANTS

__all__ = [
    "VANISHED",
    "EventFile",
    "Incarnation",
    "JobSpec",
    "Launcher",
    "RankProcess",
    "kill_manifest",
    "manifest_processes",
    "stored_blobs",
    "wipe",
]


@dataclass(frozen=True)
class JobSpec:
    """How every incarnation of the soak's job is started."""

    job: str
    #: Parent of the node roots (``node<i>``), under ``/dev/shm``.
    memory: Path
    persistent: str
    storage_options: dict[str, Any]
    #: Where each incarnation's event and output files go.
    out: Path
    ranks_per_node: int
    size: int
    base_every: int
    peer_timeout: float
    close_timeout: float
    step_seconds: float
    #: A planted bug for the worker (see ``--plant``), or ``None``.
    plant: str | None = None

    def node_root(self, node: int) -> Path:
        """Node ``node``'s memory root."""
        return self.memory / f"node{node}"


class EventFile:
    """The events of one rank, read as they are written (only whole lines)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.events: list[dict[str, Any]] = []
        self.latest: dict[str, dict[str, Any]] = {}

    def read(self) -> list[dict[str, Any]]:
        """The events written since the last call."""
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *whole, self.partial = data.split(b"\n")
        new = [json.loads(line) for line in whole if line]
        self.events += new
        for event in new:
            self.latest[event["e"]] = event
        return new

    def of(self, kind: str) -> list[dict[str, Any]]:
        """The events called ``kind`` read so far."""
        return [e for e in self.events if e["e"] == kind]

    def last(self, kind: str) -> dict[str, Any] | None:
        """The last event called ``kind`` read so far."""
        return self.latest.get(kind)


#: The exit code the driver gives a rank that ended by a signal it did not send (its launcher's).
VANISHED = -1000

Launcher = Literal["plain", "torchrun"]


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


@dataclass
class RankProcess:
    """One rank of an incarnation: the driver's child (``proc``), or its launcher's."""

    rank: int
    node: int
    proc: subprocess.Popen[bytes] | None
    events: EventFile
    output: Path
    #: The signals the driver sent it, in order.
    signalled: list[int] = field(default_factory=list)
    stopped: bool = False
    returncode: int | None = None

    @property
    def pid(self) -> int | None:
        """Its process id (under a launcher: once it reported it)."""
        if self.proc is not None:
            return self.proc.pid
        start = self.events.last("start")
        return None if start is None else int(start["pid"])

    def send(self, sig: int) -> None:
        """Send ``sig`` (recorded; a process that is gone already is left alone)."""
        pid = self.pid
        if pid is None or self.poll() is not None:
            return
        self.signalled.append(sig)
        self.stopped = sig == signal.SIGSTOP or (self.stopped and sig != signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def poll(self) -> int | None:
        """The exit code once it ended (negative: the signal that ended it; :data:`VANISHED`:
        ended by a signal from someone else than the driver)."""
        if self.returncode is not None:
            return self.returncode
        if self.proc is not None:
            self.returncode = self.proc.poll()
            return self.returncode
        pid = self.pid
        if pid is None or _running(pid):
            return None
        self.events.read()  # its last words may have come just now
        ended = self.events.last("exit")
        if ended is not None:
            self.returncode = int(ended["code"])
        else:
            self.returncode = -self.signalled[-1] if self.signalled else VANISHED
        return self.returncode

    def vanish(self) -> None:
        """Its launcher is gone and it never started."""
        if self.returncode is None and self.pid is None:
            self.returncode = VANISHED

    @property
    def step(self) -> int:
        """The newest version it saved or restored (-1 before either)."""
        last = self.events.last("step") or self.events.last("restored")
        return -1 if last is None else int(last["v"])

    def tail(self, lines: int = 30) -> str:
        """The end of its output."""
        try:
            text = self.output.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Incarnation:
    """One launch of the job: ``world`` ranks started together, by the driver itself
    (``plain``) or by one ``torchrun`` per node (``torchrun``, static rendezvous on loopback,
    node 0's launcher hosting the job's store)."""

    def __init__(
        self,
        spec: JobSpec,
        number: int,
        world: int,
        *,
        restore_only: bool,
        launcher: Launcher = "plain",
    ) -> None:
        self.spec = spec
        self.number = number
        self.world = world
        self.launcher = launcher
        self.folder = spec.out / f"inc{number:04d}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.stop_file = self.folder / "STOP"
        self.started = time.monotonic()
        port = free_port()
        per_node = spec.ranks_per_node
        base_env = {
            **os.environ,
            **S3_ENV,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TIERCHECK_RANKS_PER_NODE": str(per_node),
            "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",
        }
        worker = ["-m", "tiercheck.testing.chaos.worker", *self._worker_args(restore_only)]
        self.ranks: list[RankProcess] = []
        self.agents: list[subprocess.Popen[bytes]] = []
        if launcher == "torchrun":
            nodes = world // per_node
            for node in range(nodes):
                command = [
                    sys.executable, "-m", "torch.distributed.run",
                    f"--nnodes={nodes}", f"--node-rank={node}", f"--nproc-per-node={per_node}",
                    "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}",
                    "--max-restarts=0", "--monitor-interval=0.1", *worker,
                ]  # fmt: skip
                self.agents.append(self._spawn(command, base_env, f"agent{node}.out"))
        for rank in range(world):
            proc = None
            output = self.folder / f"r{rank}.out"
            if launcher == "plain":
                env = {
                    **base_env,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(rank % per_node),
                    "LOCAL_WORLD_SIZE": str(per_node),
                    "GROUP_RANK": str(rank // per_node),
                }
                proc = self._spawn([sys.executable, *worker], env, output.name)
            events = EventFile(self.folder / f"r{rank}.jsonl")
            self.ranks.append(RankProcess(rank, rank // per_node, proc, events, output))

    def _worker_args(self, restore_only: bool) -> list[str]:
        spec = self.spec
        return [
            "--job", spec.job, "--root", str(spec.memory),
            "--persistent", spec.persistent,
            "--storage-options", json.dumps(spec.storage_options),
            "--events", str(self.folder), "--stop-file", str(self.stop_file),
            "--size", str(spec.size), "--base-every", str(spec.base_every),
            "--peer-timeout", str(spec.peer_timeout),
            "--close-timeout", str(spec.close_timeout),
            "--step-seconds", str(spec.step_seconds),
            *(["--restore-only"] if restore_only else []),
            *(["--plant", spec.plant] if spec.plant in WORKER_PLANTS else []),
        ]  # fmt: skip

    def _spawn(self, command: list[str], env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
        with (self.folder / name).open("ab") as out:
            return subprocess.Popen(
                command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the driver's Ctrl-C is the driver's to handle
            )

    def read(self) -> list[tuple[int, dict[str, Any]]]:
        """Every rank's new events, as (rank, event)."""
        return [(r.rank, e) for r in self.ranks for e in r.events.read()]

    def alive(self) -> list[RankProcess]:
        """The ranks that have not ended."""
        for node, agent in enumerate(self.agents):
            if agent.poll() is not None:
                for r in self.on_node(node):
                    r.vanish()
        return [r for r in self.ranks if r.poll() is None]

    def on_node(self, node: int) -> list[RankProcess]:
        """The ranks of node ``node``."""
        return [r for r in self.ranks if r.node == node]

    def min_step(self) -> int:
        """The newest version every rank saved."""
        return min(r.step for r in self.ranks)

    def max_step(self) -> int:
        """The newest version any rank saved."""
        return max(r.step for r in self.ranks)

    def stop(self) -> None:
        """Ask the ranks to end (they agree on the step through the all-reduce)."""
        self.stop_file.touch()

    def dump_stacks(self) -> None:
        """Every live rank writes its threads' stacks into its output (faulthandler)."""
        for r in self.alive():
            pid = r.pid
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    if r.stopped:
                        os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)

    def kill(self) -> None:
        """SIGKILL every rank and launcher still alive; reap them all."""
        for r in self.alive():
            r.send(signal.SIGKILL)
        for agent in self.agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGKILL)
            agent.wait()
        for r in self.ranks:
            if r.proc is not None:
                r.proc.wait()
        deadline = time.monotonic() + 10
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def reap_agents(self, timeout: float) -> list[int | None]:
        """Wait up to ``timeout`` s for the launchers to exit; their exit codes (``None``: one
        still runs, and was killed)."""
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for agent in self.agents:
            try:
                codes.append(agent.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                agent.send_signal(signal.SIGKILL)
                agent.wait()
                codes.append(None)
        return codes


def wipe(root: Path) -> None:
    """A node's memory is gone: its root disappears at once (a rename), then is removed."""
    if not root.exists():
        return
    gone = root.with_name(f"{root.name}-lost-{time.monotonic_ns()}")
    root.rename(gone)
    shutil.rmtree(gone, ignore_errors=True)


def stored_blobs(memory: Path) -> dict[str, tuple[int, int]]:
    """Every version's blob in the node roots under ``memory``: path -> (size, mtime ns)."""
    found = {}
    for path in sorted(memory.rglob("v*/*")):
        if path.is_file() and "#" not in path.name and not path.name.startswith("."):
            st = path.stat()
            found[str(path.relative_to(memory))] = (st.st_size, st.st_mtime_ns)
    return found


def manifest_processes(folder: Path, *, serving: bool = False) -> list[int]:
    """The pids of the manifest processes of the manifest folder ``folder``, found by the end of
    their command line (``--detach FOLDER``, as a client starts one: a starter about to fork one
    matches too). ``serving``: only the one that maps the folder's environment now (not a
    starter, nor a second server that found the folder taken)."""
    want = os.path.realpath(folder).encode()
    data = os.path.join(os.path.realpath(folder), DATA)
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                args = [a for a in f.read().split(b"\0") if a]
            if args[-2:] != [b"--detach", want]:
                continue
            if serving:
                with open(f"/proc/{name}/maps") as f:
                    if not any(line.rstrip("\n").endswith(" " + data) for line in f):
                        continue
        except OSError:
            continue  # gone meanwhile
        if _running(int(name)):
            found.append(int(name))
    return found


def kill_manifest(folder: Path, timeout: float = 10.0) -> list[int]:
    """SIGKILL every manifest process of ``folder`` and wait until they are gone; their pids."""
    pids = manifest_processes(folder)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    return pids

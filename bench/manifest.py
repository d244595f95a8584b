"""The node's manifest: what it costs a save, and what opening one with a long history costs.

Two manifests in one run, on the same records:

* ``journal``: the manifest of tiercheck before the LMDB environment came back (a journal file
  read with ``pread``, the index replayed in every process), loaded from the git history
  (commit ``BASELINE``) -- the "before";
* ``lmdb``: the LMDB environment behind the node's manifest process (the "after").

Figures:

* **per save**: one rank's four appends of a save (``begin``, ``durable``, ``commit``, and the
  ``evict`` of the version retention drops), repeated ``--saves`` times; CPU of the calling
  process (``time.process_time``) and, for ``lmdb``, of its manifest process too (from
  ``/proc``), in ms a save; and the wall time of one append.
* **opening** with ``--records`` records in the log: a new handle in a new process's view (the
  journal replays the file; ``lmdb`` connects to the running manifest process, or -- ``cold``
  -- starts one, which checks the environment at rest and walks it with ``lmdb.verify`` before
  it maps it).

Usage::

    python bench/manifest.py [--saves 2000] [--records 100000] [--repeats 3]

Prints medians and ratios (lmdb / journal); writes ``bench/results/manifest.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment

from tiercheck.consistency import manifestd
from tiercheck.consistency.manifest import Manifest
from tiercheck.consistency.records import Begin, Commit, Evict, Written

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
#: The last commit with the journal manifest.
BASELINE = "308dafc"


def load_journal_manifest() -> type[Any] | None:
    """The journal's ``Manifest`` class of commit :data:`BASELINE`, from git, or ``None``."""
    sources = {}
    for name in ("journal_file", "manifest"):
        shown = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{BASELINE}:tiercheck/consistency/{name}.py"],
            capture_output=True,
            text=True,
            check=False,
        )
        if shown.returncode != 0:
            print(f"no baseline: git show failed ({shown.stderr.strip()})")
            return None
        sources[name] = shown.stdout
    journal_file = types.ModuleType("tiercheck.consistency.journal_file")
    sys.modules[journal_file.__name__] = journal_file
    exec(compile(sources["journal_file"], "journal_file@baseline", "exec"), journal_file.__dict__)  # noqa: S102 -- our own code, from our own history
    spec = importlib.util.spec_from_loader("baseline_manifest", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_manifest"] = module
    exec(compile(sources["manifest"], "manifest@baseline", "exec"), module.__dict__)  # noqa: S102
    cls: type[Any] = module.Manifest
    return cls


def save_records(v: int) -> list[list[Any]]:
    """The appends one rank makes for save ``v`` (retention keeping two versions)."""
    appends: list[list[Any]] = [
        [Begin(v, 0, "base")],
        [Written(v, 0, "local", f"v{v:012d}/r00000.full", 1 << 20, v, v)],
        [Commit(v, "local")],
    ]
    if v >= 2:
        appends.append([Evict(v - 2, 0, "local")])
    return appends


def server_cpu(pid: int | None) -> float:
    """CPU seconds of process ``pid`` so far (user + system), 0 when unknown."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_save(open_manifest: Callable[[str], Any], folder: str, saves: int) -> dict[str, float]:
    m = open_manifest(folder)
    try:
        pid = getattr(m, "server_pid", None)
        for v in range(50):  # warm up
            for records in save_records(v):
                m.append(*records)
        cpu0, server0, wall0 = time.process_time(), server_cpu(pid), time.perf_counter()
        for v in range(50, 50 + saves):
            for records in save_records(v):
                m.append(*records)
        cpu = time.process_time() - cpu0
        server = server_cpu(pid) - server0
        wall = time.perf_counter() - wall0
    finally:
        m.close()
    appends = sum(len(save_records(v)) for v in range(50, 50 + saves))
    return {
        "client_ms_per_save": 1e3 * cpu / saves,
        "server_ms_per_save": 1e3 * server / saves,
        "cpu_ms_per_save": 1e3 * (cpu + server) / saves,
        "append_us": 1e6 * wall / appends,
    }


def fill(open_manifest: Callable[[str], Any], folder: str, records: int) -> None:
    m = open_manifest(folder)
    batch: list[Any] = []
    for v in range(records // 4):
        batch += [
            Begin(v, 0, "base"),
            Written(v, 0, "local", f"v{v:012d}/r00000.full", 1 << 20, v, v),
            Commit(v, "local"),
            Evict(v, 0, "local"),
        ]
        if len(batch) >= 4000:
            m.append(*batch)
            batch = []
    if batch:
        m.append(*batch)
    m.close()


def stop_server(folder: str) -> None:
    with Manifest(folder) as m:
        pid = m.server_pid
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    while manifestd.served(folder):
        time.sleep(0.005)


def opening(open_manifest: Callable[[str], Any], folder: str) -> float:
    t0 = time.perf_counter()
    m = open_manifest(folder)
    m.committed("local")  # the first question a job asks
    elapsed = time.perf_counter() - t0
    m.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saves", type=int, default=2000)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    journal = load_journal_manifest()
    kinds: dict[str, Callable[[str], Any]] = {"lmdb": Manifest}
    if journal is not None:
        kinds["journal"] = journal
    base = Path(tempfile.mkdtemp(prefix="tiercheck-bench-manifest-", dir="/dev/shm"))
    rows: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}
    try:
        for r in range(args.repeats):
            for kind, opener in kinds.items():
                got = per_save(opener, str(base / f"{kind}-save-{r}"), args.saves)
                for key, value in got.items():
                    rows[kind].setdefault(key, []).append(value)
        for kind, opener in kinds.items():
            folder = str(base / f"{kind}-open")
            fill(opener, folder, args.records)
            for _ in range(args.repeats):
                rows[kind].setdefault("open_s", []).append(opening(opener, folder))
            if kind == "lmdb":
                for _ in range(args.repeats):
                    stop_server(folder)
                    rows[kind].setdefault("open_cold_s", []).append(opening(opener, folder))
    finally:
        for entry in base.iterdir():
            if (entry / "server.lock").exists():
                subprocess.run(["pkill", "-f", str(entry)], check=False)
        subprocess.run(["rm", "-rf", str(base)], check=False)
    medians = {k: {m: statistics.median(v) for m, v in got.items()} for k, got in rows.items()}
    for kind, got in medians.items():
        print(f"{kind:8s} " + "  ".join(f"{m} {v:.4g}" for m, v in got.items()))
    ratios = {}
    if "journal" in medians:
        j, lm = medians["journal"], medians["lmdb"]
        ratios = {
            "cpu_per_save_lmdb_over_journal": lm["cpu_ms_per_save"] / j["cpu_ms_per_save"],
            "client_cpu_per_save_lmdb_over_journal": lm["client_ms_per_save"]
            / j["client_ms_per_save"],
            "append_wall_lmdb_over_journal": lm["append_us"] / j["append_us"],
            "open_lmdb_over_journal": lm["open_s"] / j["open_s"],
            "open_cold_lmdb_over_journal": lm["open_cold_s"] / j["open_s"],
        }
        for name, value in ratios.items():
            print(f"{name}: {value:.3f}x")
    RESULTS.mkdir(exist_ok=True)
    out = {
        "environment": environment(),
        "args": vars(args),
        "baseline": BASELINE,
        "medians": medians,
        "ratios": ratios,
        "runs": rows,
    }
    (RESULTS / "manifest.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

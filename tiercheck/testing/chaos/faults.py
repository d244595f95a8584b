"""How each fault of the catalog is produced, for real, and what is checked after it.

One function per :class:`~tiercheck.testing.chaos.catalog.Fault`, in :data:`HANDLERS`; each
takes the soak and the episode, makes the fault happen (signals to real processes, folders of
real shared memory wiped or cut, the S3 endpoint taken down) and then either restarts the job
and checks the restore (:meth:`~tiercheck.testing.chaos.soak.Soak.restart`) or, for a transient
fault, checks that commits resume (:meth:`~tiercheck.testing.chaos.soak.Soak.expect_resume`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from tiercheck.consistency.manifest import Manifest
from tiercheck.consistency.manifestd import DAMAGED_PREFIX, DATA
from tiercheck.defaults import MANIFEST_DIR
from tiercheck.errors import ManifestError
from tiercheck.testing.chaos.catalog import CATALOG, TIERS, Episode
from tiercheck.testing.chaos.cluster import (
    kill_manifest,
    manifest_processes,
    stored_blobs,
    wipe,
)
from tiercheck.testing.chaos.oracle import Finding
from tiercheck.testing.chaos.soak import Soak, restores_of

__all__ = ["HANDLERS", "MANIFEST_RESUME_S", "finish", "lose_newest"]

#: Seconds within which a node's manifest must record commits again after a manifest fault
#: (its process is started again at the next append; one that could not start is tried again
#: 10 s later).
MANIFEST_RESUME_S = 30.0


def _restart(
    soak: Soak,
    ep: Episode,
    survivors: tuple[str, ...] | None = None,
    floor: tuple[int, str] | None = None,
) -> None:
    fault = CATALOG[ep.fault]
    assert fault.survivors is not None
    if soak.settings.plant == "lose-newest":
        lose_newest(soak)
    soak.restart(
        fault.survivors if survivors is None else survivors,
        ep.describe(soak.settings.peer_timeout),
        floor,
        degrade=fault.degrades,
    )


def lose_newest(soak: Soak) -> None:
    """The planted bug ``lose-newest``: the newest version reported committed in memory, and
    every later one, disappear from every memory root, behind the oracle's back (tiers that
    lose what they committed)."""
    known = [v for t in ("local", "peer") if (v := soak.oracle.known[t]) is not None]
    if not known:
        return
    for path in sorted(soak.memory.rglob("v*")):
        version = path.name.removeprefix("v")
        if path.is_dir() and version.isdigit() and int(version) >= max(known):
            wipe(path)


def kill_rank(soak: Soak, ep: Episode, sig: int = signal.SIGKILL) -> None:
    job = soak.job
    soak.crash([job.ranks[ep.rank % job.world]], sig)
    _restart(soak, ep)


def kill_all(soak: Soak, ep: Episode, sig: int = signal.SIGKILL) -> None:
    soak.crash(soak.job.ranks, sig)
    _restart(soak, ep)


def kill_restoring(soak: Soak, ep: Episode) -> None:
    soak.crash(soak.job.ranks, signal.SIGKILL)
    inc = soak.launch()
    # Once every rank is in the group (a rank killed before would leave the others waiting in
    # torch's rendezvous, which is the launcher's to end, not tiercheck's).
    soak.until(lambda: all(r.events.last("joined") for r in inc.ranks), "the ranks join")
    soak.wait(ep.seconds(0.0, 1.5), exits_allowed=True)
    restored = [r.rank for r in inc.ranks if r.events.last("restored") or r.events.last("fresh")]
    soak.log(f"    killing rank {ep.rank % inc.world} (ranks {restored} had restored)")
    soak.crash([inc.ranks[ep.rank % inc.world]], signal.SIGKILL, restoring=True)
    soak.release()  # what it committed after its restore (if it got that far) is committed
    _restart(soak, ep)


def node_lost(soak: Soak, ep: Episode) -> None:
    node = ep.node % soak.settings.nodes
    soak.crash(soak.job.on_node(node), signal.SIGKILL)
    # The ranks are dead before their memory goes; the others have left by now, which is as
    # good: nothing the node held is read by anyone until the restart.
    wipe(soak.spec.node_root(node))
    _restart(soak, ep)


def cluster_lost(soak: Soak, ep: Episode, sig: int = signal.SIGKILL) -> None:
    soak.crash(soak.job.ranks, sig)
    for node in range(soak.settings.nodes):
        wipe(soak.spec.node_root(node))
    _restart(soak, ep)


def _blobs_under(root: Path) -> list[Path]:
    """The blob files under a node's memory (``v*/r*``, no temporary ``#`` ones). ``os.walk``
    passes over a folder that a live job removes while it is listed (``Path.rglob`` raises
    ``FileNotFoundError`` there: soak seed 4102)."""
    found: list[Path] = []
    for folder, _, files in os.walk(root):
        if Path(folder).name.startswith("v"):
            found.extend(Path(folder) / f for f in files if f.startswith("r") and "#" not in f)
    return found


def _damage(soak: Soak, ep: Episode) -> str | None:
    """Cut or flip a bit in one of the newest blobs of a node; the blob's tier (``None``: none
    was found)."""
    root = soak.spec.node_root(ep.node % soak.settings.nodes)
    blobs = sorted(_blobs_under(root))
    newest = sorted({p.parent.name for p in blobs})[-2:]
    candidates = [p for p in blobs if p.parent.name in newest]
    if not candidates:
        soak.log("    no blob to damage")
        return None
    victim = candidates[ep.pick % len(candidates)]
    try:
        size = victim.stat().st_size
        if ep.pick % 2:
            os.truncate(victim, size // 2)
            how = f"cut from {size} to {size // 2} bytes"
        else:
            with victim.open("r+b") as f:
                f.seek(size // 2)
                byte = f.read(1)[0]
                f.seek(size // 2)
                f.write(bytes([byte ^ 0x10]))
            how = f"bit 4 of byte {size // 2} flipped"
    except (FileNotFoundError, IndexError):  # retention took it meanwhile (a live job)
        soak.log(f"    {victim.relative_to(soak.memory)} went before it could be damaged")
        return None
    tier = "local" if "blobs" in victim.relative_to(root).parts else "peer"
    soak.log(f"    {victim.relative_to(soak.memory)} ({tier}): {how}")
    return tier


def damage_blob(soak: Soak, ep: Episode) -> None:
    soak.crash(soak.job.ranks, signal.SIGKILL)
    tier = _damage(soak, ep)
    _restart(soak, ep, tuple(t for t in TIERS if t != tier))


def damage_live(soak: Soak, ep: Episode) -> None:
    tier = _damage(soak, ep)
    # The damaged blob may be read by the live job (a restore, a peer's get) before the kill.
    soak.wait(0.5)
    soak.crash(soak.job.ranks, signal.SIGKILL)
    _restart(soak, ep, tuple(t for t in TIERS if t != tier))


def wipe_live(soak: Soak, ep: Episode) -> None:
    node = ep.node % soak.settings.nodes
    wipe(soak.spec.node_root(node))
    soak.oracle.lose(["local", "peer"])
    soak.expect_resume(ep.describe(soak.settings.peer_timeout))


def kill_closing(soak: Soak, ep: Episode) -> None:
    job = soak.job
    job.stop()
    soak.wait(ep.scale, exits_allowed=True)
    soak.crash([job.ranks[ep.rank % job.world]], signal.SIGKILL, closing=True)
    _restart(soak, ep)


def damage_s3_blob(soak: Soak, ep: Episode) -> None:
    soak.crash(soak.job.ranks, signal.SIGKILL)
    job = f"{soak.prefix}{soak.spec.job}/"
    present = {k.removeprefix(job) for k in soak.s3.objects(job)}
    # Versions reported committed in S3 whose COMMIT record is still there (not retired), and
    # that no earlier episode damaged.
    committed = sorted(
        {
            v
            for t, v in soak.oracle.commits
            if t == "persistent" and f"v{v:012d}/COMMIT" in present and v not in soak.damaged
        }
    )
    floor: tuple[int, str] | None = None
    if len(committed) < 2:
        soak.log(f"    {len(committed)} undamaged version(s) committed in S3: nothing damaged")
    else:
        newest, floor = committed[-1], (committed[-2], "persistent (undamaged)")
        soak.damaged.add(newest)
        key = (
            job
            + sorted(k for k in present if k.startswith(f"v{newest:012d}/r"))[
                ep.pick % soak.settings.world
            ]
        )
        client = soak.s3.client()
        body = client.get_object(Bucket=soak.s3.bucket, Key=key)["Body"].read()
        client.put_object(Bucket=soak.s3.bucket, Key=key, Body=body[: len(body) // 2])
        soak.log(f"    {key.removeprefix(soak.prefix)}: cut from {len(body)} to {len(body) // 2}")
    survivors: tuple[str, ...] = ("local", "peer")
    if ep.scale < 0.5:
        for node in range(soak.settings.nodes):
            wipe(soak.spec.node_root(node))
        survivors = ()
    soak.oracle.lose(["persistent"])
    _restart(soak, ep, survivors, floor)


def _manifest_folder(soak: Soak, ep: Episode) -> Path:
    """The manifest folder of the node ``ep`` hits."""
    return soak.spec.node_root(ep.node % soak.settings.nodes) / MANIFEST_DIR


def _cut_data(soak: Soak, ep: Episode, folder: Path) -> None:
    """Cut the environment's ``data.mdb`` in ``folder`` to :attr:`Episode.scale` of its length."""
    data = folder / DATA
    try:
        size = data.stat().st_size
        os.truncate(data, int(size * ep.scale))
    except FileNotFoundError:  # set aside meanwhile (a new one is being made), or never made
        soak.log(f"    no {DATA} in {folder.relative_to(soak.memory)} to cut")
        return
    soak.log(f"    cut {data.relative_to(soak.memory)} from {size} to {int(size * ep.scale)}")


def _manifest_resumes(soak: Soak, folder: Path, after: int) -> None:
    """The node's manifest records commits again: a version newer than ``after`` committed in
    the local tier, within :data:`MANIFEST_RESUME_S` (the job's own commits resumed already).
    History only -- but a manifest that never comes back would lose all of it from then on."""
    deadline = time.monotonic() + MANIFEST_RESUME_S
    newest: int | None = None
    # The ranks append at every save: let them reach the node's new manifest process first (the
    # first client it greets is told what it set aside: a rank, not this probe).
    soak.wait(1.0)
    while True:
        try:
            with Manifest(folder) as m:
                newest = max(m.committed("local"), default=None)
            for note in m.notes:
                soak.log(f"    (told this probe, not a rank: {note})")
        except ManifestError as exc:
            soak.log(f"    (the manifest cannot be asked yet: {exc})")
        if newest is not None and newest > after:
            soak.log(f"    the node's manifest records commits again (v{newest} in local)")
            return
        if time.monotonic() > deadline:
            raise Finding(
                "manifest-stuck",
                f"{MANIFEST_RESUME_S:.0f} s after the fault, the manifest at {folder} records no "
                f"version newer than v{after} committed in the local tier (newest: {newest}), "
                "though the job commits there again",
            )
        soak.wait(0.2)


def manifest_cut(soak: Soak, ep: Episode) -> None:
    soak.crash(soak.job.ranks, signal.SIGKILL)
    folder = _manifest_folder(soak, ep)
    # At rest: the node's manifest process goes too (it would exit by itself once idle).
    killed = kill_manifest(folder)
    soak.log(f"    node {ep.node % soak.settings.nodes}'s manifest process(es) {killed} killed")
    _cut_data(soak, ep, folder)
    _restart(soak, ep)
    aside = sorted(p.name for p in folder.glob(f"{DAMAGED_PREFIX}*"))
    soak.log(f"    set aside in the manifest folder so far: {aside or 'nothing'}")


def manifest_kill(soak: Soak, ep: Episode) -> None:
    folder = _manifest_folder(soak, ep)
    after = soak.job.max_step()
    pids = manifest_processes(folder, serving=True)
    waited = time.monotonic() + 2.0
    while not pids and time.monotonic() < waited:  # a new one being started (after a wipe)
        soak.wait(0.1)
        pids = manifest_processes(folder, serving=True)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    soak.log(f"    killed {pids or 'nothing: no manifest process serves the node now'}")
    soak.expect_resume(ep.describe(soak.settings.peer_timeout))
    _manifest_resumes(soak, folder, after)


def manifest_cut_live(soak: Soak, ep: Episode) -> None:
    folder = _manifest_folder(soak, ep)
    after = soak.job.max_step()
    _cut_data(soak, ep, folder)
    soak.expect_resume(ep.describe(soak.settings.peer_timeout))
    _manifest_resumes(soak, folder, after)


def fill_memory(soak: Soak, ep: Episode) -> None:
    if soak.tmpfs_refused is not None:
        soak.log(f"    skipped: {soak.tmpfs_refused}")
        return
    ballast = soak.memory / "ballast"
    with ballast.open("wb") as f:
        st = os.statvfs(soak.memory)
        free = st.f_bavail * st.f_frsize
        try:
            os.posix_fallocate(f.fileno(), 0, free)
        except OSError:  # some pages went meanwhile: a little less fills it just as well
            os.posix_fallocate(f.fileno(), 0, max(0, free - (1 << 20)))
    soak.log(f"    {os.statvfs(soak.memory).f_bavail * st.f_frsize} bytes left free")
    try:
        soak.wait(ep.seconds(1, 4))
    finally:
        ballast.unlink()
    soak.expect_resume(ep.describe(soak.settings.peer_timeout))


def world_size(soak: Soak, ep: Episode) -> None:
    settings = soak.settings
    soak.crash(soak.job.ranks, signal.SIGKILL)
    world = settings.world
    other = (
        world - settings.ranks_per_node
        if ep.scale < 0.5 and world > 1
        else world + settings.ranks_per_node
    )
    if other < 1:
        other = world + settings.ranks_per_node
    blobs, objects = stored_blobs(soak.memory), soak.s3.objects(soak.prefix)
    inc = soak.launch(other)
    got = soak.started(exits_allowed=True)
    soak.crash([], signal.SIGKILL, restoring=True)  # wait for every rank to end
    soak.release()
    wrong = {
        r: f"{e['e']} {e.get('error', e.get('v'))}"
        for r, e in got.items()
        if e["e"] != "refused" or e.get("error") != "WorldSizeMismatch"
    }
    if wrong or any(r.returncode != 3 for r in inc.ranks):
        raise Finding(
            "not-refused",
            f"a relaunch on {other} ranks (the job has {world}) was not refused by every rank "
            f"with WorldSizeMismatch: {wrong or {r.rank: r.returncode for r in inc.ranks}}",
        )
    if stored_blobs(soak.memory) != blobs or soak.s3.objects(soak.prefix) != objects:
        raise Finding(
            "changed-stored", f"a refused relaunch on {other} ranks changed what was stored"
        )
    soak.log(f"    {other} ranks refused with WorldSizeMismatch; nothing stored changed")
    _restart(soak, ep)


def pause(soak: Soak, ep: Episode) -> None:
    p = soak.settings.peer_timeout
    seconds = (
        ep.seconds(1.5 * p, 3 * p) if ep.fault == "pause-long" else ep.seconds(0.2 * p, 0.6 * p)
    )
    rank = ep.rank % soak.job.world
    r = soak.job.ranks[rank]
    began = time.time()
    r.send(signal.SIGSTOP)
    soak.wait(seconds)
    # Said before the SIGCONT: the rank's next event, written after it, finds it known.
    soak.oracle.was_stopped(rank, began, time.time())
    r.send(signal.SIGCONT)
    soak.expect_resume(ep.describe(p))


def s3_down(soak: Soak, ep: Episode) -> None:
    soak.s3.stop_proxy()
    try:
        before = soak.job.min_step()
        soak.wait(ep.seconds(0.2, 1) if ep.fault == "s3-blip" else ep.seconds(2, 8))
        if soak.job.min_step() <= before:
            raise Finding("hurt-training", "training saved no version while S3 was down")
    finally:
        soak.s3.start_proxy()
    soak.expect_resume(ep.describe(soak.settings.peer_timeout))


def s3_hang(soak: Soak, ep: Episode) -> None:
    soak.s3.pause_server()
    try:
        before = soak.job.min_step()
        soak.wait(ep.seconds(2, 8))
        if soak.job.min_step() <= before:
            raise Finding("hurt-training", "training saved no version while S3 hung")
    finally:
        soak.s3.resume_server()
    soak.expect_resume(ep.describe(soak.settings.peer_timeout))


def s3_down_restart(soak: Soak, ep: Episode) -> None:
    soak.s3.stop_proxy()
    try:
        soak.crash(soak.job.ranks, signal.SIGKILL)
        back = time.monotonic() + 10.0
        _restart(soak, ep)
        soak.wait(max(0.0, back - time.monotonic()))
    finally:
        soak.s3.start_proxy()
    soak.expect_resume("S3 back after a restart during its outage")


def kill_launcher(soak: Soak, ep: Episode) -> None:
    if not soak.job.agents:
        soak.log("    skipped: the ranks have no launcher (--launcher torchrun)")
        return
    node = 0 if ep.fault == "kill-store-launcher" else max(1, ep.node % len(soak.job.agents))
    agent = soak.job.agents[node]
    if agent.poll() is not None:
        soak.log(f"    skipped: node {node}'s launcher is gone already")
        return
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    soak.wait(1.0)
    soak.expect_resume(ep.describe(soak.settings.peer_timeout))


def term_launcher(soak: Soak, ep: Episode) -> None:
    if not soak.job.agents:
        soak.log("    skipped: the ranks have no launcher (--launcher torchrun)")
        return
    node = ep.node % len(soak.job.agents)
    agent = soak.job.agents[node]
    if agent.poll() is not None:
        soak.log(f"    skipped: node {node}'s launcher is gone already")
        return
    agent.send_signal(signal.SIGTERM)
    # Its ranks end by the signal it forwards (not the driver's): allowed like the others'.
    soak.crash([], signal.SIGTERM)
    _restart(soak, ep)


def term_all_cluster_lost(soak: Soak, ep: Episode) -> None:
    cluster_lost(soak, ep, signal.SIGTERM)


def finish(soak: Soak) -> int:
    """End the job at an agreed step; check its final state and that a restart restores
    it. Returns the final version."""
    inc = soak.job
    inc.stop()
    soak.until(lambda: not inc.alive(), "the job to end once asked to")
    soak.tick(exits_allowed=True)
    soak.oracle.check_agreement()
    finals = {r.rank: r.events.last("final") for r in inc.ranks}
    for r in inc.ranks:
        if r.returncode != 0 or finals[r.rank] is None:
            raise Finding("unexpected-exit", soak.exit_story(r))
    versions = {int(e["v"]) for e in finals.values() if e}
    if len(versions) != 1:
        raise Finding("inconsistent-end", f"the ranks ended at {versions}")
    final = versions.pop()
    for rank, e in finals.items():
        assert e is not None
        if e["digest"] != soak.reference.digest(final, rank):
            raise Finding(
                "not-bit-exact",
                f"rank {rank}'s final state differs from the uninterrupted run's at "
                f"version {final}",
            )
        for tier in ("local", "peer"):
            if e["newest"].get(tier) != final:
                raise Finding(
                    "no-resume",
                    f"at the end rank {rank}'s newest version in {tier} is "
                    f"{e['newest'].get(tier)}, not the final {final}",
                )
    newest = (finals[0] or {}).get("newest")
    soak.log(f"    ended at v{final}, bit-exact; newest committed by tier: {newest}")
    soak.launch(restore_only=True)
    got = soak.started()
    version = soak.oracle.check_restore(restores_of(got), TIERS, "the end")
    soak.release()
    if version != final:
        raise Finding("lost-committed", f"after the end the job restored {version}, not {final}")
    check = soak.job
    soak.until(lambda: not check.alive(), "the restore-only job to end")
    for r in check.ranks:
        if r.poll() != 0:
            raise Finding("unexpected-exit", soak.exit_story(r))
    soak.log(f"    a restart after the end restored v{final}")
    return final


HANDLERS: dict[str, Callable[[Soak, Episode], None]] = {
    "kill-rank": kill_rank,
    "kill-all": kill_all,
    "kill-restoring": kill_restoring,
    "term-rank": lambda soak, ep: kill_rank(soak, ep, signal.SIGTERM),
    "term-all": lambda soak, ep: kill_all(soak, ep, signal.SIGTERM),
    "node-lost": node_lost,
    "cluster-lost": cluster_lost,
    "damage-blob": damage_blob,
    "damage-live": damage_live,
    "wipe-live": wipe_live,
    "kill-closing": kill_closing,
    "damage-s3-blob": damage_s3_blob,
    "manifest-cut": manifest_cut,
    "manifest-kill": manifest_kill,
    "manifest-cut-live": manifest_cut_live,
    "fill-memory": fill_memory,
    "world-size": world_size,
    "pause-short": pause,
    "pause-long": pause,
    "s3-blip": s3_down,
    "s3-down": s3_down,
    "s3-hang": s3_hang,
    "s3-down-restart": s3_down_restart,
    "term-all-cluster-lost": term_all_cluster_lost,
    "kill-launcher": kill_launcher,
    "kill-store-launcher": kill_launcher,
    "term-launcher": term_launcher,
}
assert set(HANDLERS) == set(CATALOG)

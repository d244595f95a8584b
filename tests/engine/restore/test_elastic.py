"""Elastic restore in one process: a job saved by N ranks restored on M ranks (threads).

The state holds what FSDP2 hands over -- DTensors, as stored :class:`DTensorShard` records, so no
process group is needed here (the real FSDP2 jobs under torchrun are in
tests/distributed/test_elastic.py) -- plus plain tensors and numbers. Each case checks what every
new rank gets against the global tensors the old ranks saved, and that a refusal changes nothing
stored.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_never_lose import run_ranks, stored_files
from tiercheck import (
    ReshardError,
    SyncCheckpointer,
    TierWriteFailed,
    VersionError,
    WorldSizeMismatch,
)
from tiercheck.codec import CodecOptions, read_meta
from tiercheck.codec.format.dtensor import DTensorShard
from tiercheck.consistency.identity import IDENTITY_FILE, JOB_KEY, JobRecord, NodeIdentity
from tiercheck.testing import LocalGroup

ROWS, COLS = 11, 6  # 11 rows over 4 ranks: 3, 3, 3, 2; over 3: 4, 4, 3


def global_weight(version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(version)
    return torch.randn(ROWS, COLS, generator=g)


def global_bias(version: int) -> torch.Tensor:
    return torch.arange(5, dtype=torch.float64) * (version + 1)


def rows(rank: int, world: int) -> slice:
    """The rows torch's Shard(0) gives ``rank`` of ``world`` (torch.chunk's rule)."""
    chunk = math.ceil(ROWS / world)
    start = min(rank * chunk, ROWS)
    return slice(start, min(start + chunk, ROWS))


def stored(
    local: torch.Tensor, full: torch.Tensor, start: int, rank: int, world: int
) -> DTensorShard:
    """What FSDP2 stores for rank ``rank`` of ``world``: rows from ``start`` of ``full`` (placed
    ``Shard(0)``), or all of it (``Replicate()``) when ``local`` is as large as ``full``."""
    whole = local.shape == full.shape
    return DTensorShard(
        local=local.clone(),
        shape=tuple(full.shape),
        stride=tuple(full.stride()),
        placements=(("replicate",),) if whole else (("shard", 0),),
        mesh=(world,),
        names=None,
        device="cpu",
        coord=(rank,),
        offset=(start,) + (0,) * (full.dim() - 1),
    )


def shard(version: int, rank: int, world: int) -> DTensorShard:
    part, full = rows(rank, world), global_weight(version)
    return stored(full[part], full, part.start, rank, world)


def replicated(version: int, rank: int, world: int) -> DTensorShard:
    return stored(global_bias(version), global_bias(version), 0, rank, world)


def state_of(version: int, rank: int, world: int, *, own: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s state of ``version`` in a ``world``-rank job; ``own`` adds a leaf that
    differs between ranks (a rank's own data position)."""
    state: dict[str, Any] = {
        "w": shard(version, rank, world),
        "b": replicated(version, rank, world),
        "lr": torch.tensor(0.5),
        "step": version,
    }
    if own:
        state["position"] = torch.tensor([rank * 100 + version])
    return state


def job(root: Path, rank: int, world: int, group: LocalGroup, **kw: Any) -> SyncCheckpointer:
    """Rank ``rank`` of job "job", every rank on one node (one shared memory folder)."""
    kw.setdefault("base_every", 2)
    kw.setdefault("tiers", ["local", "persistent"])
    kw.setdefault("persist", "all")
    return SyncCheckpointer(
        "job",
        rank=rank,
        world_size=world,
        ranks_per_node=world,
        coordinator=group.coordinator(rank),
        local_root=root / "node",
        persistent=(root / "durable").as_uri(),
        **kw,
    )


def save_versions(root: Path, world: int, versions: range, *, own: bool = False) -> None:
    group = LocalGroup(world)

    def one(r: int) -> None:
        with job(root, r, world, group) as ckpt:
            for v in versions:
                ckpt.save(v, state_of(v, r, world, own=own))
            ckpt.wait()

    run_ranks(world, one)


def restore_all(root: Path, world: int, **kw: Any) -> list[Any]:
    group = LocalGroup(world)

    def one(r: int) -> Any:
        with job(root, r, world, group, **kw) as ckpt:
            return ckpt.restore()

    return run_ranks(world, one)


def go_on(root: Path, world: int, *versions: int) -> None:
    """A ``world``-rank run restores (elastic) and saves ``versions``."""
    group = LocalGroup(world)

    def one(r: int) -> None:
        with job(root, r, world, group, elastic=True) as ckpt:
            assert ckpt.restore() is not None
            for version in versions:
                ckpt.save(version, state_of(version, r, world))
            ckpt.wait()

    run_ranks(world, one)


def check_resharded(got: Any, version: int, rank: int, world: int) -> None:
    """What rank ``rank`` of ``world`` restored equals its part of the saved global tensors."""
    state = got.state
    assert got.version == version
    assert torch.equal(state["w"], global_weight(version)[rows(rank, world)])
    assert torch.equal(state["b"], global_bias(version))
    assert torch.equal(state["lr"], torch.tensor(0.5))
    assert state["step"] == version


def flip_in_tensor(path: Path, tensor: str) -> None:
    """Flip a bit inside one tensor's bytes of a full blob (its header stays intact)."""
    data = bytearray(path.read_bytes())
    meta = read_meta(bytes(data))
    spec = meta.layout.specs[meta.layout.index[tensor]]
    data[meta.body_offset + spec.offset + spec.nbytes // 2] ^= 0x04
    path.write_bytes(bytes(data))


@pytest.fixture
def saved_by_4(tmp_path: Path) -> Path:
    """A job saved by 4 ranks on one node, versions 0..3 in both tiers."""
    root = tmp_path / "job4"
    save_versions(root, 4, range(4))
    return root


def clone(root: Path, to: Path) -> Path:
    shutil.copytree(root, to, symlinks=True)
    return to


def test_another_world_size_restores_resharded_from_memory_and_goes_on(
    saved_by_4: Path, tmp_path: Path
) -> None:
    root = clone(saved_by_4, tmp_path / "run")
    before = stored_files(root)
    got = restore_all(root, 2, elastic=True)
    for q, restored in enumerate(got):
        check_resharded(restored, 3, q, 2)
        assert restored.saved_by == 4
        assert restored.source_tier == "local"
    # A restore changes nothing stored, the world-size history included: the 2-rank run only
    # looked, so a 4-rank opening (not elastic) still takes the job as it was.
    record = JobRecord.from_bytes((root / "durable" / "job" / JOB_KEY).read_bytes())
    assert (record.world_size, record.worlds) == (4, ())
    assert stored_files(root) == before
    for r, restored in enumerate(restore_all(root, 4)):
        assert restored.version == 3
        assert torch.equal(restored.state["w"], shard(3, r, 4).local)

    # The 2-rank run goes on saving: its first save records the new world from version 4 on.
    # The next opening (not elastic) restores its own version, and a 4-rank opening is now the
    # one refused.
    go_on(root, 2, 4)
    record = JobRecord.from_bytes((root / "durable" / "job" / JOB_KEY).read_bytes())
    assert (record.world_size, record.worlds) == (2, ((0, 4), (4, 2)))
    for q, restored in enumerate(restore_all(root, 2)):
        check_resharded(restored, 4, q, 2)
        assert (restored.saved_by, restored.source_tier) == (2, "local")
    with pytest.raises(WorldSizeMismatch, match="saved by 2 ranks; this run has 4"):
        restore_all(root, 4)
    # Retention removes the old world's versions whole, every old rank's blob of them, once
    # the new world's are the newest `keep` (memory keeps 2, persistent 3).
    go_on(root, 2, 5, 6)
    left = sorted({p.parent.name for p in root.rglob("v*/r0000*.*") if p.is_file()})
    assert left == [f"v{v:012d}" for v in (4, 5, 6)], left
    assert not list((root / "node").rglob("v000000000004/*"))


def test_from_the_persistent_tier_onto_more_and_fewer_ranks(
    saved_by_4: Path, tmp_path: Path
) -> None:
    for world in (3, 1, 6):
        root = clone(saved_by_4, tmp_path / f"to{world}")
        shutil.rmtree(root / "node")  # the node's memory is gone
        for q, restored in enumerate(restore_all(root, world, elastic=True)):
            check_resharded(restored, 3, q, world)
            assert restored.source_tier == "persistent"
            assert restored.saved_by == 4


def test_a_damaged_range_one_rank_needs_falls_back_for_that_rank(
    saved_by_4: Path, tmp_path: Path
) -> None:
    root = clone(saved_by_4, tmp_path / "run")
    # New rank 1 of 2 needs old ranks 2 and 3; new rank 0 reads old ranks 0 and 1.
    damaged = next((root / "node").rglob("v000000000003/r00003.full"))
    flip_in_tensor(damaged, "['w']")
    got = restore_all(root, 2, elastic=True)
    for q, restored in enumerate(got):
        check_resharded(restored, 3, q, 2)
    assert got[0].source_tiers == {0: "local", 1: "persistent"}
    assert any(p.is_file() for p in root.rglob("quarantine/v000000000003/r00003.full"))


def test_leaves_that_differ_between_ranks_are_refused_or_wrapped(tmp_path: Path) -> None:
    root = tmp_path / "job"
    save_versions(root, 4, range(2), own=True)
    before = stored_files(root)
    with pytest.raises(ReshardError, match="position") as caught:
        restore_all(root, 3, elastic=True)
    assert "per_rank='wrap'" in str(caught.value)
    assert stored_files(root) == before  # nothing changed, the job record neither
    record = JobRecord.from_bytes((root / "durable" / "job" / JOB_KEY).read_bytes())
    assert (record.world_size, record.worlds) == (4, ())
    # The original job still restores, on its own 4 ranks.
    for r, restored in enumerate(restore_all(root, 4)):
        assert torch.equal(restored.state["position"], torch.tensor([r * 100 + 1]))
    # Wrapped: new rank q continues from old rank q % 4's position.
    for q, restored in enumerate(restore_all(root, 6, elastic=True, per_rank="wrap")):
        check_resharded(restored, 1, q, 6)
        assert torch.equal(restored.state["position"], torch.tensor([(q % 4) * 100 + 1]))


def test_a_save_before_the_elastic_restore_is_refused(saved_by_4: Path) -> None:
    before = stored_files(saved_by_4)
    group = LocalGroup(2)

    def one(r: int) -> None:
        with job(saved_by_4, r, 2, group, elastic=True) as ckpt:
            ckpt.save(10, state_of(10, r, 2))

    with pytest.raises(VersionError, match="call restore\\(\\) first"):
        run_ranks(2, one)
    assert stored_files(saved_by_4) == before


def test_each_new_rank_reads_only_the_ranges_it_needs(tmp_path: Path) -> None:
    # 4 old ranks hold 2 MiB each of one big sharded weight; 8 new ranks need half of one each.
    big = torch.randn(64, 32768, generator=torch.Generator().manual_seed(1))
    group = LocalGroup(4)
    frame = 256 << 10  # 8 frames per old shard

    def save(r: int) -> None:
        with job(tmp_path, r, 4, group, codec=CodecOptions(frame_bytes=frame)) as ckpt:
            ckpt.save(0, {"big": stored(big[r * 16 : r * 16 + 16], big, r * 16, r, 4), "step": 0})
            ckpt.wait()

    run_ranks(4, save)
    shutil.rmtree(tmp_path / "node")  # from the persistent tier (packed: frames)
    blobs = [p.stat().st_size for p in (tmp_path / "durable").rglob("v000000000000/r*")]
    assert len(blobs) == 4
    group2 = LocalGroup(4)

    def restore(r: int) -> tuple[Any, int]:
        # 4 -> 4 with elastic=True is an ordinary restore: no other rank's blob is read.
        with job(tmp_path, r, 4, group2, elastic=True) as ckpt:
            got = ckpt.restore()
            return got, ckpt.stats.reshard_bytes_read

    for _, read in run_ranks(4, restore):
        assert read == 0
    group3 = LocalGroup(8)

    def restore8(r: int) -> tuple[Any, int]:
        with job(tmp_path, r, 8, group3, elastic=True) as ckpt:
            got = ckpt.restore()
            return got, ckpt.stats.reshard_bytes_read

    for q, (got, read) in enumerate(run_ranks(8, restore8)):
        assert torch.equal(got.state["big"], big[q * 8 : q * 8 + 8])
        # The frames of the half of the one old shard it overlaps, and the first 64 KiB of
        # every old blob for its header -- not the four blobs, nor the whole old shard.
        assert read <= max(blobs) / 2 + frame + 4 * (64 << 10), (q, read, blobs)
        assert read < sum(blobs) / 6, (q, read, blobs)


def test_a_job_record_that_cannot_be_updated_keeps_the_durable_tier_out_until_it_is(
    saved_by_4: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first save of a resharded run records its world in the job record; when that write
    fails, the save still goes to memory (the nodes' identities record the world, with a newer
    revision), the durable tier takes nothing filed under the old history, and the next
    opening believes the identities and writes the record."""
    from tiercheck.engine.open.claim import Claim
    from tiercheck.errors import StorageError

    async def refuse(self: Claim) -> None:
        raise StorageError("the durable location refused the write (test)")

    group = LocalGroup(2)

    def one(r: int) -> list[int]:
        with job(saved_by_4, r, 2, group, elastic=True) as ckpt:
            assert ckpt.restore() is not None
            handle = ckpt.save(4, state_of(4, r, 2))
            ckpt.wait()
            assert handle.committed("local")
            with pytest.raises(TierWriteFailed, match="job record could not be updated"):
                handle.result("persistent")
            return sorted(ckpt.versions()["persistent"])

    with monkeypatch.context() as patch:
        patch.setattr(Claim, "write_job_record", refuse)
        durable_seen = run_ranks(2, one)
    assert durable_seen == [[0, 1, 2, 3]] * 2
    record = JobRecord.from_bytes((saved_by_4 / "durable" / "job" / JOB_KEY).read_bytes())
    assert (record.world_size, record.worlds, record.revision) == (4, (), 0)
    identity = NodeIdentity.from_bytes((saved_by_4 / "node" / IDENTITY_FILE).read_bytes())
    assert (identity.world_size, identity.worlds) == (2, ((0, 4), (4, 2)))
    assert identity.revision == 1
    assert not list((saved_by_4 / "durable").rglob("v000000000004/*"))
    # The store works again: the next opening (not elastic: the identities say 2 ranks now)
    # restores version 4 from memory and rewrites the job record.
    for q, restored in enumerate(restore_all(saved_by_4, 2)):
        check_resharded(restored, 4, q, 2)
        assert (restored.saved_by, restored.source_tier) == (2, "local")
    record = JobRecord.from_bytes((saved_by_4 / "durable" / "job" / JOB_KEY).read_bytes())
    assert (record.world_size, record.worlds, record.revision) == (2, ((0, 4), (4, 2)), 1)

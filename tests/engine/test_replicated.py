"""Replicated state stored once per node, in one process: ranks on threads (LocalGroup).

A DDP-like job marks its model ``tiercheck.Replicated``: the first rank of each node stores it,
the others a reference. Measured here: the bytes each tier holds, with and without the hint;
that every rank restores bit-exact from each tier, falls back when the storing rank's blob is
damaged, and that DTensors replicated over the whole world are stored once without a hint.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.restore.test_elastic import global_bias, global_weight, replicated, shard
from tests.test_never_lose import flip_a_bit, run_ranks
from tiercheck import Replicated, SyncCheckpointer
from tiercheck.codec import decode, read_meta, unflatten
from tiercheck.codec.format.dtensor import DTensorShard
from tiercheck.codec.replica import resolve, take
from tiercheck.consistency.keys import version_prefix
from tiercheck.defaults import ENCODINGS
from tiercheck.testing import LocalGroup

WORLD = 4


def model_of(version: int) -> dict[str, torch.Tensor]:
    """The replicated part: random bytes (they do not compress, so the packed blobs of the
    persistent tier measure the same as the raw ones)."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "w": torch.randint(0, 256, (64, 1000), dtype=torch.uint8, generator=g),
        "b": torch.randint(0, 256, (3000,), dtype=torch.uint8, generator=g),
    }


def own_of(version: int, rank: int) -> torch.Tensor:
    return torch.full((16,), float(rank * 100 + version))


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


def state_of(version: int, rank: int, *, hint: bool = True) -> dict[str, Any]:
    model = model_of(version)
    return {"model": Replicated(model) if hint else model, "own": own_of(version, rank)}


def empty_state() -> dict[str, Any]:
    return {
        "model": Replicated({k: torch.zeros_like(v) for k, v in model_of(0).items()}),
        "own": torch.zeros(16),
    }


def job(
    root: Path,
    rank: int,
    group: LocalGroup,
    *,
    world: int = WORLD,
    per_node: int = WORLD,
    **kw: Any,
) -> SyncCheckpointer:
    kw.setdefault("base_every", 2)
    kw.setdefault("tiers", ["local", "persistent"])
    kw.setdefault("persist", "all")
    return SyncCheckpointer(
        "job",
        rank=rank,
        world_size=world,
        ranks_per_node=per_node,
        coordinator=group.coordinator(rank),
        local_root=root / f"node{rank // per_node}",
        persistent=(root / "durable").as_uri(),
        **kw,
    )


def save(
    root: Path, versions: range, *, hint: bool = True, per_node: int = WORLD, **kw: Any
) -> None:
    group = LocalGroup(WORLD)

    def one(r: int) -> None:
        with job(root, r, group, per_node=per_node, **kw) as ckpt:
            for v in versions:
                ckpt.save(v, state_of(v, r, hint=hint))
            ckpt.wait()

    run_ranks(WORLD, one)


def restore(root: Path, **kw: Any) -> list[tuple[Any, dict[str, Any]]]:
    """Every rank restores into a fresh state; returns (Restored, the filled state)."""
    group = LocalGroup(WORLD)

    def one(r: int) -> tuple[Any, dict[str, Any]]:
        state = empty_state()
        with job(root, r, group, **kw) as ckpt:
            restored = ckpt.restore(state)
        return restored, state

    return run_ranks(WORLD, one)


def assert_restored(
    results: list[tuple[Any, dict[str, Any]]], version: int, tier: str, *, first: int = 0
) -> None:
    """``results[i]`` is rank ``first + i``'s."""
    for rank, (restored, state) in enumerate(results, start=first):
        assert restored is not None
        assert (restored.version, restored.source_tier) == (version, tier)
        assert type(state["model"]) is Replicated  # the caller's wrapper is kept, filled
        for key, expected in model_of(version).items():
            assert torch.equal(state["model"].value[key], expected), (rank, key)
        assert torch.equal(state["own"], own_of(version, rank))


def blob_sizes(folder: Path, version: int) -> dict[int, int]:
    """Size of each rank's blob of ``version`` under ``folder`` (any tier's layout)."""
    out: dict[int, int] = {}
    for path in folder.rglob(f"{version_prefix(version)}r*"):
        if "quarantine" not in path.parts:
            out[int(path.name[1:6])] = path.stat().st_size
    return out


def test_a_ddp_job_stores_its_replicated_model_once_per_node(tmp_path: Path) -> None:
    save(tmp_path / "plain", range(1), hint=False)
    save(tmp_path / "hinted", range(1))
    model, own = nbytes(model_of(0)), own_of(0, 0).nbytes
    # Per blob beyond the tensors' bytes: header, tensor table, alignment (generous).
    slack = 4096
    for tier in ("node0", "durable"):
        plain = blob_sizes(tmp_path / "plain" / tier, 0)
        hinted = blob_sizes(tmp_path / "hinted" / tier, 0)
        assert sorted(plain) == sorted(hinted) == list(range(WORLD))
        assert all(size >= model for size in plain.values())
        assert sum(plain.values()) >= WORLD * model
        # The first rank stores the model; the others none of its bytes.
        assert hinted[0] >= model
        assert all(hinted[r] < own + slack < model for r in range(1, WORLD))
        assert model <= sum(hinted.values()) < model + WORLD * (own + slack)
        assert sum(plain.values()) - sum(hinted.values()) >= (WORLD - 1) * model


@pytest.mark.parametrize("newest", [1, 2])  # with base_every=2: a delta, a base
def test_every_rank_restores_from_memory_and_from_the_persistent_tier(
    tmp_path: Path, newest: int
) -> None:
    save(tmp_path, range(newest + 1))
    assert_restored(restore(tmp_path), newest, "local")
    shutil.rmtree(tmp_path / "node0")  # the node's memory is gone
    assert_restored(restore(tmp_path), newest, "persistent")


def test_a_damaged_storing_blob_sends_every_rank_to_the_next_tier(tmp_path: Path) -> None:
    save(tmp_path, range(3))
    leader = tmp_path / "node0" / "blobs" / version_prefix(2) / "r00000.full"
    assert leader.exists()
    flip_a_bit(leader)
    results = restore(tmp_path)
    assert_restored(results, 2, "persistent")
    # Every rank read the damaged blob and turned to the persistent tier; nothing was lost.
    assert all(r.source_tiers == dict.fromkeys(range(WORLD), "persistent") for r, _ in results)
    assert list((tmp_path / "node0").rglob("quarantine/**/r00000.full"))
    # The job goes on: it saves again and restores again, from memory.
    group = LocalGroup(WORLD)

    def go_on(r: int) -> None:
        with job(tmp_path, r, group) as ckpt:
            assert ckpt.restore(empty_state()) is not None
            ckpt.save(3, state_of(3, r))
            ckpt.wait()

    run_ranks(WORLD, go_on)
    assert_restored(restore(tmp_path), 3, "local")


def test_a_missing_storing_blob_falls_back_too(tmp_path: Path) -> None:
    save(tmp_path, range(1))
    (tmp_path / "node0" / "blobs" / version_prefix(0) / "r00000.full").unlink()
    assert_restored(restore(tmp_path), 0, "persistent")


@pytest.mark.parametrize("newest", [1, 2])  # with base_every=2: a delta, a base
def test_two_nodes_store_one_copy_each_in_memory_and_one_in_all_durably(
    tmp_path: Path, newest: int
) -> None:
    """Node 1's first rank (rank 2) keeps the model whole in its node's memory, which node 1
    restores from alone; in the persistent tier its blob refers to rank 0's, as ranks 1 and
    3 refer to their node's first: one copy there in all."""
    save(tmp_path, range(newest + 1), per_node=2)
    model = nbytes(model_of(newest))
    own, slack = own_of(0, 0).nbytes, 4096
    for node, (first, other) in enumerate([(0, 1), (2, 3)]):
        sizes = blob_sizes(tmp_path / f"node{node}", newest)
        assert sorted(sizes) == [first, other]
        assert sizes[first] >= model > sizes[other]
    durable = blob_sizes(tmp_path / "durable", newest)
    assert sorted(durable) == list(range(WORLD))
    assert durable[0] >= model
    assert all(durable[r] < own + slack < model for r in (1, 2, 3))
    assert model <= sum(durable.values()) < model + WORLD * (own + slack)
    leader = next((tmp_path / "durable" / "job" / version_prefix(newest)).glob("r00002.*"))
    meta = read_meta(leader.read_bytes())
    assert meta.layout.has_refs
    assert [s.path for s in meta.layout.specs] == ["['own']"]
    assert_restored(restore(tmp_path, per_node=2), newest, "local")
    shutil.rmtree(tmp_path / "node0")  # node 0 lost: node 1 still restores from its memory
    results = restore(tmp_path, per_node=2)
    assert [r.source_tier for r, _ in results] == ["persistent"] * 2 + ["local"] * 2
    assert_restored(results[:2], newest, "persistent")
    assert_restored(results[2:], newest, "local", first=2)
    shutil.rmtree(tmp_path / "node1")
    assert_restored(restore(tmp_path, per_node=2), newest, "persistent")


def test_every_hold_on_a_snapshot_is_given_back_once_whatever_the_encodings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The lanes hold the staged snapshot while they write blobs that are views of it, and give
    each hold back once. Found wanting: a durable tier storing blobs as is (``"full"``) from
    node 1's lean state (its own memory, never held) gave back a hold it had not taken, so
    the snapshot's memory went back to the pool while the local tier's lane still wrote from
    it. Every pair of encodings, on one node and on two (where rank 2 stores a lean state)."""
    caplog.set_level(logging.ERROR, logger="tiercheck")
    newest = 2
    for local, persistent in itertools.product(ENCODINGS, repeat=2):
        for per_node in (WORLD, 2):
            root = tmp_path / f"{local}-{persistent}-{per_node}"
            encodings = {"local": local, "persistent": persistent}
            save(root, range(newest + 1), per_node=per_node, encodings=encodings)
            kw: dict[str, Any] = {"per_node": per_node, "encodings": encodings}
            assert_restored(restore(root, **kw), newest, "local")
            for node in root.glob("node*"):
                shutil.rmtree(node)
            assert_restored(restore(root, **kw), newest, "persistent")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("damaged", [0, 2])  # the storing rank; node 1's first, which refers on
def test_a_damaged_durable_blob_on_the_way_to_the_copy_falls_back_a_version(
    tmp_path: Path, damaged: int
) -> None:
    save(tmp_path, range(3), per_node=2)  # 0 base, 1 delta, 2 base
    for node in (0, 1):
        shutil.rmtree(tmp_path / f"node{node}")
    blob = next((tmp_path / "durable" / "job" / version_prefix(2)).glob(f"r{damaged:05d}.*"))
    flip_a_bit(blob)
    # Version 2 cannot be rebuilt by the ranks whose references lead through that blob: every
    # rank agrees on version 1 instead; the damaged blob is set aside, not deleted.
    assert_restored(restore(tmp_path, per_node=2), 1, "persistent")
    assert list((tmp_path / "durable").rglob(f"quarantine/**/r{damaged:05d}.*"))
    assert_restored(restore(tmp_path, per_node=2), 1, "persistent")


def test_the_hint_coming_and_going_keeps_each_tiers_delta_base(tmp_path: Path) -> None:
    """Version 0 (a base) marks the model, version 1 (a delta on it) does not, version 2 (a
    base) does not, version 3 (a delta) marks it again: each durable delta of node 1's first
    rank is encoded against what the durable tier holds of its base."""
    group = LocalGroup(WORLD)
    hints = [True, False, False, True]

    def one(r: int) -> None:
        with job(tmp_path, r, group, per_node=2, persist="all") as ckpt:
            for v, hint in enumerate(hints):
                ckpt.save(v, state_of(v, r, hint=hint))
            ckpt.wait()

    run_ranks(WORLD, one)
    model = nbytes(model_of(0))
    durable = tmp_path / "durable"
    assert [blob_sizes(durable, v)[2] >= model for v in range(4)] == [not h for h in hints]
    for node in (0, 1):
        shutil.rmtree(tmp_path / f"node{node}")
    # Restoring version 1 sets the job back to it; each is restored from its own copy.
    shutil.copytree(tmp_path, tmp_path.with_name(tmp_path.name + "-v1"))
    for v, root in ((3, tmp_path), (1, tmp_path.with_name(tmp_path.name + "-v1"))):
        group2 = LocalGroup(WORLD)

        def back(
            r: int, v: int = v, root: Path = root, group2: LocalGroup = group2
        ) -> tuple[Any, dict[str, Any]]:
            state = empty_state()
            with job(root, r, group2, per_node=2) as ckpt:
                return ckpt.restore(state, version=v), state

        assert_restored(run_ranks(WORLD, back), v, "persistent")


def test_a_stateful_inside_the_hint_is_saved_and_restored_through_it(tmp_path: Path) -> None:
    group = LocalGroup(WORLD)
    torch.manual_seed(0)
    saved = torch.nn.Linear(300, 200)

    def one(r: int) -> None:
        module = torch.nn.Linear(300, 200)
        module.load_state_dict(saved.state_dict())
        with job(tmp_path, r, group) as ckpt:
            ckpt.save(0, {"model": Replicated(module), "own": own_of(0, r)})
            ckpt.wait()

    run_ranks(WORLD, one)
    sizes = blob_sizes(tmp_path / "node0", 0)
    weights = sum(p.nbytes for p in saved.parameters())
    assert sizes[0] >= weights
    assert all(sizes[r] < weights for r in range(1, WORLD))

    group2 = LocalGroup(WORLD)

    def back(r: int) -> torch.nn.Linear:
        module = torch.nn.Linear(300, 200)
        with job(tmp_path, r, group2) as ckpt:
            assert ckpt.restore({"model": Replicated(module), "own": torch.zeros(16)})
        return module

    for module in run_ranks(WORLD, back):
        assert torch.equal(module.weight, saved.weight)
        assert torch.equal(module.bias, saved.bias)


# --- DTensors ----------------------------------------------------------------------------------


def dstate(version: int, rank: int, world: int, *, mesh: int | None = None) -> dict[str, Any]:
    b = replicated(version, rank, world)
    if mesh is not None:  # replicated over a smaller mesh: not the same on every rank
        b = DTensorShard(b.local, b.shape, b.stride, b.placements, (mesh,), None, "cpu",
                         (rank % mesh,), b.offset)  # fmt: skip
    return {"w": shard(version, rank, world), "b": b, "step": version}


def test_dtensors_replicated_over_the_world_are_stored_once_without_a_hint(
    tmp_path: Path,
) -> None:
    group = LocalGroup(WORLD)

    def one(r: int) -> None:
        with job(tmp_path, r, group) as ckpt:
            ckpt.save(0, dstate(0, r, WORLD))
            ckpt.wait()

    run_ranks(WORLD, one)
    folder = tmp_path / "node0" / "blobs" / version_prefix(0)
    metas = [read_meta((folder / f"r{r:05d}.full").read_bytes()) for r in range(WORLD)]
    # The first rank holds the shard and the replicated bias; the others their shard only.
    assert [len(m.layout.specs) for m in metas] == [2, 1, 1, 1]
    assert [m.layout.has_refs for m in metas] == [False, True, True, True]
    assert all(m.stages[0] == "tiercheck.flatten/3" for m in metas[1:])

    group2 = LocalGroup(WORLD)

    def back(r: int) -> Any:
        with job(tmp_path, r, group2) as ckpt:
            return ckpt.restore()

    for r, restored in enumerate(run_ranks(WORLD, back)):
        # Without a process group the DTensors come back as their local tensors.
        assert torch.equal(restored.state["b"], global_bias(0))
        assert torch.equal(restored.state["w"], shard(0, r, WORLD).local)
    # Resolved, each rank's record is its own (its mesh coordinate), the bytes the first's.
    raws = [decode((folder / f"r{r:05d}.full").read_bytes()) for r in range(WORLD)]
    for r in range(1, WORLD):
        resolved = resolve(raws[r].layout, r, {0: raws[0].layout})
        state = unflatten(
            resolved.layout, take(resolved, {0: raws[0].tensors(), r: raws[r].tensors()})
        )
        assert state["b"].coord == (r,)
        assert torch.equal(state["b"].local, global_bias(0))


def test_dtensors_replicated_over_a_smaller_mesh_are_stored_by_every_rank(
    tmp_path: Path,
) -> None:
    group = LocalGroup(WORLD)

    def one(r: int) -> None:
        with job(tmp_path, r, group) as ckpt:
            ckpt.save(0, dstate(0, r, WORLD, mesh=2))
            ckpt.wait()

    run_ranks(WORLD, one)
    folder = tmp_path / "node0" / "blobs" / version_prefix(0)
    metas = [read_meta((folder / f"r{r:05d}.full").read_bytes()) for r in range(WORLD)]
    assert [len(m.layout.specs) for m in metas] == [2] * WORLD
    assert not any(m.layout.has_refs for m in metas)


# --- elastic -----------------------------------------------------------------------------------


def estate(version: int, rank: int, world: int) -> dict[str, Any]:
    return {
        "w": shard(version, rank, world),
        "b": replicated(version, rank, world),
        "model": Replicated(model_of(version)),
        "step": version,
    }


# newest 1: a delta. per_node 2: two old nodes, whose first ranks' durable blobs refer to rank 0
# (and no new node's memory holds every old rank's blob).
@pytest.mark.parametrize(
    ("new_world", "newest", "per_node"), [(2, 2, 4), (3, 2, 4), (3, 1, 4), (3, 1, 2)]
)
def test_a_job_saved_with_references_restores_on_another_world(
    tmp_path: Path, new_world: int, newest: int, per_node: int
) -> None:
    group = LocalGroup(WORLD)

    def one(r: int) -> None:
        with job(tmp_path, r, group, per_node=per_node) as ckpt:
            for v in range(newest + 1):
                ckpt.save(v, estate(v, r, WORLD))
            ckpt.wait()

    run_ranks(WORLD, one)
    group2 = LocalGroup(new_world)

    def back(r: int) -> Any:
        with job(tmp_path, r, group2, world=new_world, per_node=new_world, elastic=True) as c:
            return c.restore()

    for tier_gone in (False, True):
        if tier_gone:
            shutil.rmtree(tmp_path / "node0")
        results = run_ranks(new_world, back)
        # The new shards put together are the global tensor the old ranks saved.
        assert torch.equal(torch.cat([r.state["w"] for r in results]), global_weight(newest))
        for q, restored in enumerate(results):
            assert restored.version == newest
            whole = per_node == WORLD and not tier_gone
            assert restored.source_tier == ("local" if whole else "persistent")
            state = restored.state
            assert torch.equal(state["w"], shard(newest, q, new_world).local)
            assert torch.equal(state["b"], global_bias(newest))
            for key, expected in model_of(newest).items():
                assert torch.equal(state["model"][key], expected)
            assert state["step"] == newest


@pytest.mark.parametrize("fails", ["derive", "copy"])
def test_a_lean_blob_that_cannot_be_made_is_stored_whole_durably(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """Making node 1's first rank's durable blob lean fails (the derivation refuses, or the copy
    raises): that rank warns and stores the model whole there -- more bytes, nothing lost, the
    save not failed -- and every rank restores from the persistent tier, then from a delta on
    that base made lean again."""
    from tiercheck.codec import replica
    from tiercheck.engine.save import encode

    def refuse(*_: Any) -> None:
        raise ValueError("refused for the test")

    def broken(*_: Any) -> None:
        raise RuntimeError("a copy that fails, for the test")

    if fails == "derive":
        monkeypatch.setattr(encode, "lean", refuse)
    else:
        monkeypatch.setattr(replica.Lean, "payload", broken)
    with caplog.at_level("WARNING", logger="tiercheck"):
        save(tmp_path, range(1), per_node=2)
    said = {"derive": "stores its replicated state whole", "copy": "could not make version 0 lean"}
    assert said[fails] in caplog.text
    durable = blob_sizes(tmp_path / "durable", 0)
    model = nbytes(model_of(0))
    assert durable[0] >= model
    assert durable[2] >= model  # whole: the one rank that could not refer to rank 0
    assert durable[1] < model
    assert durable[3] < model
    monkeypatch.undo()
    group = LocalGroup(WORLD)

    def more(r: int) -> None:  # version 1, a delta on that whole base, lean again
        with job(tmp_path, r, group, per_node=2) as ckpt:
            assert ckpt.restore(empty_state()) is not None
            ckpt.save(1, state_of(1, r))
            ckpt.wait()

    run_ranks(WORLD, more)
    assert blob_sizes(tmp_path / "durable", 1)[2] < model
    for node in (0, 1):
        shutil.rmtree(tmp_path / f"node{node}")
    copy = tmp_path.with_name(tmp_path.name + "-v0")
    shutil.copytree(tmp_path, copy)
    assert_restored(restore(tmp_path, per_node=2), 1, "persistent")
    group2 = LocalGroup(WORLD)

    def back(r: int) -> tuple[Any, dict[str, Any]]:
        state = empty_state()
        with job(copy, r, group2, per_node=2) as ckpt:
            return ckpt.restore(state, version=0), state

    assert_restored(run_ranks(WORLD, back), 0, "persistent")

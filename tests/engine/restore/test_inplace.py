"""Restoring straight into the caller's tensors (tiercheck.engine.restore.inplace), against the
oracle of the ordinary path (read the whole blob, verify, copy in walk order).

The class of bug hunted: any difference between the two paths' results, for any state shape,
dtype and aliasing of its tensors (tied weights, overlapping views, transposed, conjugate,
parameters, a fresh optimizer's missing moments), and any fault between the header read and the
last byte: the restore must still end with one whole version, bit for bit, or a typed error --
and a restore refused for a state that does not fit writes nothing.
"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tiercheck.engine.restore.read as read_module
from tests.helpers import assert_state_equal, run_ranks
from tiercheck import RestoreError, StateMismatch, SyncCheckpointer
from tiercheck.codec import read_meta
from tiercheck.codec.format.digest import DIGEST_CHUNK
from tiercheck.engine.restore import inplace
from tiercheck.testing import LocalGroup

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.complex64, torch.uint8]


def random_state(rng: random.Random, fill: float | None) -> dict[str, Any]:
    """A state of tensors aliased in the ways a live model's are; ``fill``: every value set to
    it (a target to restore into), else random values (the state saved). Same ``rng`` seed,
    same structure and aliasing."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    out: dict[str, Any] = {}

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = (torch.randn(shape, generator=g) * 50).to(dtype)
        if dtype.is_complex:
            t = torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        return t if fill is None else torch.full_like(t, fill)

    for i in range(rng.randrange(3, 12)):
        kind = rng.choice(["plain", "plain", "param", "tied", "views", "transposed", "conj"])
        dtype = rng.choice(DTYPES)
        shape = tuple(rng.choice([0, 1, 3, 17, 64]) for _ in range(rng.randrange(0, 3)))
        key = f"t{i}"
        if kind == "plain":
            out[key] = make(shape, dtype)
        elif kind == "param":
            out[key] = nn.Parameter(make((rng.randrange(1, 40),), torch.float32))
        elif kind == "tied":
            # Saved from tensors of their own, restored into one: the order the copies are
            # made in decides what the target holds (the last one wins), as in torch.
            t = make(shape, dtype)
            out[key] = t
            out[key + "_tied"] = t if fill is not None else make(shape, dtype)
        elif kind == "views":
            a, b = sorted(rng.sample(range(65), 2))
            c, d = sorted(rng.sample(range(65), 2))
            order = ["x", "y", "all"] if rng.random() < 0.5 else ["all", "x", "y"]
            if fill is None:
                parts = [make((64,), dtype) for _ in range(3)]
                views = {"x": parts[0][a:b], "y": parts[1][c:d], "all": parts[2]}
            else:
                base = make((64,), dtype)
                views = {"x": base[a:b], "y": base[c:d], "all": base}
            out[key] = {k: views[k] for k in order}
        elif kind == "transposed":
            out[key] = make((5, 7), dtype).t()
        else:
            out[key] = make((9,), torch.complex64).conj()
    step = rng.randrange(100)
    out["step"] = step if fill is None else -1
    out["nested"] = [make((rng.randrange(1, 5),), torch.float32), ("name", 3)]
    return out


def ckpt(root: Path, **kw: Any) -> SyncCheckpointer:
    kw.setdefault("tiers", ["local", "persistent"])
    return SyncCheckpointer(
        "job", local_root=root / "node", persistent=(root / "durable").as_uri(), **kw
    )


def no_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    async def none(*args: Any, **kwargs: Any) -> None:
        return None

    monkeypatch.setattr(read_module, "open_direct", none)


def spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the restores written straight into the state, and checks what makes writing by
    address independent of the order the threads write in: no two destinations overlap."""
    calls: list[int] = []
    real, plan = inplace.write_direct, inplace.plan_scatter

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return await real(*args, **kwargs)

    def disjoint(nbytes: int, rows: Any) -> Any:
        spans = sorted((int(a), int(a) + int(n)) for _, n, a in np.asarray(rows) if n)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "two destinations of one restore overlap"
        return plan(nbytes, rows)

    monkeypatch.setattr(inplace, "write_direct", counted)
    monkeypatch.setattr(inplace, "plan_scatter", disjoint)
    return calls


@pytest.mark.parametrize("seed", range(12))
def test_the_direct_path_leaves_what_the_ordinary_path_leaves(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = random_state(random.Random(seed), None)
    with ckpt(tmp_path) as c:
        c.save(1, saved)
        c.wait()
    direct = random_state(random.Random(seed), 0.0)
    ordinary = random_state(random.Random(seed), 0.0)
    calls = spy(monkeypatch)
    with ckpt(tmp_path) as c:
        got = c.restore(direct)
        assert c.stats.restore_fallbacks == 0
    assert got is not None
    assert got.source_tier == "local"
    assert calls == [1], "the restore did not take the direct path"
    no_direct(monkeypatch)
    with ckpt(tmp_path) as c:
        assert c.restore(ordinary) is not None
    assert calls == [1]
    assert_state_equal(direct, ordinary)
    # Where nothing aliases, the state holds exactly what was saved.
    for key, value in saved.items():
        if isinstance(value, torch.Tensor) and "_tied" not in key and key + "_tied" not in saved:
            assert torch.equal(direct[key], value), key
    assert direct["step"] == saved["step"]


def test_a_fresh_optimizer_receives_its_moments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    with ckpt(tmp_path) as c:
        c.save(1, {"model": model, "optim": opt})
        c.wait()
    fresh = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    calls = spy(monkeypatch)
    with ckpt(tmp_path) as c:
        got = c.restore({"model": fresh, "optim": fresh_opt})
        assert c.stats.restore_fallbacks == 0
    assert got is not None
    assert got.source_tier == "local"
    assert calls == [1]
    assert_state_equal(fresh.state_dict(), model.state_dict())
    assert_state_equal(fresh_opt.state_dict()["state"], opt.state_dict()["state"])


def big_state(version: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(version)
    # Three 8 MiB chunks and a bit: a fault can sit in a chunk after others were written.
    return {"w": torch.randn(3 * DIGEST_CHUNK // 4 + 999, generator=g), "step": version}


def blob(root: Path, where: str, version: int = 1) -> Path:
    found = [
        p for p in (root / where).rglob(f"v{version:012d}/r00000.*") if "quarantine" not in p.parts
    ]
    assert len(found) == 1, found
    return found[0]


def flip_in_chunk(path: Path, chunk: int) -> None:
    data = bytearray(path.read_bytes())
    meta = read_meta(memoryview(data))
    data[meta.body_offset + chunk * DIGEST_CHUNK + 17] ^= 0x20
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fault", ["body", "header", "truncated"])
def test_a_damaged_local_blob_falls_back_to_the_durable_copy(
    tmp_path: Path, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ckpt(tmp_path, persist="all") as c:
        c.save(1, big_state(1))
        c.wait()
    local = blob(tmp_path, "node")
    durable_before = blob(tmp_path, "durable").read_bytes()
    if fault == "body":
        flip_in_chunk(local, 2)
    elif fault == "header":
        data = bytearray(local.read_bytes())
        data[70] ^= 1
        local.write_bytes(bytes(data))
    else:
        local.write_bytes(local.read_bytes()[:-4096])
    damaged = local.read_bytes()
    target = {"w": torch.zeros_like(big_state(1)["w"]), "step": 0}
    with ckpt(tmp_path, persist="all") as c:
        got = c.restore(target)
        # The body's damage is found while writing the state, then again reading it whole.
        assert c.stats.restore_fallbacks == (2 if fault == "body" else 1)
    assert got is not None
    assert got.version == 1
    assert got.source_tier == "persistent"
    assert_state_equal(target, big_state(1))
    assert local.read_bytes() == damaged  # kept where it was
    assert next(tmp_path.rglob("quarantine/v000000000001/r00000.full")).read_bytes() == damaged
    assert blob(tmp_path, "durable").read_bytes() == durable_before


def test_damage_found_midway_with_no_other_copy_says_what_the_state_holds(
    tmp_path: Path,
) -> None:
    with ckpt(tmp_path, tiers=["local"]) as c:
        c.save(1, big_state(1))
        c.wait()
    local = blob(tmp_path, "node")
    pristine = local.read_bytes()
    flip_in_chunk(local, 2)
    target = {"w": torch.zeros_like(big_state(1)["w"]), "step": 0}
    with ckpt(tmp_path, tiers=["local"]) as c, pytest.raises(RestoreError) as caught:
        c.restore(target)
    assert "ChecksumMismatch" in str(caught.value)
    assert "may hold verified bytes of version 1" in str(caught.value)
    # What the state holds is the version's bytes or its former zeros, never damaged bytes.
    w, saved = target["w"], big_state(1)["w"]
    assert bool(((w == saved) | (w == 0)).all())
    local.write_bytes(pristine)  # repaired: the job restores, bit for bit
    with ckpt(tmp_path, tiers=["local"]) as c:
        got = c.restore(target)
    assert got is not None
    assert got.version == 1
    assert_state_equal(target, big_state(1))


def misfit(state: dict[str, Any], rng: random.Random) -> None:
    """Make ``state`` unfit to restore into, in one to three of the ways a state can be."""
    for _ in range(rng.randrange(1, 4)):
        keys = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim()]
        how = rng.choice(["shape", "dtype", "missing", "extra", "meta", "leaf"])
        if how == "extra" or not keys:
            state[f"extra{rng.randrange(99)}"] = torch.zeros(2)
            continue
        key = rng.choice(keys)
        value = state[key]
        if how == "shape":
            state[key] = torch.zeros(value.numel() + 1, dtype=value.dtype)
        elif how == "dtype":
            other = torch.float64 if value.dtype != torch.float64 else torch.int32
            state[key] = torch.zeros(value.shape, dtype=other)
        elif how == "missing":
            del state[key]
        elif how == "meta":
            state[key] = torch.empty(value.shape, dtype=value.dtype, device="meta")
        else:
            state[key] = "not a tensor"


@pytest.mark.parametrize("seed", range(8))
def test_the_direct_path_refuses_what_the_ordinary_path_refuses_in_the_same_words(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The direct path checks the state against the layout's records, not against tensors
    rebuilt from the blob: whatever does not fit, both say so alike and write nothing."""
    with ckpt(tmp_path) as c:
        c.save(1, random_state(random.Random(seed), None))
        c.wait()
    said = []
    stood: list[int] = []
    real = inplace.Direct.stand_in

    def counted(self: inplace.Direct) -> Any:
        stood.append(1)
        return real(self)

    monkeypatch.setattr(inplace.Direct, "stand_in", counted)
    for direct in (True, False):
        stood.clear()
        target = random_state(random.Random(seed), 0.0)
        misfit(target, random.Random(seed))
        before = {
            k: v.clone() for k, v in target.items() if isinstance(v, torch.Tensor) and not v.is_meta
        }
        if not direct:
            no_direct(monkeypatch)
        with ckpt(tmp_path) as c, pytest.raises(StateMismatch) as refused:
            c.restore(target)
        said.append(str(refused.value))
        assert bool(stood) == direct, "the first restore did not check the direct way"
        for key, value in before.items():
            assert torch.equal(target[key], value), key
    assert said[0] == said[1]
    assert "nothing was written" in said[0]


def test_a_state_that_does_not_fit_gets_nothing_written(tmp_path: Path) -> None:
    with ckpt(tmp_path) as c:
        c.save(1, big_state(1))
        c.wait()
    target = {"w": torch.zeros(10), "step": 0}
    with ckpt(tmp_path) as c, pytest.raises(StateMismatch, match="nothing was written"):
        c.restore(target)
    assert bool((target["w"] == 0).all())
    assert target["step"] == 0


def test_one_rank_damaged_everywhere_sends_every_rank_to_the_older_version(
    tmp_path: Path,
) -> None:
    """Rank 0 writes version 2 into its state; rank 1 finds its own version 2 damaged and has
    no other copy: both go back to version 1, rank 0's state overwritten whole."""
    world = 2
    group = LocalGroup(world)

    def job(rank: int) -> SyncCheckpointer:
        return SyncCheckpointer(
            "job",
            rank=rank,
            world_size=world,
            ranks_per_node=1,
            coordinator=group.coordinator(rank),
            local_root=tmp_path / f"node{rank}",
            persistent=(tmp_path / "durable").as_uri(),
            tiers=["local"],
            keep=2,
        )

    def state(version: int, rank: int) -> dict[str, Any]:
        s = big_state(version * 10 + rank)
        s["step"] = version
        return s

    def save(rank: int) -> None:
        with job(rank) as c:
            for v in (1, 2):
                c.save(v, state(v, rank))
                c.wait()

    run_ranks(world, save)
    flip_in_chunk(next((tmp_path / "node1").rglob("v000000000002/r00001.full")), 1)
    targets = [{"w": torch.zeros_like(state(1, r)["w"]), "step": 0} for r in range(world)]

    def restore(rank: int) -> Any:
        with job(rank) as c:
            return c.restore(targets[rank])

    got = run_ranks(world, restore)
    for r in range(world):
        assert got[r].version == 1
        assert 2 in got[r].rejected
        assert_state_equal(targets[r], state(1, r))


def test_after_a_restore_the_next_saves_memory_is_readied_in_the_background(
    tmp_path: Path,
) -> None:
    """The first save of a restarted job would size, back and fault in its shared memory
    inside the training step; after a restore the local tier prepares it beforehand, sized as
    the restored blob, and the first save takes it (the spare file becomes the blob)."""
    with ckpt(tmp_path, tiers=["local"]) as c:
        c.save(1, big_state(1))
        c.wait()
    size = blob(tmp_path, "node").stat().st_size
    target = {"w": torch.zeros_like(big_state(1)["w"]), "step": 0}
    with ckpt(tmp_path, tiers=["local"]) as c:
        assert c.restore(target) is not None
        spares = tmp_path / "node"
        deadline = time.monotonic() + 30
        found: list[Path] = []
        while not found and time.monotonic() < deadline:
            found = [p for p in spares.rglob(".tiercheck#spares/*") if p.stat().st_size == size]
            time.sleep(0.01)
        assert found, "no memory was prepared after the restore"
        c.save(2, big_state(2))
        c.wait()
        assert not found[0].exists()  # taken by the save: renamed over its blob
    assert blob(tmp_path, "node", 2).stat().st_size == size
    target2 = {"w": torch.zeros_like(big_state(1)["w"]), "step": 0}
    with ckpt(tmp_path, tiers=["local"]) as c:
        got = c.restore(target2)
    assert got is not None
    assert got.version == 2
    assert_state_equal(target2, big_state(2))

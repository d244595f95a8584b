"""Shared test helpers: a tiny deterministic trainer and exact state comparison."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist


class TinyTrainer:
    """A small MLP with AdamW, stepping deterministically on generated data."""

    def __init__(self, seed: int = 0, width: int = 32) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(width, width),
            torch.nn.GELU(),
            torch.nn.LayerNorm(width),
            torch.nn.Linear(width, 4),
        )
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.width = width
        self.steps = 0

    def step(self) -> None:
        """One optimizer step on a batch that depends only on the step number."""
        gen = torch.Generator().manual_seed(1000 + self.steps)
        x = torch.randn(8, self.width, generator=gen)
        loss = self.model(x).square().mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.steps += 1

    def state(self) -> dict[str, Any]:
        """What a training loop saves: live tensors, not copies."""
        return {
            "model": self.model.state_dict(),
            "optim": self.opt.state_dict(),
            "steps": self.steps,
        }


def clone_state(state: Any) -> Any:
    """A deep copy of a nested state (tensors cloned)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [clone_state(v) for v in state]
    if isinstance(state, tuple):
        return tuple(clone_state(v) for v in state)
    return state


def assert_state_equal(a: Any, b: Any, path: str = "state") -> None:
    """Bit-exact equality of two nested states (tensors compared by their bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype, f"{path}: {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: {a.shape} != {b.shape}"
        assert torch.equal(_bytes(a), _bytes(b)), f"{path}: bytes differ"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict), path
        assert set(a) == set(b), f"{path}: keys differ: {set(a) ^ set(b)}"
        for k in a:
            assert_state_equal(a[k], b[k], f"{path}[{k!r}]")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_equal(x, y, f"{path}[{i}]")
        return
    assert a == b, f"{path}: {a!r} != {b!r}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A real gloo process group of one rank on loopback, for the span of the block (a test
    module that already has one skips)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def mount_tmpfs(where: Path, size: int) -> None:
    """Mount a new tmpfs of ``size`` bytes on ``where``; skip the test where that is refused."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (this test runs the real full filesystem)")
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        pytest.skip("no mount command on this machine")
    if done.returncode != 0:
        pytest.skip(f"this machine refuses to mount a tmpfs: {done.stderr.strip()}")


def unmount(where: Path) -> None:
    """Unmount what :func:`mount_tmpfs` mounted (lazily if a straggler keeps it busy)."""
    done = subprocess.run(["umount", str(where)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        # Still busy (a child that outlived its timeout): detach it now, freed when idle.
        lazy = subprocess.run(
            ["umount", "-l", str(where)], capture_output=True, text=True, check=False
        )
        if lazy.returncode != 0:
            raise RuntimeError(f"could not unmount the test tmpfs {where}: {lazy.stderr}")


def run_ranks(world: int, fn: Callable[[int], Any], *, timeout: float = 120.0) -> list[Any]:
    """``fn(rank)`` for every rank of ``world``, each on a thread (the ranks of one
    :class:`tiercheck.testing.LocalGroup`); the results in rank order, or the first error."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank hung"
    if errors:
        raise errors[0]
    return results

"""The distributed coordinator: a channel whose exchange failed fails at once afterwards."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from tiercheck.consistency.coordinator import SoloCoordinator, TorchCoordinator
from tiercheck.errors import PeerUnavailable


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo job of one rank, in this process (the coordinator needs an initialized group)."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_exchanges_work_and_nothing_is_broken(one_rank: None) -> None:
    coordinator = TorchCoordinator(["control", "local"])
    assert coordinator.all_gather("control", b"abc") == [b"abc"]
    assert coordinator.all_gather("local", b"") == [b""]
    assert coordinator.broken is None
    coordinator.close()


def test_a_failed_exchange_breaks_its_channel_for_good(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a gloo failure the ranks no longer agree on where the channel stands: later calls
    fail at once instead of waiting for another timeout; other channels are unaffected."""
    coordinator = TorchCoordinator(["control", "local"])
    real = dist.all_gather
    calls = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("group"))
        if kwargs.get("group") is coordinator._groups["local"]:
            raise RuntimeError("Connection closed by peer")
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "all_gather", failing)
    with pytest.raises(PeerUnavailable):
        coordinator.all_gather("local", b"x")
    tried = len(calls)
    with pytest.raises(PeerUnavailable, match="broken"):
        coordinator.all_gather("local", b"x")
    assert len(calls) == tried, "a broken channel is not used again"
    assert coordinator.broken is not None
    assert "Connection closed by peer" in coordinator.broken
    assert coordinator.all_gather("control", b"ok") == [b"ok"]
    coordinator.close()


def test_close_leaves_a_group_whose_exchange_is_in_flight(one_rank: None) -> None:
    """Destroying a gloo group waits for its running collective; a channel still exchanging
    (a rank died mid-exchange) is left alone so that close never waits on it."""
    coordinator = TorchCoordinator(["control", "local"])
    busy = coordinator._locks["local"]
    busy.acquire()  # as an exchange in flight holds it
    try:
        done = threading.Event()
        closer = threading.Thread(target=lambda: (coordinator.close(), done.set()), daemon=True)
        closer.start()
        assert done.wait(60), "close waited on the busy channel"
        assert list(coordinator._groups) == ["local"]
    finally:
        busy.release()
    coordinator.close()
    assert coordinator._groups == {}


def test_the_solo_coordinator_is_never_broken() -> None:
    assert SoloCoordinator().broken is None

"""``Stateful`` objects in the state: saved through ``state_dict()``, restored through
``load_state_dict()`` (one process; FSDP2 across ranks: tests/distributed/test_fsdp2.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tiercheck import Replicated, StatefulError, StateMismatch, SyncCheckpointer
from tiercheck.engine.stateful import for_restore, for_save, is_stateful
from tiercheck.errors import UnsupportedObject


class Counter:
    """A user's own Stateful: records what it was given."""

    def __init__(self, value: float = 0.0) -> None:
        self.weights = torch.full((4,), value)
        self.calls = 0
        self.loaded: list[Any] = []

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        return {"weights": self.weights, "calls": self.calls}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded.append(state_dict)
        self.weights = state_dict["weights"]
        self.calls = state_dict["calls"]


class Refuses(Counter):
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise ValueError("this object refuses everything")


def _rank_of_two(tmp_path: Path, rank: int, group: Any) -> SyncCheckpointer:
    """Rank ``rank`` of a job of two ranks on two nodes (threads, over ``group``)."""
    return SyncCheckpointer(
        "job",
        rank=rank,
        world_size=2,
        ranks_per_node=1,
        coordinator=group.coordinator(rank),
        local_root=tmp_path / f"node{rank}",
        persistent=(tmp_path / "durable").as_uri(),
        tiers=["local", "persistent"],
        peer_timeout=30,
    )


def _ckpt(tmp_path: Path) -> SyncCheckpointer:
    return SyncCheckpointer(
        "stateful", local_root=tmp_path / "shm", persistent=(tmp_path / "d").as_uri()
    )


def test_what_counts_as_stateful() -> None:
    assert is_stateful(Counter())
    assert is_stateful(torch.nn.Linear(2, 2))
    assert is_stateful(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    assert not is_stateful({"state_dict": 1})
    assert not is_stateful(torch.zeros(2))
    assert not is_stateful(3)
    assert not is_stateful(Counter)  # the class, not an instance


def test_a_state_without_stateful_objects_is_handed_over_as_it_is() -> None:
    inner = {"w": torch.zeros(2)}
    state = {"model": inner, "items": [1, (2, torch.ones(1))], "step": 3}
    assert for_save(state) is state
    prepared = for_restore(state)
    assert prepared.target is state
    assert prepared.lenients == []


def test_saving_copies_only_the_containers_on_the_way_to_a_stateful() -> None:
    untouched = {"w": torch.zeros(2)}
    counter, other = Counter(1.0), Counter(2.0)
    state = {"plain": untouched, "nested": [counter], "pair": (1, other), "step": 1}
    saved = for_save(state)
    assert saved is not state
    assert saved["plain"] is untouched
    assert saved["nested"][0]["weights"] is counter.weights
    assert saved["pair"][0] == 1
    assert saved["pair"][1]["weights"] is other.weights
    assert state["nested"][0] is counter  # the caller's containers are not modified
    assert state["pair"][1] is other


def test_restore_calls_load_state_dict_with_values_of_their_own(tmp_path: Path) -> None:
    with _ckpt(tmp_path) as ckpt:
        saved = Counter(2.5)
        ckpt.save(1, {"obj": saved, "step": 7, "extra": {"t": torch.arange(3)}})
        ckpt.wait()
        fresh = Counter()
        extra = {"t": torch.zeros(3, dtype=torch.int64)}
        state = {"obj": fresh, "step": 0, "extra": extra}
        restored = ckpt.restore(state)
        assert restored is not None
        assert restored.state is state
        assert state["obj"] is fresh
        assert state["step"] == 7
        assert state["extra"] is extra
        assert torch.equal(extra["t"], torch.arange(3))
        assert len(fresh.loaded) == 1
        assert torch.equal(fresh.weights, torch.full((4,), 2.5))
        assert fresh.calls == 1
        # Filled in place: the object's own tensor, not a view of the restore's buffer.
        assert fresh.weights.untyped_storage().nbytes() == fresh.weights.nbytes
        # Without a target: the state_dict as saved.
        plain = ckpt.restore()
        assert plain is not None
        assert torch.equal(plain.state["obj"]["weights"], torch.full((4,), 2.5))


def test_a_stateful_may_be_the_whole_state(tmp_path: Path) -> None:
    with _ckpt(tmp_path) as ckpt:
        ckpt.save(1, Counter(4.0))
        ckpt.wait()
        fresh = Counter()
        restored = ckpt.restore(fresh)
        assert restored is not None
        assert restored.state is fresh
        assert torch.equal(fresh.weights, torch.full((4,), 4.0))


@pytest.mark.parametrize("strict", [True, False])
def test_a_stateful_the_version_lacks_is_refused_before_anything_is_written(
    tmp_path: Path, strict: bool
) -> None:
    with _ckpt(tmp_path) as ckpt:
        ckpt.save(1, {"a": Counter(1.0)})
        ckpt.wait()
        a, b = Counter(), Counter()
        with pytest.raises(StateMismatch, match="'b'"):
            ckpt.restore({"a": a, "b": b}, strict=strict)
        assert a.loaded == []
        assert b.loaded == []
        assert torch.equal(a.weights, torch.zeros(4))


def test_load_state_dict_raising_is_a_typed_error(tmp_path: Path) -> None:
    with _ckpt(tmp_path) as ckpt:
        ckpt.save(1, {"a": Counter(1.0)})
        ckpt.wait()
        with pytest.raises(StatefulError, match=r"Refuses\.load_state_dict") as info:
            ckpt.restore({"a": Refuses()})
        assert isinstance(info.value.__cause__, ValueError)


def test_shape_mismatch_inside_a_stateful_is_still_a_mismatch(tmp_path: Path) -> None:
    with _ckpt(tmp_path) as ckpt:
        ckpt.save(1, {"m": torch.nn.Linear(3, 2)})
        ckpt.wait()
        other = torch.nn.Linear(4, 2)
        before = other.weight.detach().clone()
        with pytest.raises(StateMismatch, match=r"float32\(2, 4\)"):
            ckpt.restore({"m": other})
        assert torch.equal(other.weight, before)


def test_load_state_dict_failing_on_one_rank_fails_the_restore_on_every_rank(
    tmp_path: Path,
) -> None:
    from tests.test_never_lose import run_ranks
    from tiercheck.testing import LocalGroup

    def ckpt_of(rank: int, group: LocalGroup) -> SyncCheckpointer:
        return _rank_of_two(tmp_path, rank, group)

    saving = LocalGroup(2)

    def save(rank: int) -> None:
        with ckpt_of(rank, saving) as ckpt:
            ckpt.save(1, {"a": Counter(1.0)})
            ckpt.wait()

    run_ranks(2, save)
    restoring = LocalGroup(2)
    raised: dict[int, str] = {}

    def restore(rank: int) -> None:
        with ckpt_of(rank, restoring) as ckpt:
            try:
                ckpt.restore({"a": Refuses() if rank == 1 else Counter()})
            except StatefulError as exc:
                raised[rank] = str(exc)

    run_ranks(2, restore)
    assert "Refuses.load_state_dict" in raised[1]
    assert "failed on ranks [1]" in raised[0]
    # Nothing stored was harmed: both ranks restore with objects that accept the value.
    again = LocalGroup(2)

    def fine(rank: int) -> float:
        with ckpt_of(rank, again) as ckpt:
            obj = Counter()
            assert ckpt.restore({"a": obj}) is not None
            return float(obj.weights[0])

    assert run_ranks(2, fine) == [1.0, 1.0]


class NaturalFSDP2App:
    """The ``Stateful`` torchtitan and DCP users write: ``get_state_dict(model, opt)``, which
    initialises an optimizer that has not stepped (a step with zero gradients: AdamW's
    ``step`` becomes 1 and its weight decay moves the weights)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt
        self.asked = 0

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.asked += 1
        model_state, optim_state = get_state_dict(self.model, self.opt)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.opt,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def _train(tmp_path: Path | None, steps: int = 5) -> tuple[list[torch.Tensor], int]:
    """A fresh run of ``steps`` AdamW steps, with tiercheck (restore first, save every step)
    when ``tmp_path`` is given; the final weights and how often ``state_dict`` was asked for
    before the first step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    app = NaturalFSDP2App(model, opt)
    ckpt = None if tmp_path is None else _ckpt(tmp_path)
    if ckpt is not None:
        assert ckpt.restore({"app": app}) is None
    asked = app.asked
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        loss = model(torch.randn(16, 8, generator=data)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ckpt is not None:
            ckpt.save(step, {"app": app})
    if ckpt is not None:
        ckpt.close()
    return [p.detach().clone() for p in model.parameters()], asked


def test_a_fresh_run_trains_bit_for_bit_as_without_tiercheck(tmp_path: Path) -> None:
    """#19: a restore with nothing stored must not call the caller's ``state_dict()``; with the
    natural FSDP2 ``Stateful`` that would step a fresh AdamW once and the run would diverge."""
    without, _ = _train(None)
    with_it, asked = _train(tmp_path)
    assert asked == 0  # nothing of the caller's ran before the ranks knew there was a version
    for a, b in zip(without, with_it, strict=True):
        assert torch.equal(a, b)
    # And when there is something to restore, the same object gets it (state_dict is asked
    # for then, to fill in place): the last step's weights come back.
    torch.manual_seed(123)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    app = NaturalFSDP2App(model, opt)
    with _ckpt(tmp_path) as ckpt:
        restored = ckpt.restore({"app": app})
    assert restored is not None
    assert restored.version == 4
    assert app.asked == 1
    for a, b in zip(with_it, model.parameters(), strict=True):
        assert torch.equal(a, b.detach())
    assert opt.state_dict()["state"][0]["step"].item() == 5.0


def test_a_state_dict_that_raises_fails_the_restore_on_every_rank(tmp_path: Path) -> None:
    """Asking for the targets happens after the ranks agreed; when it raises on one rank,
    every rank raises (none waits for the other), and nothing stored changes."""
    from tests.test_never_lose import run_ranks
    from tiercheck.testing import LocalGroup

    def ckpt_of(rank: int, group: LocalGroup) -> SyncCheckpointer:
        return _rank_of_two(tmp_path, rank, group)

    saving = LocalGroup(2)

    def save(rank: int) -> None:
        with ckpt_of(rank, saving) as ckpt:
            ckpt.save(1, {"a": Counter(1.0)})
            ckpt.wait()

    run_ranks(2, save)

    class Broken(Counter):
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("cannot build my state_dict")

    restoring = LocalGroup(2)
    raised: dict[int, BaseException] = {}

    def restore(rank: int) -> None:
        with ckpt_of(rank, restoring) as ckpt:
            try:
                ckpt.restore({"a": Broken() if rank == 1 else Counter()})
            except Exception as exc:
                raised[rank] = exc

    run_ranks(2, restore, timeout=60)
    assert isinstance(raised[1], StatefulError), raised
    assert isinstance(raised[0], StatefulError), raised
    assert "cannot build my state_dict" in str(raised[0])
    again = LocalGroup(2)

    def fine(rank: int) -> float:
        with ckpt_of(rank, again) as ckpt:
            obj = Counter()
            assert ckpt.restore({"a": obj}) is not None
            return float(obj.weights[0])

    assert run_ranks(2, fine) == [1.0, 1.0]


def _recursing(n: int) -> None:
    if n:
        _recursing(n - 1)
    raise RecursionError("the caller's own")


class _RecursingStateful:
    def state_dict(self) -> dict[str, Any]:
        _recursing(3)
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("not called")


def test_the_walks_refuse_cycles_and_absurd_nesting_by_path() -> None:
    """for_save and for_restore walk every container of every save: they check nothing per
    container, and turn the RecursionError a cycle or a nesting thousands deep ends in into
    an UnsupportedObject naming the path; a RecursionError of the caller's own is kept."""
    looped: list[Any] = [torch.ones(1)]
    looped.append({"back": looped})
    wrapped = Replicated(None)
    wrapped.value = [wrapped]
    deep: Any = torch.ones(1)
    for _ in range(5000):
        deep = [deep]
    cases = [
        ({"a": looped}, r"state\['a'\]\[1\]\['back'\]: it is state\['a'\] itself"),
        ({"r": wrapped}, r"state\['r'\]\[0\]: it is state\['r'\] itself"),
        ({"deep": deep}, r"state\['deep'\](\[0\]){99}: containers nested more than 100 deep"),
    ]
    for state, where in cases:
        with pytest.raises(UnsupportedObject, match="cannot store " + where):
            for_save(state)
        with pytest.raises(UnsupportedObject, match="cannot store " + where):
            for_save(state, None, [])  # the walk that records Replicated paths
        with pytest.raises(UnsupportedObject, match="cannot restore into " + where):
            for_restore(state)
    with pytest.raises(RecursionError, match="the caller's own"):
        for_save({"s": _RecursingStateful()})
    # A shared (not cyclic) sub-state is fine, and so is a nesting of 100.
    shared = {"t": torch.ones(1)}
    nested: Any = torch.ones(1)
    for _ in range(100):
        nested = [nested]
    assert for_save({"a": shared, "b": shared, "n": nested})["a"] is shared

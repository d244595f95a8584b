"""The ready Stateful adapters: a model with a (fresh) optimizer, and the RNG states."""

from __future__ import annotations

import random
from pathlib import Path

import msgpack
import numpy as np
import torch

from tiercheck import SyncCheckpointer
from tiercheck.adapters import ModelAndOptimizer, RNGState
from tiercheck.codec import flatten


def _model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(5, 6, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_a_fresh_adamw_is_restored_and_training_continues_bit_exact(tmp_path: Path) -> None:
    reference, ref_opt = _model_and_opt()
    _train(reference, ref_opt, range(6))

    model, opt = _model_and_opt()
    _train(model, opt, range(3))
    with SyncCheckpointer(
        "mo", local_root=tmp_path / "shm", persistent=(tmp_path / "d").as_uri()
    ) as ckpt:
        ckpt.save(3, {"app": ModelAndOptimizer(model, opt)})
        ckpt.wait()
        fresh, fresh_opt = _model_and_opt()
        assert fresh_opt.state_dict()["state"] == {}
        restored = ckpt.restore({"app": ModelAndOptimizer(fresh, fresh_opt)})
        assert restored is not None
        assert restored.version == 3
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    saved, got = opt.state_dict(), fresh_opt.state_dict()
    assert got["param_groups"] == saved["param_groups"]
    assert sorted(got["state"]) == sorted(saved["state"])
    for index, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(got["state"][index][key], value)
    _train(fresh, fresh_opt, range(3, 6))
    for a, b in zip(fresh.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_fresh_start_leaves_a_fresh_optimizer_untouched(tmp_path: Path) -> None:
    # get_state_dict would initialize it with a zero-gradient step (its step counter moves).
    model, opt = _model_and_opt()
    with SyncCheckpointer(
        "fresh", local_root=tmp_path / "shm", persistent=(tmp_path / "d").as_uri()
    ) as ckpt:
        assert ckpt.restore({"app": ModelAndOptimizer(model, opt)}) is None
    assert opt.state_dict()["state"] == {}


def test_saving_before_the_first_step_changes_nothing(tmp_path: Path) -> None:
    reference, ref_opt = _model_and_opt()
    _train(reference, ref_opt, range(3))
    model, opt = _model_and_opt()
    with SyncCheckpointer(
        "first", local_root=tmp_path / "shm", persistent=(tmp_path / "d").as_uri()
    ) as ckpt:
        ckpt.save(0, {"app": ModelAndOptimizer(model, opt)})  # before any step
        ckpt.wait()
        assert opt.state_dict()["state"] == {}
        fresh, fresh_opt = _model_and_opt()
        assert ckpt.restore({"app": ModelAndOptimizer(fresh, fresh_opt)}) is not None
    assert fresh_opt.state_dict()["state"] == {}
    for m, o in ((model, opt), (fresh, fresh_opt)):
        _train(m, o, range(3))
        for a, b in zip(m.state_dict().values(), reference.state_dict().values(), strict=True):
            assert torch.equal(a, b)


def test_rng_states_are_plain_data_and_restore_every_stream(tmp_path: Path) -> None:
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    rng = RNGState()
    layout, tensors = flatten(rng.state_dict())  # refuses anything it would have to pickle
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # python words, numpy key, torch state, and one state per CUDA device where there are any
    assert len(tensors) == 3 + cuda_devices

    def ext_codes(data: bytes) -> list[int]:
        codes: list[int] = []

        def hook(code: int, payload: bytes) -> None:
            codes.append(code)

        msgpack.unpackb(data, ext_hook=hook, strict_map_key=False)
        return codes

    assert 11 not in ext_codes(layout.skeleton)  # no pickle extension
    with SyncCheckpointer(
        "rng", local_root=tmp_path / "shm", persistent=(tmp_path / "d").as_uri()
    ) as ckpt:
        ckpt.save(1, {"rng": rng})
        expected = (random.random(), np.random.rand(3), torch.rand(3), np.random.randn())
        expected_cuda = [torch.rand(3, device=f"cuda:{d}") for d in range(cuda_devices)]
        ckpt.wait()
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        np.random.randn()  # leaves a cached Gaussian behind: it must be replaced too
        assert ckpt.restore({"rng": RNGState()}) is not None
    got = (random.random(), np.random.rand(3), torch.rand(3), np.random.randn())
    got_cuda = [torch.rand(3, device=f"cuda:{d}") for d in range(cuda_devices)]
    assert all(torch.equal(a, b) for a, b in zip(got_cuda, expected_cuda, strict=True))
    assert got[0] == expected[0]
    assert np.array_equal(got[1], expected[1])
    assert torch.equal(got[2], expected[2])
    assert got[3] == expected[3]

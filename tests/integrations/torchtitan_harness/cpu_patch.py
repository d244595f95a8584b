"""Patches that let torchtitan 0.3.0's real trainer run on a CPU build of torch 2.13 (gloo).

Imported before anything of torchtitan; nothing in site-packages is edited. Each one answers a
fact of that pairing (found running it here; see docs/integrations.md, torchtitan):

* torchtitan imports ``triton`` at import time (its MoE kernels) without declaring it: that one
  kernels module is stubbed (a fake ``triton`` would make torch believe triton is there);
* its device detection falls back to ``"cuda"``: ``device_type`` is set to ``"cpu"`` (gloo);
* its memory monitor calls CUDA-only functions: replaced by one that reports zeros;
* FSDP2 reduce-scatters with ``PREMUL_SUM``, which gloo rejects: sum reduction is forced (a sum
  and a divide by 1.0, the same numbers);
* after the first step it sets process-group timeouts through a barrier with CPU device ids
  and ``torch.distributed.set_timeout`` (absent in torch 2.13): a plain barrier instead.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch
import torch.distributed as dist

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _stub_triton_kernels() -> None:
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    module = types.ModuleType(name)

    def missing(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*_args: Any, **_kwargs: Any) -> Any:
            raise RuntimeError(f"{attr}: triton kernels are not available on CPU")

        return unavailable

    module.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules.setdefault(name, module)


def _cpu_device() -> None:
    from torchtitan.tools import utils

    utils.device_type, utils.device_module = "cpu", torch.cpu
    utils.get_device_info = lambda: ("cpu", torch.cpu)


def _memory_monitor() -> None:
    from torchtitan.components import metrics

    class CpuMemoryMonitor:
        def __init__(self, device: str = "cpu") -> None:
            self.device = torch.device("cpu")
            self.device_name = "cpu"
            self.device_index = 0
            self.device_capacity = 1
            self.device_capacity_gib = 0.0

        def get_peak_stats(self) -> Any:
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            return None

    metrics.DeviceMemoryMonitor = CpuMemoryMonitor


def _sum_reduction() -> None:
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self: Any, factor: float) -> None:
        original(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor  # type: ignore[method-assign]


def _timeouts() -> None:
    import torchtitan.distributed.utils as dist_utils

    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: dist.barrier()


_stub_triton_kernels()
_cpu_device()
_memory_monitor()
_sum_reduction()
_timeouts()

"""torchrun entry point of the torchtitan tests: the CPU patches, then ``torchtitan.train``.

``TT_RECORD=FILE``: rank 0 appends each step's loss (``loss STEP HEX``, the float's exact hex)
and what a tiercheck load restored (``restored VERSION TIER``, or ``fresh``).
``TT_KILL_AFTER_SAVE=STEP``: rank 0 SIGKILLs itself as soon as the save of that step returns
(with an overlapped save, before its copy is done).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

RANK = int(os.environ.get("RANK", "0"))
RECORD = os.environ.get("TT_RECORD")
KILL = int(os.environ.get("TT_KILL_AFTER_SAVE", "0"))


def _write(line: str) -> None:
    if RECORD and RANK == 0:
        with open(RECORD, "a", encoding="utf-8") as out:
            out.write(line + "\n")


def _record_losses() -> None:
    from torchtitan.components import metrics

    log = metrics.MetricsProcessor.log

    def logged(self: Any, step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> Any:
        _write(f"loss {step} {float(global_avg_loss).hex()}")
        return log(self, step, global_avg_loss, *args, **kwargs)

    metrics.MetricsProcessor.log = logged


def _watch_tiercheck() -> None:
    from tiercheck.integrations.torchtitan import TiercheckCheckpointManager as Manager

    load, save = Manager._load, Manager._save

    def loaded(self: Any, step: int = -1) -> bool:
        found = load(self, step)
        restored = self.session.restored
        _write(f"restored {restored.version} {restored.source_tier}" if found else "fresh")
        return bool(found)

    def saved(self: Any, curr_step: int, last_step: bool = False) -> bool:
        done = save(self, curr_step, last_step)
        if RANK == 0 and curr_step == KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        return bool(done)

    Manager._load, Manager._save = loaded, saved


def run() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cpu_patch  # noqa: F401  (before anything of torchtitan)

    _record_losses()
    if os.environ.get("TT_TIERCHECK") == "1":
        _watch_tiercheck()
    from torchtitan.train import main

    main()


if __name__ == "__main__":
    run()

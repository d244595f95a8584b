"""What the torchrun training scripts report, one JSON object per line, one file per rank.

Imported by ``lightning_ddp_train.py`` and ``hf_ddp_train.py`` (run as scripts by torchrun,
with this folder on ``sys.path``); the tests read the files (``_runs.Torchrun``).

Every event carries ``launch`` (a name the test gives each torchrun command), ``attempt``
(torchrun's restart count), ``rank`` and ``pid``. Events: ``start`` (the process is up),
``resumed`` (training starts: the step, and what was restored from which tiers),
``committed`` (a version committed in a tier, for every rank), ``done`` (final weights
written).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiercheck import Restored, SaveHandle


class Events:
    """Appends this rank's events to ``<out>/events-r<rank>.jsonl``."""

    def __init__(self, out: Path, launch: str) -> None:
        self.out = out
        self.rank = int(os.environ["RANK"])
        self.common = {
            "launch": launch,
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "rank": self.rank,
            "pid": os.getpid(),
        }
        out.mkdir(parents=True, exist_ok=True)
        self.file = (out / f"events-r{self.rank}.jsonl").open("a", encoding="utf-8")

    def __call__(self, event: str, **fields: Any) -> None:
        record = {"e": event, "t": time.time(), **self.common, **fields}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def resumed(self, step: int, restored: Restored | None) -> None:
        """Training starts at ``step``, from ``restored`` (``None``: a fresh start)."""
        if restored is None:
            self("resumed", step=step, version=None, source=None, sources={})
        else:
            self(
                "resumed",
                step=step,
                version=restored.version,
                source=restored.source_tier,
                sources={str(r): t for r, t in restored.source_tiers.items()},
                saved_by=restored.saved_by,
            )


class Commits:
    """Reports each version as it commits in each of its tiers (polled between steps)."""

    def __init__(self, events: Events, last_save: Callable[[], SaveHandle | None]) -> None:
        self.events, self.last_save = events, last_save
        self.seen: SaveHandle | None = None
        self.pending: dict[SaveHandle, set[str]] = {}

    def poll(self) -> None:
        handle = self.last_save()
        if handle is not None and handle is not self.seen:
            self.seen = handle
            self.pending[handle] = set(handle.tiers)
        for h, tiers in list(self.pending.items()):
            for tier in sorted(tiers):
                if h.committed(tier):
                    self.events("committed", version=h.version, tier=tier)
                    tiers.discard(tier)
            if not tiers:
                del self.pending[h]

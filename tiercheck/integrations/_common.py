"""What both trainer integrations share: checkpoint names, RNG states, the lazy checkpointer.

Nothing here imports Lightning or transformers.

Several processes: a :class:`Session` opens its checkpointer on first use, and opening, saving
and restoring are collective (every rank, in the same order, after ``torch.distributed`` is
initialized). The integrations therefore make every rank save and load, and decide before the
process group exists only what every rank can decide alike: :meth:`Session.holds_anything`.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
import torch

from tiercheck import PersistentTier
from tiercheck.checkpointer import Restored, SaveHandle
from tiercheck.consistency.identity import JOB_KEY
from tiercheck.consistency.keys import MAX_VERSION, check_version
from tiercheck.defaults import check_job_id
from tiercheck.errors import ConfigError, VersionError
from tiercheck.guards import node_holds_data
from tiercheck.sync import SyncCheckpointer

__all__ = [
    "LATEST",
    "PREFIX",
    "RESUME",
    "Session",
    "Target",
    "capture_rng",
    "parse_name",
    "restore_rng",
    "version_name",
]

#: Prefix of the names that address tiercheck versions directly, not through a file.
PREFIX = "tiercheck:"

#: The name of "the newest version every rank can rebuild, from the fastest tier holding it".
LATEST = "tiercheck:latest"

#: The name of "the newest version every rank can rebuild, or a fresh start when there is none":
#: :data:`LATEST`, except that finding nothing restorable is not an error. It is decided when
#: loaded, by every rank together, so it can be handed out before the process group exists.
RESUME = "tiercheck:resume"

# ASCII digits only (``\d`` takes other scripts' digits too), the whole name (``$`` would let a
# trailing newline through).
_VERSION = re.compile(r"tiercheck:([0-9]+)")

#: What a checkpoint name asks for: one version, the newest restorable one, or that or nothing.
Target = int | Literal["latest", "resume"]


def version_name(version: int) -> str:
    """The name that addresses ``version`` (a global step) directly: ``"tiercheck:<version>"``."""
    try:
        return f"{PREFIX}{check_version(version)}"
    except VersionError as exc:
        raise ConfigError(str(exc)) from None


def parse_name(name: object) -> Target | None:
    """The version a ``tiercheck:`` name addresses, ``"latest"``, ``"resume"``, or ``None`` for
    other names.

    Raises :class:`~tiercheck.errors.ConfigError` for a ``tiercheck:`` name that is none of
    ``tiercheck:latest``, ``tiercheck:resume`` and ``tiercheck:<step>``, so that a typo never
    reads as a file path.
    """
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str) or not name.startswith(PREFIX):
        return None
    if name == LATEST:
        return "latest"
    if name == RESUME:
        return "resume"
    match = _VERSION.fullmatch(name)
    if match is None or int(match.group(1)) > MAX_VERSION:
        raise ConfigError(
            f"{name!r} is not a tiercheck checkpoint name; use {LATEST!r}, {RESUME!r} or "
            "'tiercheck:<step>'"
        )
    return int(match.group(1))


def capture_rng() -> dict[str, Any]:
    """The global RNG states a training loop draws from: Python, numpy, torch (and CUDA).

    Every value is something the no-pickle flattening stores as is (a tuple of ints, numpy's
    legacy state tuple, uint8 tensors).
    """
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: Mapping[str, Any]) -> None:
    """Set the global RNGs to ``states`` (from :func:`capture_rng`); absent entries are left be.

    CUDA states are restored only where CUDA is available (a checkpoint taken on GPUs can
    still be resumed on a CPU, with the CPU generators exact).
    """
    if "python" in states:
        random.setstate(_as_python_state(states["python"]))
    if "numpy" in states:
        np.random.set_state(tuple(states["numpy"]))
    # Copies: torch's set_rng_state reads a state tensor from the start of its storage,
    # ignoring its offset. Restores give small tensors storage of their own, but a state
    # handed in from elsewhere may be a view.
    if "torch" in states:
        torch.set_rng_state(states["torch"].clone())
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.clone() for s in states["cuda"]])


def _as_python_state(state: Any) -> tuple[Any, ...]:
    # random.setstate wants exactly (version, tuple of ints, gauss_next).
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


class Session:
    """One job's checkpointer as a trainer integration drives it.

    The :class:`~tiercheck.SyncCheckpointer` is built on first use (so placement is detected
    where training runs, after any launcher has set it up) and built again after
    :meth:`close`, because a trainer outlives several ``fit``/``train`` calls. Two saves of the
    same version (a trainer writing one step under two names) store it once: the first wins.
    """

    def __init__(self, job_id: str, options: Mapping[str, Any]) -> None:
        # Refused here, when the trainer is configured, not at its first checkpoint.
        self.job_id = check_job_id(job_id)
        self.options = dict(options)
        self._ckpt: SyncCheckpointer | None = None
        #: Set when the trainer failed: the next :meth:`close` is the bounded one of an error.
        self.failed = False
        #: The newest version saved or restored through this session.
        self.last_version: int | None = None
        #: The handle of the newest save (``None`` before the first).
        self.last_save: SaveHandle | None = None
        #: The result of the newest restore (``None`` before the first, or when it found none).
        self.restored: Restored | None = None

    @property
    def checkpointer(self) -> SyncCheckpointer:
        """The open checkpointer, built and opened on first use."""
        if self._ckpt is None:
            ckpt = SyncCheckpointer(self.job_id, **self.options)
            ckpt.open()
            self._ckpt = ckpt
        return self._ckpt

    def save(self, version: int, make_state: Callable[[], Any]) -> SaveHandle | None:
        """Save ``make_state()`` as ``version``; returns ``None`` (building nothing) when
        ``version`` is the one saved or restored last."""
        if version == self.last_version:
            return None
        handle = self.checkpointer.save(version, make_state())
        self.last_version = version
        self.last_save = handle
        return handle

    def restore(self, target: Target, state: Any = None, *, strict: bool = True) -> Restored | None:
        """Restore ``target`` (into ``state`` in place when given, ``strict`` as
        :meth:`~tiercheck.Checkpointer.restore` takes it); ``None`` when ``"latest"`` or
        ``"resume"`` finds nothing restorable. Collective: every rank calls it.

        A restore changes nothing stored (see :meth:`~tiercheck.Checkpointer.restore`): loading
        an older version to evaluate it drops nothing; a run that resumes from it and saves
        again sets the newer versions aside then, as it continues from there.
        """
        # "latest" and "resume" are the newest every rank can rebuild; a number is exactly it.
        version = None if isinstance(target, str) else target
        restored = self.checkpointer.restore(state, version=version, strict=strict)
        if restored is not None:
            self.last_version = restored.version
        self.restored = restored
        return restored

    def close(self, *, failed: bool = False) -> None:
        """Finish every save in flight in every tier, then release the checkpointer.

        ``failed=True`` (or :attr:`failed` set earlier): the trainer is leaving on an error, so
        the close is bounded and waits for no other rank (see ``SyncCheckpointer.close``).
        """
        ckpt, self._ckpt = self._ckpt, None
        failed = failed or self.failed
        self.failed = False
        if ckpt is not None:
            ckpt.close(failed=failed)

    def holds_anything(self) -> bool:
        """Whether anything of the job may be stored, judged without the other ranks.

        Opens nothing, takes no lock, writes nothing, and needs no process group: it looks at
        the job's folder in the persistent tier (the same for every rank) and at this node's
        memory (the same for every rank of the node). ``False`` only when both are empty, and
        only when the persistent tier is the built-in one (other durable tiers cannot be read
        before the checkpointer opens): then the job has never been opened there, and the
        ranks of a job all come to the same answer. Raises what the persistent tier raises
        when it cannot be read (:class:`~tiercheck.errors.StorageError`,
        :class:`~tiercheck.errors.ConfigError`).
        """
        # Configuring opens nothing; it validates the options and places this rank's node.
        ckpt = SyncCheckpointer(self.job_id, **self.options)
        tiers = self.options.get("tiers")
        if tiers is not None and "persistent" not in [t for t in tiers if isinstance(t, str)]:
            return True
        if node_holds_data(ckpt.node_root):
            return True
        folder = ckpt.persistent_job_url
        options = self.options.get("storage_options")
        # A thread of its own: the caller may be running an event loop.
        with ThreadPoolExecutor(1, thread_name_prefix="tiercheck-peek") as pool:
            return pool.submit(asyncio.run, _durable_holds(folder, options)).result()


async def _durable_holds(folder: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether the persistent job folder holds a job record, or anything else at all."""
    tier = PersistentTier(folder, storage_options=storage_options)
    try:
        if await tier.exists(JOB_KEY):
            return True
        # Jobs saved before job records existed have only versions.
        async for _key in tier.list():
            return True
        return False
    finally:
        await tier.aclose()

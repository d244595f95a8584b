"""Whether a process exists: the one check the tiers' temporary files and the manifest's
carry-over share (a leaf: it imports nothing of tiercheck)."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (in this pid namespace)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        # It exists but belongs to another user.
        return True
    return True

"""The peer tier's wire: how requests name their data transfers and cut them into chunks.

Control messages are msgpack dicts in the job's key-value store (``req/<holder>/<seq>`` for a
request, ``resp/<requester>/<holder>/<seq>/<step>`` for an answer, ``step`` being ``ready`` or
``done``); data moves by gloo point-to-point, in chunks tagged by :func:`chunk_tag`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch

from tiercheck.errors import ConfigError, TiercheckError
from tiercheck.tiers.base import validate_key

# An idle server blocks in one long store wait (each timed-out wait makes c10d log a warning,
# so it must not poll); closing wakes it with a "stop" request of its own.
IDLE_WAIT = datetime.timedelta(seconds=60)
MAX_CHUNKS = 1 << 10
SEQ_SPACE = 1 << 19


def chunk_tag(seq: int, op: str, chunk: int) -> int:
    """The gloo tag of one chunk of a request's data.

    Every outstanding message between two ranks gets a tag of its own: gloo does not pair
    several pending receives of one tag reliably. The lowest bit tells puts from gets: two
    ranks may hold each other's replicas (a ring of two nodes), one rank's server then receives
    put data from the other while its requester receives get data from it, and their sequence
    numbers come from different counters.
    """
    return (((seq % SEQ_SPACE) * MAX_CHUNKS + chunk) << 1) | (1 if op == "get" else 0)


DEFAULT_CHUNK = 64 << 20
#: A get moves in chunks of at most this size: the holder reads the next ones from its
#: replica's file while this one is on the wire (the chunk travels with the request).
GET_CHUNK = 8 << 20
#: How many chunks of a get the holder reads ahead (its staging buffers).
GET_DEPTH = 3


def default_store() -> Any:
    """The key-value store ``torch.distributed`` was initialized with."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "the peer tier needs torch.distributed initialized (init_process_group) "
            "or an explicit store= and group="
        )
    world = dist.group.WORLD
    getter = getattr(world, "get_group_store", None)
    if getter is not None:
        return getter()
    return dist.distributed_c10d._get_default_store()


def validate_key_quietly(value: str) -> str | None:
    """``value`` if it is a valid key segment, else ``None``."""
    try:
        return validate_key(value)
    except TiercheckError:
        return None


def chunk_bounds(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(total, a + chunk)) for a in range(0, total, chunk)]


def pieces(views: Sequence[memoryview], chunk: int) -> list[memoryview]:
    """How a message is cut into point-to-point transfers (both sides cut alike)."""
    return [view[a:b] for view in views for a, b in chunk_bounds(view.nbytes, chunk)]


def chunk_size(total: int, preferred: int) -> int:
    """``preferred``, grown if needed so that ``total`` bytes take at most ``MAX_CHUNKS``."""
    return max(preferred, -(-total // MAX_CHUNKS))


def as_tensor(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``view`` (which must be writable: torch refuses read-only memory)."""
    return torch.frombuffer(view, dtype=torch.uint8)


def claim_key(src: int, holder: int, seq: int) -> str:
    """The store key that decides, once, whether ``holder`` serves request ``seq`` of rank
    ``src`` ("served") or ``src`` gave it up ("cancelled"): a compare-and-set from empty."""
    return f"claim/{src}/{holder}/{seq}"

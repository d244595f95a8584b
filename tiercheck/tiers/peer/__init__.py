"""The peer tier: each rank's blobs, replicated into the memory of a rank on another node.

Placement is a ring over nodes (see :meth:`tiercheck.topology.Topology.replica_targets`): the
ranks of node *i* keep their replicas on node *i+1* (more replicas: *i+2*, ...), never on their
own node, so a lost node's checkpoints survive on its neighbour.

Transport, on the engine the training job already runs: ``torch.distributed``.

* **Data** moves by gloo point-to-point on a process group of its own (never the training's),
  in chunks, received straight into the holder's shared memory (no intermediate buffer).
* **Control** -- "rank 3 wants to put 40 MB under key k", "ready", "done" -- goes through the
  job's key-value store (the one ``init_process_group`` set up). A store wait can time out and
  be retried safely, whereas a gloo receive that times out breaks its pair of ranks for good,
  so every rank runs one *server* thread that waits on the store for requests addressed to
  it and does point-to-point only when both sides have agreed on it.

Every request is two-phase where data moves: the requester asks, the holder prepares (or
refuses: full, missing key) and answers, and only then do the bytes flow, so a refused put
never leaves a send hanging.

A dead holder costs one failure, not one per operation. *Any* failed exchange with a holder --
no answer within ``timeout``, a gloo transfer that fails, a store operation that fails --
marks it **down** (logged once, at WARNING, without a traceback), and from then on every
operation that needs it (put, get, delete, exists, size, list) fails at once with
:class:`~tiercheck.errors.PeerUnavailable` instead of waiting. A down holder is tried again
after ``retry_after`` seconds (default: ``timeout``), so a holder that was only slow, or a
restarted one, is used again later; :meth:`PeerTier.mark_down` lets the caller mark one down
on its own knowledge. A refusal by a live holder (missing key, full memory) is an answer, not
a failure: it marks nothing.

Blocking work (store waits, transfers) runs on daemon threads of the tier's own
(:class:`~tiercheck._threads.DaemonExecutor`), never on ``asyncio.to_thread``'s executor, so a
call still waiting on a dead holder never keeps the process alive at exit.

A holder stores the replicas it keeps for others in its own node's shared memory (a
:class:`~tiercheck.tiers.local.LocalTier` under ``holder_root``), so they survive the holder
process crashing too -- only the loss of the holder's node takes them.

Lifecycle: every rank constructs its ``PeerTier`` at the same point of the program (creating the
process group is a collective). The peer tier is usable while the holders' processes are alive
and serving: during training and during restore. Closing has two steps, because the store may
be gone soon after the job ends (its host leaves once its own workers are done):

1. :meth:`PeerTier.stop_serving` -- the last store traffic of this rank: it queues a "stop"
   request behind every earlier one and waits (bounded) for the server thread to finish. A
   job calls it on every rank once every rank is done saving, and leaves only after every rank
   has stopped serving (the checkpointer's close does exactly that).
2. :meth:`PeerTier.aclose` -- releases local resources and touches neither the store nor
   another rank when serving was stopped before; otherwise it stops serving first, bounded.

The tier is split by job: :mod:`~tiercheck.tiers.peer.tier` (the class, its options and
lifecycle), :mod:`~tiercheck.tiers.peer.requester` (asking holders),
:mod:`~tiercheck.tiers.peer.server` (holding replicas for others),
:mod:`~tiercheck.tiers.peer.link` (store connections and down holders) and
:mod:`~tiercheck.tiers.peer.wire` (message names, tags and chunks).
"""

from tiercheck.tiers.peer.tier import PeerTier
from tiercheck.tiers.peer.wire import DEFAULT_CHUNK, validate_key_quietly

__all__ = ["DEFAULT_CHUNK", "PeerTier", "validate_key_quietly"]

"""Guards of one job's stored data, below both the engine and the catalog.

* :mod:`~tiercheck.guards.node` -- a node root: one live writer per rank (:class:`RankLock`,
  :class:`NodeLocks`), and the node identity saying which incarnation its memory belongs to;
* :mod:`~tiercheck.guards.durable` -- a durable location: the job record, the tombstone
  ``tiercheck rm-job`` leaves, writer generations (:class:`Fence`) and the probe.

An opening takes them (:mod:`tiercheck.engine.open`); ``tiercheck rm-job`` takes every lock of a
node root and writes the tombstone (:mod:`tiercheck.catalog.remove`).
"""

from __future__ import annotations

from tiercheck.guards.durable import (
    Fence,
    deletion_facts,
    forget_deleted,
    probe,
    read_job_record,
    read_tombstone,
    write_job_record,
    write_tombstone,
    writer_record,
)
from tiercheck.guards.node import (
    NodeLocks,
    RankLock,
    abandon_node_root,
    discard_node_memory,
    lock_files,
    node_holds_data,
    node_versions,
    read_identity,
    write_identity,
)

__all__ = [
    "Fence",
    "NodeLocks",
    "RankLock",
    "abandon_node_root",
    "deletion_facts",
    "discard_node_memory",
    "forget_deleted",
    "lock_files",
    "node_holds_data",
    "node_versions",
    "probe",
    "read_identity",
    "read_job_record",
    "read_tombstone",
    "write_identity",
    "write_job_record",
    "write_tombstone",
    "writer_record",
]

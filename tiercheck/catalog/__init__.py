"""What is stored where: find, list, inspect, verify, export, trim and remove checkpoints at rest.

The read side of tiercheck, for tools (the ``tiercheck`` command line is built on it) rather than
for training code. It works on *locations*, each one tier's view of one job:

* a **persistent job folder** -- ``<url>/<job_id>/`` of a :class:`~tiercheck.tiers.PersistentTier`
  (``file://``, a plain path, ``s3://``, ``memory://``...): ``packed`` blobs and ``COMMIT``
  records, and beside them the job record (``JOB``), the writer generations (``writers/g...``),
  blobs a restore set aside (``quarantine/<original key>``), the versions the run went back from
  (``abandoned/<tag>/...``: abandoned sets, see :mod:`tiercheck.consistency.abandoned`), after a
  crash while the job was opening, leftover probe objects (``probe/...``), and once ``tiercheck
  rm-job`` deleted the job, its tombstone (``DELETED``) -- see
  :mod:`tiercheck.consistency.identity`;
* a **node root** -- ``/dev/shm/tiercheck/<job>/<node>/`` (any folder holding ``blobs/`` and
  ``manifest/``; the layout is :class:`tiercheck.defaults.NodeRoot`): the node's
  :class:`~tiercheck.tiers.LocalTier` (``blobs/``, usually ``full`` blobs, possibly
  ``quarantine/...`` too), the replicas it keeps for ranks of other nodes (``replicas/``, listed
  with the node root, never a location of their own), its manifest (``manifest/data.mdb``), its
  identity (``identity.json``) and the writers' locks (``locks/``).

One module per step, in the order a command takes them:

* :mod:`~tiercheck.catalog.locate` -- :func:`find_locations` turns what a user typed into
  locations (see its docstring for the rules); :class:`OpenLocation` opens one (its tier and,
  for a node root, its manifest);
* :mod:`~tiercheck.catalog.scan` -- :meth:`OpenLocation.scan` lists it into a :class:`Catalog`:
  versions and their blobs, the job record, the newest writer generation and a node's identity
  (their parse errors become :func:`verify` findings), quarantined blobs apart from the versions
  (nothing reads them as checkpoints: ``inspect`` and ``export`` ignore them, ``verify``
  reports each one, ``gc`` keeps them unless asked to purge them), abandoned sets apart from
  the versions too (:class:`AbandonedSetEntry`; :meth:`Catalog.abandoned_view` shows one as a
  catalog of its own, which ``verify`` checks and ``export`` reads), kept replicas;
* :mod:`~tiercheck.catalog.read` -- :func:`inspect_blobs` reads blob headers, ``decode_blob`` a
  whole blob with its base;
* :mod:`~tiercheck.catalog.verify` -- :func:`verify` checks blobs and records;
* :mod:`~tiercheck.catalog.export` -- :func:`export` writes a version as ``.pt`` and
  ``.safetensors`` files;
* :mod:`~tiercheck.catalog.gc` -- :func:`plan_gc` / :func:`apply_gc` apply retention (abandoned
  sets by the checkpointer's rule, or all of them when asked), which never removes the job
  record, a writer generation, a probe object or the identity file;
* :mod:`~tiercheck.catalog.remove` -- :func:`plan_job_removal` / :func:`remove_job` delete a
  whole job, records included (leaving a tombstone in a persistent job folder), refusing while a
  writer holds the job's lock in a node root; :func:`job_memory` finds the job's memory on this
  node;
* :mod:`~tiercheck.catalog.leftovers` -- what killed writers left (temporary files, unfinished
  uploads), listed with every location and removed by ``gc`` and ``rm-job`` once its writer is
  gone.

:mod:`~tiercheck.catalog.base` holds what they share (:class:`Location`, :class:`Progress`).
All tier I/O goes through the async :class:`~tiercheck.tiers.Tier` API; hashing, decoding, the
manifest and file writes run in worker threads, never on the event loop. The catalog reads what
the checkpointer wrote; it never imports the checkpointer.

What "committed" means here is what recovery trusts: in a persistent job folder, a ``COMMIT``
record; in a node root, the manifest's ``commit`` record for the ``local`` tier (the local tier
writes no ``COMMIT`` objects). A version whose blobs are not all present is *torn*: a problem
when it claims to be committed, normal (a crash mid-save) when it does not.
"""

from __future__ import annotations

from tiercheck.catalog.base import LOCAL_TIER, Location, LocationError, NullProgress, Progress
from tiercheck.catalog.export import EXPORT_MODE, ExportResult, export, safetensors_payload
from tiercheck.catalog.gc import AbandonedFate, GcPlan, apply_gc, plan_gc
from tiercheck.catalog.locate import OpenLocation, default_search_paths, find_locations
from tiercheck.catalog.read import inspect_blobs
from tiercheck.catalog.remove import (
    JobRemoval,
    check_no_writer,
    job_memory,
    plan_job_removal,
    remove_job,
)
from tiercheck.catalog.scan import (
    AbandonedSetEntry,
    BlobEntry,
    BlobKindName,
    Catalog,
    KeptReplicas,
    QuarantinedBlob,
    VersionEntry,
)
from tiercheck.catalog.verify import FINDING_CODES, Finding, VerifyReport, verify

#: The name :class:`KeptReplicas` had before the glossary gave "held" one meaning (deprecated).
HeldReplicas = KeptReplicas

__all__ = [
    "EXPORT_MODE",
    "FINDING_CODES",
    "LOCAL_TIER",
    "AbandonedFate",
    "AbandonedSetEntry",
    "BlobEntry",
    "BlobKindName",
    "Catalog",
    "ExportResult",
    "Finding",
    "GcPlan",
    "JobRemoval",
    "KeptReplicas",
    "Location",
    "LocationError",
    "NullProgress",
    "OpenLocation",
    "Progress",
    "QuarantinedBlob",
    "VerifyReport",
    "VersionEntry",
    "apply_gc",
    "check_no_writer",
    "default_search_paths",
    "export",
    "find_locations",
    "inspect_blobs",
    "job_memory",
    "plan_gc",
    "plan_job_removal",
    "remove_job",
    "safetensors_payload",
    "verify",
]

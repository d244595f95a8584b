"""A seeded chaos soak: a real multi-process job, faults from a catalog, an oracle after each.

Run it::

    python -m tiercheck.testing.chaos --seed 7 --minutes 30        # or: tiercheck chaos ...
    python -m tiercheck.testing.chaos --list                         # the fault catalog
    python -m tiercheck.testing.chaos --catalog --seed 1             # each fault alone: a table

Parts: :mod:`~tiercheck.testing.chaos.catalog` (the faults, the schedule: a pure function of
the seed), :mod:`~tiercheck.testing.chaos.faults` (how each is produced), ``soak`` (start,
watch, crash, restart, end), :mod:`~tiercheck.testing.chaos.oracle` (the invariants),
:mod:`~tiercheck.testing.chaos.model` (the job's deterministic training and its uninterrupted
reference), :mod:`~tiercheck.testing.chaos.worker` (one rank), ``cluster`` (the processes),
``s3`` (the S3 server and the proxy that takes it down), ``driver`` (the command line).
It needs the ``test`` and ``s3`` extras (moto, boto3, s3fs); nothing here is imported by
``import tiercheck``.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """The command line (see :mod:`tiercheck.testing.chaos.driver`)."""
    from tiercheck.testing.chaos.driver import main as driver_main

    return driver_main(argv)

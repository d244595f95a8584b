"""Opening: may this run use these locations, and as whom.

In order: every rank probes its durable tiers and reads its node's identity and locks
(:mod:`.claim`; collective ``open-facts``), the facts of every rank are judged together by a
pure function (:mod:`.judgement`; :mod:`.stale` says why a node's memory is not this run's),
then the claim is made: the job record written once (``job-record``) and the writer generation
taken (``claim``). :mod:`.leftovers` clears what killed writers left and, when the opening
fails, its own remains. A durable tier that could not be reached at opening is tried again
while the job trains and joins once every rank reaches it (:mod:`.rejoin`; ``reached``,
``rejoin``). The session token that names this opening (``session``) is exchanged by
:mod:`tiercheck.engine.collectives`.
"""

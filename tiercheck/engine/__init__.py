"""The checkpointer's engine: everything behind :class:`~tiercheck.Checkpointer`.

Read top-down, its packages tell the story of one run:

* :mod:`~tiercheck.engine.open` -- opening: the job's claim on its locations, the judgement
  whether the opening may go ahead, the leftovers of killed writers cleaned up, and a durable
  tier that was away joined again later;
* :mod:`~tiercheck.engine.save` -- one save: scheduled and planned, staged (the copy out of the
  caller's tensors), encoded, then handed to each tier's pipeline;
* :mod:`~tiercheck.engine.commit` -- each tier's pipeline: its writer lane, its commit rounds
  (the ranks agree version by version) and what it keeps afterwards;
* :mod:`~tiercheck.engine.restore` -- a restore: inventory, agree, fetch (same world,
  resharded, or straight into the caller's tensors), and the first save after it;
* :mod:`~tiercheck.engine.close` -- closing, and the flush on SIGTERM.

At the root, the few objects the phases share: :mod:`.engine` (the parts put together),
:mod:`.core` and :mod:`.steps` (what both public faces drive), :mod:`.options`,
:mod:`.results`, :mod:`.collectives` (the one way ranks talk), :mod:`.jobs` (a save in
flight), :mod:`.stateful` (the state the caller hands in), :mod:`.stored`, :mod:`.journal`
(the node's manifest), :mod:`.health` and :mod:`.part` (what the parts working on the
tiers share).

Private: the public names are re-exported by :mod:`tiercheck.checkpointer` and :mod:`tiercheck`.
"""

"""The checkpointer's engine: everything behind :class:`~tiercheck.Checkpointer`.

Private: the public names are re-exported by :mod:`tiercheck.checkpointer` and :mod:`tiercheck`.
"""

"""Closing, and the flush on SIGTERM.

:mod:`.shutdown` ends a checkpointer in one of three ways, none of which raises for a peer or a
store that is gone (collectives ``close-saved``, ``close-stopped``). :mod:`.sigterm` hooks
SIGTERM: it lets :mod:`.preempt` flush the newest version committed in memory to durable
storage within the grace period (``preempt-begin``, ``-offer``, ``-vote``, ``-ack``; the pure
rules of that flush are :mod:`tiercheck.consistency.preempt`), then lets the process end as it
would have.
"""

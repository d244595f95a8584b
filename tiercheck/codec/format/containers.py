"""What counts as a container in a state: the one place that decides it.

Exactly four types, matched by ``type(obj)``, never ``isinstance``: ``dict`` and
``collections.OrderedDict`` (mappings; ``Module.state_dict()`` returns the latter, with its
``_metadata``), ``list`` and ``tuple`` (sequences). A subclass -- a ``defaultdict``, a
``namedtuple``, an ``IntEnum``'s container -- is not one: the skeleton could not give it back as
its own type, so it is refused (or pickled where allowed) instead of silently becoming its base.
Every walk over a state asks here: flattening (:mod:`~tiercheck.codec.encode.flatten`), the
cached plan (:mod:`~tiercheck.codec.encode.plan`), loading into live objects
(:mod:`~tiercheck.codec.decode.statetree`), DTensor records made live again
(:mod:`~tiercheck.codec.format.dtensor`) and the walks over Stateful objects
(:mod:`tiercheck.engine.stateful`).
"""

from __future__ import annotations

import collections

__all__ = ["CONTAINERS", "MAPPINGS", "SEQUENCES"]

#: The mapping types, by exact type.
MAPPINGS: frozenset[type] = frozenset({dict, collections.OrderedDict})
#: The sequence types, by exact type.
SEQUENCES: frozenset[type] = frozenset({list, tuple})
#: Every container type, by exact type: ``type(obj) in CONTAINERS``.
CONTAINERS: frozenset[type] = MAPPINGS | SEQUENCES

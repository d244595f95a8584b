"""Trainer integrations: checkpoints of a training framework saved and resumed through tiercheck.

* :mod:`tiercheck.integrations.lightning` -- ``TiercheckCheckpointIO`` (a Lightning
  ``CheckpointIO`` plugin) and ``TiercheckCallback``; ``pip install 'tiercheck[lightning]'``.
* :mod:`tiercheck.integrations.hf` -- ``TiercheckTrainer`` / ``TiercheckTrainerMixin`` for the
  Hugging Face ``Trainer``; ``pip install 'tiercheck[hf]'``.
* :mod:`tiercheck.integrations.torchtitan` -- ``TiercheckCheckpointManager``, a torchtitan
  checkpoint manager selected from a config function (torchtitan 0.3.0).

Each submodule imports its framework; neither ``import tiercheck`` nor importing this package
does. In the first two, a version is the trainer's global step, and two checkpoint names
address versions directly: :data:`LATEST` (``"tiercheck:latest"``, the newest version every
rank can rebuild) and ``"tiercheck:<step>"`` (:func:`version_name`); torchtitan's manager
numbers versions by step too.
"""

from __future__ import annotations

from tiercheck.integrations._common import LATEST, RESUME, parse_name, version_name

__all__ = ["LATEST", "RESUME", "parse_name", "version_name"]

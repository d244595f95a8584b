"""Suite-wide test settings: Hypothesis profiles chosen by ``TIERCHECK_HYPOTHESIS_PROFILE``.

* ``default`` -- quick local runs.
* ``ci`` -- derandomized (the same examples on every run), what ``.ci/run`` uses.
* ``nightly`` -- many more examples, for a long soak.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("TIERCHECK_HYPOTHESIS_PROFILE", "default"))

"""Hypothesis profiles for the property tests.

``default``: what CI runs, about a minute of property tests on 2 cores.
``large``: 20 times the examples, to run by hand::

    HYPOTHESIS_PROFILE=large python -m pytest -q tests/test_properties.py tests/test_layout.py

``mutation``: a tenth of the default examples, derandomized, for mutation runs.

No profile has a deadline or the too-slow health check: no test depends on how fast
the machine is. Property tests size their runs with ``helpers.examples``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("large", settings.get_profile("default"), max_examples=2000)
# ``mutation``: scripts/mutation.sh (docs/mutation.md) runs the covering tests once per mutant;
# a few fixed examples keep that affordable and make every run draw the same ones.
settings.register_profile(
    "mutation", settings.get_profile("default"), max_examples=10, derandomize=True, database=None
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

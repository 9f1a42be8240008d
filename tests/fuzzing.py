"""Hypothesis settings the fuzz tests share.

CI runs the same examples every time (``derandomize``): a fuzz test that drew new inputs on
each run would fail some runs and not others. To look for new failures, explore with fresh
random inputs and more of them::

    AUTOPAR_FUZZ_RANDOM=1 AUTOPAR_FUZZ_EXAMPLES=100000 pytest tests/test_fuzz_*.py

and add what it finds to the bad-input tables (tests/test_bad_inputs.py, test_bad_plans.py).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# 4,000 fixed examples a test keep the nine fuzz tests near 100 s of the CI budget (10,000
# took ~265 s on the 2-core VM); the environment variable above runs more.
EXAMPLES = int(os.environ.get("AUTOPAR_FUZZ_EXAMPLES", 4_000))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize=not os.environ.get("AUTOPAR_FUZZ_RANDOM"),
                suppress_health_check=list(HealthCheck))

"""Put on PYTHONPATH of a test's subprocess (and MPI ranks) to make the packages named in ``MILEHPC_TEST_HIDE``
(comma-separated) look absent: ``importlib.util.find_spec`` answers None and ``import`` raises ModuleNotFoundError
for a name whose ``sys.modules`` entry is None. CI installs the real sglang for its contract tests; the tests of
what a user without it sees hide it this way."""

import os
import sys

for _name in filter(None, os.environ.get("MILEHPC_TEST_HIDE", "").split(",")):
    sys.modules[_name] = None  # type: ignore[assignment]

"""Shared test setup. Helpers of each area keep their fixtures in their own test files."""

from __future__ import annotations

import os

# Tests share 2 cores with MPI ranks: one intra-op thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser):
    parser.addoption("--rebaseline", action="store_true", default=False,
                     help="rewrite the golden job scripts in tests/golden/ from the current renderer")

"""Shared test setup: thread count, the --rebaseline option, and the fixtures of the test Slurm cluster."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest

# Tests share 2 cores with MPI ranks: one intra-op thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# What the local site sets for its ranks (site-configs/local.toml), for the tests' own mpirun/srun launches too: Open
# MPI's libfabric transport costs ~1 s of every rank's MPI_Init on one host and carries nothing here.
os.environ.setdefault("OMPI_MCA_btl", "^ofi")

# The user's job record and caches stay untouched: milehpc's per-user paths point into a session temp dir
# (tests/no_trace.py; the session fails if the user's own ones changed).
import no_trace  # noqa: E402  (tests/ is on sys.path, as for every conftest)

no_trace.isolate()


def pytest_sessionfinish(session, exitstatus):
    no_trace.finish(session)


# The quick tier (`bash scripts/test.sh --quick`, under 5 minutes on 2 cores): every test that launches no MPI job,
# uses no Slurm cluster and is not slow (unit, config, render and the real-package contract tests), plus the tests
# marked `smoke` (the RL loop under mpirun, a job through the test Slurm cluster). CI runs everything.
NOT_QUICK = ("slow", "mpi", "slurm")


def mark_quick(items) -> None:
    for item in items:
        if item.get_closest_marker("smoke") or not any(item.get_closest_marker(m) for m in NOT_QUICK):
            item.add_marker(pytest.mark.quick)


def pytest_collection_modifyitems(config, items):
    """The longest files run first (each file's own order kept): a slow test counts half a minute unless its marker
    says more (``pytest.mark.slow(minutes=5)``). Under pytest-xdist (scripts/test.sh: ``--dist loadfile
    --no-loadscope-reorder``) a long file then starts early instead of leaving one worker busy at the end while the
    other idles."""
    def file_of(item) -> str:
        return item.nodeid.split("::")[0]

    minutes: Counter[str] = Counter()
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark is not None:
            minutes[file_of(item)] += mark.kwargs.get("minutes", 0.5)
    first_seen = {f: i for i, f in enumerate(dict.fromkeys(map(file_of, items)))}
    items.sort(key=lambda item: (-minutes[file_of(item)], first_seen[file_of(item)]))
    mark_quick(items)


def pytest_addoption(parser):
    parser.addoption("--rebaseline", action="store_true", default=False,
                     help="rewrite the golden job scripts in tests/golden/ from the current renderer")


def _harness():
    sys.path.insert(0, str(Path(__file__).parent / "cluster"))
    import harness

    return harness


@pytest.fixture(scope="session")
def slurm() -> str:
    """The single-host test cluster (tests/cluster/slurm.sh), started if it is not running; skips with its reason
    only if it cannot start."""
    return _harness().ensure_cluster()


@pytest.fixture
def cli(tmp_path: Path, slurm: str):
    """A milehpc CLI client against the test cluster, with its own state dir; cancels what it submitted."""
    client = _harness().Cli(tmp_path)
    yield client
    client.cleanup()


@pytest.fixture
def ckpt_reference(tmp_path_factory: pytest.TempPathFactory):
    """``ckpt_reference(case)``: the session's shared uninterrupted run of a checkpoint-test case
    (tests/ckpt_reference.py); a run left going by a failed test is stopped and its case unlocked."""
    from ckpt_reference import Reference

    made: list[Reference] = []

    def make(case: str) -> Reference:
        made.append(Reference(tmp_path_factory, case))
        return made[-1]

    yield make
    for ref in made:
        ref.close()

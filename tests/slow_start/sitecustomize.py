"""Put on the ranks' PYTHONPATH by tests/test_loop_mpi.py: ``MILEHPC_TEST_SLOW_ENGINE="RANK:SECONDS"`` makes MPI
rank RANK take SECONDS longer to build its reference engine, as loading a large model or starting a big engine does
on a real cluster (a tiny test model loads in a blink). The engine itself is the real one."""

from __future__ import annotations

import os
import time

_spec = os.environ.get("MILEHPC_TEST_SLOW_ENGINE", "")
_rank, _, _seconds = _spec.partition(":")
if _spec and os.environ.get("OMPI_COMM_WORLD_RANK") == _rank:
    import milehpc.rollout.reference as _reference

    _build = _reference.from_context

    def _slow_build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - same signature as the wrapped factory
        time.sleep(float(_seconds))
        return _build(*args, **kwargs)

    _reference.from_context = _slow_build

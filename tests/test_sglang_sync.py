"""The trainer side of SGLang's weight-update groups under mpirun, against SGLang's own receiving code.

The receivers are what each SGLang TP scheduler runs (sglang's ``init_custom_process_group`` and
``WeightUpdater.receive_weights_from_distributed`` with ``load_format="flattened_bucket"``, through
tests/sglang_standin_scheduler.py; only the engine around them is a stand-in, so two fit in MPI ranks beside a PP=2
trainer). The senders are milehpc's real code (:mod:`milehpc.weights.sglang`): each bucket flattened to one uint8
tensor by :func:`sglang_mapping.flatten_bucket`. The flat layout itself (mixed dtypes, alignment) is checked against
sglang's ``FlattenedTensorBucket`` and the real engine takes it over gloo in tests/test_sglang_contract.py.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from sglang_real import require_real_sglang


@pytest.mark.mpi
@pytest.mark.slow
def test_sync_into_sglang_engines_under_mpirun_pp2_with_restart(tmp_path):
    """mpirun -np 4: PP=2 trainer (ranks 0-1), 2 engines (ranks 2-3). Metadata over MPI, one flat bucket per
    broadcast over each stage's update group (SGLang's own group and receiver code), bit-exact in both engines; a
    restarted engine makes every stage rebuild its group."""
    require_real_sglang()
    from test_runtime_mpi import MPIRUN, VENV_BIN, ok, outputs, write_run_dir

    run = write_run_dir(tmp_path / "run", {"trainer": {"pp": 2}, "rollout": {"engines": 2},
                                           "resources": {"collective_timeout_s": 60}})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(__file__),
           "MILEHPC_HEARTBEAT_TIMEOUT": "60"}
    cmd = [str(MPIRUN), "--allow-run-as-root", "--oversubscribe", "-np", "4", "-x", "OMP_NUM_THREADS",
           "-x", "PYTHONPATH", "-x", "MILEHPC_HEARTBEAT_TIMEOUT", str(VENV_BIN / "milehpc"), "launch", str(run),
           "--entry", "sglang_mpi_entries:sglang_sync"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    ok(proc)
    out = outputs(run)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    for leader in out[2:]:
        assert leader["v1"]["exact"] and leader["v2"]["exact"], leader
        assert leader["v1"]["version"] == 1 and leader["v2"]["version"] == 2
        assert leader["v2"]["flushes"] >= 1 and leader["v2"]["groups"] == [sm_group(0), sm_group(1)]
    assert out[2]["v2"]["restarts"] == 0 and out[3]["v2"]["restarts"] == 1
    assert out[0]["v1"]["bytes"] > 0 and out[1]["v1"]["bytes"] > 0


def sm_group(stage: int) -> str:
    from milehpc.rollout.sglang_mapping import group_name

    return group_name(stage)

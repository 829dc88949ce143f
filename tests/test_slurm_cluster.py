"""tests/cluster/slurm.sh itself, on a private cluster (own directory and ports, beside the shared one): idempotent
start, status, a second slurmd on request running a heterogeneous job across both nodes, and a stop that ends
exactly the daemons it started."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
import harness  # noqa: E402

pytestmark = pytest.mark.slurm

DIR = "/tmp/milehpc-selftest"


def _sh(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(harness.SLURM_SH), *args], capture_output=True, text=True, env=env,
                          timeout=300)


def _pids() -> dict[str, int]:
    run = Path(DIR) / "run"
    return {p.stem: int(p.read_text()) for p in run.glob("*.pid")} if run.is_dir() else {}


@pytest.fixture
def private_env():
    harness.ensure_cluster()  # skips with the reason when this machine cannot run Slurm at all
    env = {**os.environ, "MILEHPC_CLUSTER_DIR": DIR, "MILEHPC_CLUSTER_NAME": "selftest",
           "MILEHPC_CLUSTER_PORT": "7500", "MILEHPC_CLUSTER_ETC_LINK": "0"}
    yield env
    _sh("stop", env=env)


def test_start_is_idempotent_second_node_runs_a_hetjob_and_stop_ends_exactly_its_daemons(private_env, tmp_path):
    env = private_env
    first = _sh("start", "--second-node", env=env)
    assert first.returncode == 0, first.stderr
    assert "vm" in first.stderr and "idle" in first.stderr
    pids = _pids()
    assert set(pids) == {"munged", "slurmctld", f"slurmd-{os.uname().nodename.split('.')[0]}",
                         f"slurmd-{os.uname().nodename.split('.')[0]}-2"}, pids

    again = _sh("start", "--second-node", env=env)
    assert again.returncode == 0 and again.stderr.count("already running") == 4, again.stderr
    assert _pids() == pids  # nothing restarted
    status = _sh("status", env=env)
    assert status.returncode == 0 and f"export SLURM_CONF={DIR}/etc/slurm.conf" in status.stdout

    conf = {**env, "SLURM_CONF": f"{DIR}/etc/slurm.conf"}
    script = tmp_path / "het.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH -n 1 -o {tmp_path}/het.out
#SBATCH hetjob
#SBATCH -n 2
srun --het-group=0 bash -c 'echo "group 0 on $SLURMD_NODENAME"' &
srun --het-group=1 bash -c 'echo "group 1 on $SLURMD_NODENAME"' &
wait
""")
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=conf)
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip()
    deadline = time.monotonic() + 90
    while True:
        states = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True,
                                text=True, env=conf).stdout.split()
        if states and all(s in ("COMPLETED", "FAILED", "CANCELLED") for s in states):
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.3)
    assert states == ["COMPLETED", "COMPLETED"]
    lines = sorted((tmp_path / "het.out").read_text().split("\n"))
    node = os.uname().nodename.split(".")[0]
    assert f"group 0 on {node}" in lines and f"group 1 on {node}-2" in lines

    stop = _sh("stop", env=env)
    assert stop.returncode == 0
    for name, pid in pids.items():
        assert f"(pid {pid})" in stop.stderr, (name, stop.stderr)
        assert not Path(f"/proc/{pid}").exists(), f"{name} (pid {pid}) still running"
    assert _sh("status", env=env).returncode == 1
    # The shared cluster was not touched.
    assert subprocess.run(["bash", str(harness.SLURM_SH), "status"], capture_output=True).returncode == 0

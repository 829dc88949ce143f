"""The job runtime under ``srun --mpi=pmix`` on the test Slurm cluster (tests/cluster/slurm.sh): 4 mpi4py ranks in
one world through milehpc's own launch line (the rendered local-slurm script: srun --mpi=pmix ... milehpc launch
RUN_DIR) with the same split, groups and bit-exact weight sync as under mpirun, and a killed rank named by the
survivors — under srun nothing else ends them (Slurm keeps the other tasks running), so this is milehpc's watchdog at
work."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
from harness import ensure_cluster, wait_for  # noqa: E402
from required import unavailable  # noqa: E402
from test_runtime_mpi import TESTS, VENV_BIN, outputs, write_run_dir  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]


def srun(run_dir: Path, entry: str, *, n: int = 4, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    conf = ensure_cluster()  # skips, with the reason, when the cluster cannot be reached or started
    if shutil.which("srun") is None:
        unavailable("srun is not installed")
    probe = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30,
                           env={**os.environ, "SLURM_CONF": conf})
    if probe.returncode != 0:
        unavailable(f"sinfo cannot reach the test cluster: {probe.stderr.strip()[:200]}")
    cmd = ["srun", "-n", str(n), "--mpi=pmix", "-t", "5", "-J", "milehpc-runtime-test",
           str(VENV_BIN / "python"), "-m", "milehpc", "launch", str(run_dir), "--entry", f"runtime_mpi_entries:{entry}"]
    env = {**os.environ, "SLURM_CONF": conf, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS)}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow  # 4 ranks each import torch for milehpc's launch
def test_srun_pmix_split_groups_and_sync(cli, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(f'''name = "pmix4"
[trainer]
pp = 2
[rollout]
engines = 2
[resources]
collective_timeout_s = 60
time = "00:05:00"
[env]
MILEHPC_TEST_ENTRY = "runtime_mpi_entries:groups_and_sync"
PYTHONPATH = "{TESTS}"
''')
    run = tmp_path / "run"
    script = cli("render", str(job), "--site", "local-slurm", "--run-dir", str(run)).stdout
    assert "srun --mpi=pmix --nodes=1 --ntasks=4" in script and "-m milehpc launch" in script
    job_id = cli.submit(job, run)["job_id"]
    [st] = wait_for(job_id, timeout=240)
    assert st.state == "COMPLETED", (run / "logs" / f"slurm-{job_id}.out").read_text()[-4000:]
    out = outputs(run)
    assert [o["size"] for o in out] == [4, 4, 4, 4]  # one world, not 4 worlds of 1
    assert [o["world_sum"] for o in out] == [0 + 1 + 2 + 3] * 4
    assert sorted(o["procid"] for o in out) == [0, 1, 2, 3] and all(o["library"].startswith("Open MPI") for o in out)
    assert [o["role"] for o in out] == ["trainer", "trainer", "rollout", "rollout"]
    assert [o.get("dist_world") for o in out] == [2, 2, None, None]
    assert all(o["bit_exact"] and o["version"] == 2 for o in out[2:])
    assert out[2]["checks"]["corrupted/0"]["worst"][:2] == ["layers.7.mlp.fc1.weight", 3]


@pytest.mark.slow
def test_srun_killed_rank_is_named_by_the_survivors(tmp_path: Path) -> None:
    timeout = 20
    run = write_run_dir(tmp_path / "run", {"trainer": {"pp": 2}, "rollout": {"engines": 2},
                                           "resources": {"collective_timeout_s": timeout}})
    proc = srun(run, "die")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("milehpc: error:")]
    assert any("rank 2" in line and "gone" in line for line in lines), proc.stderr[-3000:]
    killed_at = json.loads((run / "out" / "rank-2.json").read_text())["started"] + 0.5
    assert time.time() - killed_at < timeout + 10

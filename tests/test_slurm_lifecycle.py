"""The job lifecycle against the real test Slurm cluster (tests/cluster/slurm.sh): submit -> COMPLETED with the
expected output, status/logs/cancel on a real job, a sweep as a job array behind a real dependency. (4 mpi4py ranks
in one world through milehpc's own launch line: tests/test_runtime_slurm.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
import harness  # noqa: E402

pytestmark = pytest.mark.slurm


@pytest.mark.smoke  # the quick tier's job through the test Slurm cluster (scripts/test.sh --quick)
def test_submit_runs_to_completion_with_expected_output(cli, tmp_path):
    job = harness.write_job(tmp_path / "job.toml", "hello")
    run_dir = tmp_path / "run"
    res = cli.submit(job, run_dir)
    job_id = res["job_id"]
    assert job_id.isdigit() and res["run_dir"] == str(run_dir)
    sts = harness.wait_for(job_id, timeout=120)
    assert [s.state for s in sts] == ["COMPLETED"], sts
    out = json.loads((run_dir / "out" / "hello-0.json").read_text())
    assert out == {"rank": 0, "size": 1, "job_id": job_id, "array_task": None, "env": None, "lr": 1e-4}

    [st] = cli.status(job_id)
    assert st["state"] == "COMPLETED" and st["exit_code"] == "0:0" and st["terminal"]
    assert st["extra"]["run_dir"] == str(run_dir)
    log = cli("logs", job_id).stdout
    assert f"milehpc: job {job_id} restart 0" in log
    assert "payload hello from rank 0 of 1 (restart 0)" in log
    assert cli("logs", job_id, "--path").stdout.strip() == str(run_dir / "logs" / f"slurm-{job_id}.out")
    # No rank file written by this payload: --rank N filters the batch log to that rank's lines.
    assert cli("logs", job_id, "--rank", "0").stdout.strip() == "payload hello from rank 0 of 1 (restart 0)"
    assert cli("logs", job_id, "--rank", "3").stdout.strip() == ""
    (run_dir / "logs" / "rank-0.log").write_text("own rank log\n")
    assert cli("logs", job_id, "--rank", "0").stdout == "own rank log\n"

    jobs = json.loads(cli("jobs", "--json").stdout)
    assert [(j["job_id"], j["state"], j["run_dir"], j["site"]) for j in jobs] == \
        [(job_id, "COMPLETED", str(run_dir), "local-slurm")]
    assert job_id in cli("jobs").stdout and str(run_dir) in cli("jobs").stdout
    plain = cli("status", job_id).stdout
    assert plain.split()[:2] == [job_id, "COMPLETED"]


def test_status_logs_follow_and_cancel_a_running_job(cli, tmp_path):
    job = harness.write_job(tmp_path / "job.toml", "sleep", name="sleeper")
    run_dir = tmp_path / "run"
    job_id = cli.submit(job, run_dir)["job_id"]
    harness.wait_for(job_id, until_running=True, timeout=60)
    [st] = cli.status(job_id)
    assert st["state"] == "RUNNING" and not st["terminal"] and st["name"] == "sleeper"

    follower = subprocess.Popen([sys.executable, "-m", "milehpc", "logs", job_id, "-f"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=cli.env)
    deadline = time.monotonic() + 60
    while "payload sleeping 3" not in cli("logs", job_id).stdout:
        assert time.monotonic() < deadline, cli("logs", job_id).stdout
        time.sleep(0.3)
    assert follower.poll() is None  # still following a running job

    out = cli("cancel", job_id)
    assert f"cancelled job {job_id}" in out.stdout
    sts = harness.wait_for(job_id, timeout=60)
    assert sts[0].state == "CANCELLED"
    followed, err = follower.communicate(timeout=60)  # -f ends by itself once the job has ended
    assert follower.returncode == 0, err
    assert "payload sleeping 0" in followed and "payload sleeping 3" in followed
    assert cli.status(job_id)[0]["state"] == "CANCELLED"

    again = cli("cancel", job_id, check=False)
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert f"job {job_id} already ended (CANCELLED)" in again.stderr


def test_unknown_job_ids_give_one_line(cli):
    for args in (["status", "987654"], ["logs", "987654"], ["cancel", "987654"], ["status", "12x"]):
        proc = cli(*args, check=False)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("milehpc: error: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert "987654" in proc.stderr or "12x" in proc.stderr


def test_sweep_is_a_job_array_held_by_a_dependency(cli, tmp_path):
    first = cli.submit(harness.write_job(tmp_path / "a.toml", "sleep", name="first"), tmp_path / "a")["job_id"]
    harness.wait_for(first, until_running=True, timeout=60)
    job = harness.write_job(tmp_path / "b.toml", "hello", name="sweep")
    base = tmp_path / "sweep"
    res = cli.submit(job, base, "--sweep", "trainer.lr=1e-5,3e-5,1e-4", "--after", first)
    array = res["job_id"]
    assert res["sweep"]["run_dirs"] == [str(base / f"sweep-{i}") for i in range(3)]
    script = (base / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-2" in script and "--dependency" not in script

    # Held by the dependency while the first job runs.
    time.sleep(2)
    sts = cli.status(array)
    assert sts and all(s["state"] == "PENDING" and s["reason"] == "Dependency" for s in sts), sts
    assert harness.scontrol_show(array).get("Dependency", "").startswith(f"afterany:{first}")

    cli("cancel", first)
    sts = harness.wait_for(array, timeout=180)
    assert [s.job_id for s in sts] == [f"{array}_{i}" for i in range(3)]
    assert all(s.state == "COMPLETED" for s in sts), sts
    first_end = harness.scontrol_show(first)["EndTime"]
    for i, lr in enumerate([1e-5, 3e-5, 1e-4]):
        rdir = base / f"sweep-{i}"
        out = json.loads((rdir / "out" / "hello-0.json").read_text())
        assert out["array_task"] == str(i) and out["lr"] == lr
        assert json.loads((rdir / "job.json").read_text())["trainer"]["lr"] == lr
        log = cli("logs", f"{array}_{i}").stdout
        assert "payload hello from rank 0 of 1" in log
        assert cli("logs", f"{array}_{i}", "--path").stdout.strip() == str(rdir / "logs" / f"slurm-{array}_{i}.out")
        # afterany: no element started before the first job ended.
        assert harness.scontrol_show(f"{out['job_id']}")["StartTime"] >= first_end
    jobs = json.loads(cli("jobs", "--json").stdout)
    assert jobs[-1]["job_id"] == array and jobs[-1]["state"] == "COMPLETED:3" and jobs[-1]["after"] == first


def test_sweep_that_changes_the_request_is_refused(cli, tmp_path):
    job = harness.write_job(tmp_path / "job.toml", "hello")
    proc = cli("submit", str(job), "--site", "local-slurm", "--run-dir", str(tmp_path / "s"),
               "--sweep", "trainer.dp=1,2", "--set", "resources.colocate=false", check=False)
    assert proc.returncode == 2 and "changes the Slurm request" in proc.stderr and "--ntasks" in proc.stderr
    assert not (tmp_path / "s").exists()


def test_status_falls_back_from_squeue_to_sacct_to_scontrol(cli, tmp_path):
    job_id = cli.submit(harness.write_job(tmp_path / "job.toml", "hello"), tmp_path / "run")["job_id"]
    harness.wait_for(job_id, timeout=120)
    assert cli.status(job_id)[0]["source"] == "squeue+scontrol"
    # A machine whose squeue is missing: sacct is asked next and fails (no accounting here, as on some real
    # sites), then scontrol answers.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("sacct", "scontrol", "sbatch"):
        (bindir / tool).symlink_to(shutil.which(tool))
    cli.env["PATH"] = f"{bindir}:{Path(sys.executable).parent}"
    [st] = cli.status(job_id)
    assert st["source"] == "scontrol" and st["state"] == "COMPLETED" and st["exit_code"] == "0:0"
    assert st["stdout"] == str(tmp_path / "run" / "logs" / f"slurm-{job_id}.out")

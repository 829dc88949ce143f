"""``milehpc doctor``: against the real test cluster, on the "login node" and inside a job, and the one-line
answers when Slurm is absent. The checks of other sites run here too: they must name what does not fit
(cray_shasta with Open MPI, a partition this cluster lacks, Slingshot interfaces this machine lacks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
import harness  # noqa: E402

from milehpc.doctor import FAIL, OK, WARN, Doctor, mpi_flavour  # noqa: E402


def _doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "milehpc", "doctor", *args], capture_output=True, text=True,
                          env=env or os.environ.copy(), timeout=180)


def _levels(findings: list[dict[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in findings:
        out.setdefault(f["check"], []).append(f["level"])
    return out


@pytest.mark.slurm
def test_doctor_local_slurm_is_healthy(slurm):
    proc = _doctor("--site", "local-slurm", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(proc.stdout)
    levels = _levels(found)
    assert levels["slurm"] == [OK] and levels["mpi4py"] == [OK] and levels["launcher"] == [OK], found
    text = {f["check"]: f["message"] for f in found}
    assert "partitions: debug" in text["slurm"]
    assert "Open MPI" in text["mpi4py"] and "--mpi=pmix with openmpi" in text["launcher"]
    plain = _doctor("--site", "local-slurm").stdout.splitlines()
    assert plain and all(line.split()[0] in (OK, WARN, FAIL) for line in plain)


@pytest.mark.slurm
def test_doctor_names_what_does_not_fit_frontier_here(slurm):
    proc = _doctor("--site", "frontier-like")
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    fails = [line for line in lines if line.startswith(FAIL)]
    assert any("partition 'batch' is not offered" in line for line in fails), lines
    assert any("srun --mpi=cray_shasta with openmpi" in line for line in fails), lines
    assert any(line.startswith(WARN) and "no amd GPU" in line for line in lines), lines
    assert any(line.startswith(WARN) and "NCCL_SOCKET_IFNAME=hsn0" in line for line in lines), lines


@pytest.mark.slurm
def test_doctor_inside_a_job(slurm, tmp_path):
    out = tmp_path / "doctor.out"
    proc = subprocess.run(["sbatch", "--parsable", "-o", str(out), "-n", "1", "--wrap",
                           f"{sys.executable} -m milehpc doctor --site local-slurm"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    try:
        [st] = harness.wait_for(job_id, timeout=120)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    text = out.read_text()
    assert st.state == "COMPLETED", text
    assert "ok    launcher: srun --mpi=pmix with openmpi" in text and "FAIL" not in text


def test_doctor_without_slurm_says_so_in_one_line(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": str(bindir)}  # no sbatch/srun/squeue on PATH: a machine without Slurm
    proc = _doctor("--site", "local-slurm", env=env)
    assert proc.returncode == 1
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"{FAIL}  slurm")]
    assert "sbatch, srun, squeue, scontrol not found on PATH" in line
    for args in (["status", "12"], ["cancel", "12"], ["logs", "12"]):
        res = subprocess.run([sys.executable, "-m", "milehpc", *args], capture_output=True, text=True, env={
            **env, "MILEHPC_STATE_DIR": str(tmp_path / "state")}, timeout=60)
        assert res.returncode == 2 and res.stderr.count("\n") == 1, (args, res.stderr)
        assert "not found: Slurm is not available" in res.stderr


def test_doctor_flags_bad_network_and_container_settings(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('name = "x"\n[container]\nimage = "/nonexistent/milehpc.sif"\n'
                   '[site.env]\nFI_MR_CACHE_MONITOR = "memhooks"\n')
    env = {"SLURM_JOB_ID": "1", "PATH": os.environ.get("PATH", "")}  # as inside a job on a compute node
    findings = Doctor("frontier-like", str(job), env=env).run()
    assert any(f.check == "network" and f.level == FAIL and "memhooks deadlocks" in f.message for f in findings)
    assert any(f.check == "network" and f.level == FAIL and "NCCL_SOCKET_IFNAME" in f.message for f in findings)
    assert any(f.check == "gpus" and f.level == FAIL and "inside the job" in f.message for f in findings)
    assert any(f.check == "container" and f.level == FAIL and "does not exist" in f.message for f in findings)
    if not (shutil.which("apptainer") or shutil.which("singularity")):
        assert any(f.check == "container" and "neither apptainer nor singularity" in f.message for f in findings)


def test_mpi_flavours_from_library_strings():
    assert mpi_flavour("Open MPI v5.0.11, package: Open MPI user@localhost") == "openmpi"
    assert mpi_flavour("MPICH Version:      4.1.2\nMPICH Release date: ...") == "mpich"
    assert mpi_flavour("MPI VERSION    : CRAY MPICH version 8.1.28.23 (ANL base 3.4a2)") == "cray-mpich"
    assert mpi_flavour("HYDRA build details:") == "mpich"

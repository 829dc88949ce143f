"""Golden job scripts for every shipped site x {plain, Apptainer}.

Re-baseline after an intended change with:  pytest tests/test_render_golden.py --rebaseline
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from milehpc import plugins
from milehpc.render.rundir import prepare

HERE = Path(__file__).parent
GOLDEN = HERE / "golden"
JOB = GOLDEN / "job.toml"
RUN_DIR = "/scratch/milehpc/runs/golden"
# Fixed so the scripts do not depend on where the tests run.
PYTHON, MPIRUN = "/opt/milehpc/venv/bin/python", "/opt/milehpc/venv/bin/mpirun"
IMAGE = "/images/milehpc.sif"

SHIPPED = sorted(p.stem for p in (HERE.parent / "site-configs").glob("*.toml"))
VARIANTS = {"plain": (), "apptainer": (f"container.image={IMAGE!r}".replace("'", '"'),)}


def _render(site: str, variant: str) -> str:
    return prepare(str(JOB), site, VARIANTS[variant], run_dir=RUN_DIR, python=PYTHON, mpirun=MPIRUN).script


def test_every_shipped_site_is_registered():
    assert set(SHIPPED) <= set(plugins.registry("site"))
    assert {"local", "local-slurm", "frontier-like", "perlmutter-like", "dgx-h100-like"} <= set(SHIPPED)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("site", SHIPPED)
def test_golden_script(site: str, variant: str, request: pytest.FixtureRequest) -> None:
    script = _render(site, variant)
    golden = GOLDEN / f"{site}-{variant}.sh"
    if request.config.getoption("--rebaseline"):
        golden.write_text(script)
    assert golden.exists(), f"no golden file {golden.name}; run: pytest {__file__} --rebaseline"
    assert script == golden.read_text(), f"{golden.name} differs; if intended: pytest {__file__} --rebaseline"
    proc = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


def test_frontier_script_is_what_an_olcf_user_expects():
    script = _render("frontier-like", "apptainer")
    assert "#SBATCH --partition=batch" in script
    assert "--gpus-per-task=1" in script and "--gpu-bind=closest" in script
    assert "torchrun" not in script
    assert "NCCL_NET=Socket" in script  # single-node jobs: the net plugin does not initialise
    assert "memhooks" not in script
    assert "apptainer exec --cleanenv --rocm" in script
    assert "HIP_VISIBLE_DEVICES" not in script  # ROCR_VISIBLE_DEVICES is Slurm's to set
    assert "--signal=B:USR1@" in script and "--requeue" in script

"""With sglang / torch_memory_saver / transformer-engine absent, selecting them is one clear line with exit code 2,
never a traceback: through the plugin registry, the job-requirements check, the factories, and the CLI. CI installs
the real sglang (its contract tests run it on the CPU): these tests hide the GPU stack, in this process and in the
subprocesses and MPI ranks they start (tests/hide_gpu_stack/sitecustomize.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from milehpc import plugins
from milehpc.config.load import job_from_dict
from milehpc.config.precision import require_transformer_engine, resolve_precision
from milehpc.config.requirements import check_requirements, requirements
from milehpc.errors import MilehpcError, PluginError

ROOT = Path(__file__).resolve().parents[1]


HIDDEN = ("sglang", "sgl_kernel", "torch_memory_saver", "transformer_engine")
HIDE_ENV = {"MILEHPC_TEST_HIDE": ",".join(HIDDEN),
            "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "hide_gpu_stack"), str(ROOT / "tests")])}


@pytest.fixture(autouse=True)
def _gpu_stack_absent(monkeypatch):
    for mod in HIDDEN:
        monkeypatch.setitem(sys.modules, mod, None)  # find_spec answers None, import raises ModuleNotFoundError
    assert all(importlib.util.find_spec(mod) is None for mod in HIDDEN)


def _one_line(err: MilehpcError, package: str) -> None:
    msg = str(err)
    assert "\n" not in msg and f"'{package}'" in msg and "not installed" in msg
    assert err.exit_code == 2


def test_selecting_the_sglang_engine_through_the_registry_is_one_line():
    plugins.reset_plugin_manager()
    spec = plugins.lookup("engine", "sglang")
    assert spec.requires == ("sglang",) and set(spec.defaults) >= {"speculative", "server_args"}
    with pytest.raises(PluginError) as info:
        plugins.load("engine", "sglang")
    _one_line(info.value, "sglang")
    assert str(info.value).startswith("engine 'sglang' needs the Python package 'sglang'")


@pytest.mark.parametrize(("spec", "package", "setting"), [
    ({"rollout": {"engine": "sglang"}}, "sglang", "rollout.engine = 'sglang'"),
    ({"trainer": {"precision": "fp8"}}, "transformer-engine", "trainer.precision = 'fp8'"),
])
def test_job_requirements_check_is_one_line(spec, package, setting):
    job = job_from_dict({"name": "t", **spec}, file="job.toml")
    with pytest.raises(PluginError) as info:
        check_requirements(job)
    _one_line(info.value, package)
    assert str(info.value).startswith(setting)


def test_colocated_sglang_also_needs_torch_memory_saver():
    job = job_from_dict({"name": "t", "rollout": {"engine": "sglang"}, "resources": {"colocate": True}},
                        file="job.toml")
    assert [m for _, m in requirements(job)] == ["sglang", "torch_memory_saver"]
    cpu = job_from_dict({"name": "t", "trainer": {"precision": "bf16"}}, file="job.toml")
    assert requirements(cpu) == []
    check_requirements(cpu)  # the CPU path needs none of them


def test_memory_saver_and_transformer_engine_entry_points_are_one_line():
    from milehpc.runtime.offload import torch_memory_saver_backend

    with pytest.raises(PluginError) as info:
        torch_memory_saver_backend()
    _one_line(info.value, "torch-memory-saver")
    fp8 = resolve_precision(job_from_dict({"name": "t", "trainer": {"precision": "fp8"}}))
    with pytest.raises(PluginError) as info:
        require_transformer_engine(fp8)
    _one_line(info.value, "transformer-engine")
    require_transformer_engine(resolve_precision(job_from_dict({"name": "t"})))  # fp32: nothing needed


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **HIDE_ENV}
    return subprocess.run([sys.executable, "-m", "milehpc", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(("toml", "package"), [
    ('name = "s"\n[rollout]\nengine = "sglang"\n', "sglang"),
    ('name = "s"\n[rollout]\nengine = "sglang"\n[resources]\ncolocate = true\n', "sglang"),
    # FP8 is the megatron trainer's, with bfloat16 weights (the job rules refuse fp8 with the torch trainer).
    ('name = "s"\n[model]\ndtype = "bfloat16"\n[trainer]\nbackend = "megatron"\nprecision = "fp8"\n',
     "transformer-engine"),
])
def test_cli_run_selecting_the_gpu_stack_is_one_line_exit_2(tmp_path, toml, package):
    section = _cli("--help", cwd=tmp_path).stdout.split("Commands:")[-1]
    if "run" not in [line.split()[0] for line in section.splitlines() if line.startswith("  ") and line.split()]:
        pytest.skip("`milehpc run` does not exist yet")
    (tmp_path / "job.toml").write_text(toml)
    res = _cli("run", "job.toml", "--site", "local", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"'{package}'" in lines[0], res.stderr


def test_colocated_driver_is_only_for_sglang_and_needs_the_memory_saver():
    from milehpc.runtime.offload import for_job

    cpu = job_from_dict({"name": "t", "resources": {"colocate": True}})
    assert for_job(cpu, engine=None) is None  # the reference engine: nothing to offload
    gpu = job_from_dict({"name": "t", "rollout": {"engine": "sglang"}, "resources": {"colocate": True}})
    with pytest.raises(PluginError) as info:
        for_job(gpu, engine=None)
    _one_line(info.value, "torch-memory-saver")


@pytest.mark.mpi
def test_launch_checks_the_gpu_stack_on_every_rank_one_line_from_rank_0(tmp_path):
    """`milehpc launch` (inside the job, where the container provides the packages) checks them before anything
    heavy; `submit` does not (login nodes lack them). Real mpirun, 2 ranks: exit 2, one line, from rank 0 only."""
    from test_runtime_mpi import mpirun, write_run_dir

    run_dir = write_run_dir(tmp_path / "run", {"rollout": {"engine": "sglang"}})
    proc, _ = mpirun(run_dir, None, np=2, timeout=120, env=HIDE_ENV)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("milehpc: error")]
    assert len(lines) == 1 and "rank 0" in lines[0] and "'sglang'" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr

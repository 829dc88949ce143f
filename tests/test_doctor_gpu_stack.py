"""`milehpc doctor`: the GPU stack's installed versions against the tested ones (package metadata, nothing
imported), and the job held against its partition's devices as submit holds it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from milehpc.config import tested_versions as tv

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "sglang", "megatron", "transformer_engine", "torch_memory_saver", "vllm")


def test_doctor_reports_the_installed_gpu_stack_without_importing_it() -> None:
    code = ("import json, sys; from milehpc.doctor import Doctor; d = Doctor('local'); d.check_gpu_stack(); "
            f"print(json.dumps([d.findings[0].line(), [m for m in {HEAVY!r} if m in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    line, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert imported == []
    assert line.startswith("ok    gpu-stack: torch ") and "\n" not in line
    assert f"megatron-core {tv.TESTED_MEGATRON_CORE} (tested)" in line  # the venv has the pinned one
    for dist, have, tested in tv.gpu_stack():
        if have is not None:
            assert f"{dist} {have}" in line
        elif tested is not None:
            assert f"{dist} not installed (tested {tested})" in line
        else:
            assert dist not in line  # a library not installed and not pinned says nothing


def test_doctor_gpu_stack_with_installed_versions_faked_names_each_against_its_test(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from milehpc.doctor import OK, Doctor

    fake = {"torch": "2.9.1", "megatron-core": tv.TESTED_MEGATRON_CORE, "transformer-engine": "2.20.2",
            "vllm": "0.11.0"}
    monkeypatch.setattr(tv, "installed_version", fake.get)
    doctor = Doctor("local")
    doctor.check_gpu_stack()
    assert [(f.check, f.level) for f in doctor.findings] == [("gpu-stack", OK)]
    assert doctor.findings[0].message == (
        f"torch 2.9.1, megatron-core {tv.TESTED_MEGATRON_CORE} (tested), transformer-engine 2.20.2 (tested "
        f"{tv.TESTED_TRANSFORMER_ENGINE}), sglang not installed (tested {tv.TESTED_GPU_PACKAGES['sglang']}), "
        f"torch_memory_saver not installed (tested {tv.TESTED_GPU_PACKAGES['torch_memory_saver']}), vllm 0.11.0 "
        f"(tested {tv.TESTED_VLLM})")


def test_doctor_fails_a_job_its_partition_cannot_run(tmp_path: Path) -> None:
    from milehpc.doctor import FAIL, Doctor

    job = tmp_path / "colocated-on-frontier.toml"
    text = (ROOT / "examples" / "frontier-grpo.toml").read_text()
    # colocated SGLang (which pauses the trainer with torch_memory_saver), in an image of its own that holds it
    job.write_text(text.replace('loop = "one_step_off"', 'loop = "sync"').replace(
        '[resources]\n', '[resources]\ncolocate = true\n').replace('engine = "vllm"', 'engine = "sglang"')
        + '\n[site.containers.apptainer]\nengines = ["sglang"]\n')
    doctor = Doctor("frontier-like", str(job))
    doctor.run()
    fails = [f for f in doctor.findings if f.check == "job-on-site"]
    assert [f.level for f in fails] == [FAIL]
    assert fails[0].message.startswith(f"{job}: resources.colocate: expected false on an AMD partition")

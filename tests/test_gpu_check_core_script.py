"""scripts/gpu-check.sh core on a CPU machine (one line, exit 2), and scripts/gpu_check_core.py's logic on the CPU
(--device cpu: the CUDA-IPC part skipped; the memory saver is the real torch_memory_saver over a faked CUDA binding
whose pause makes the trainer's tensors unusable until resumed, tests/standin_gpu_stack/ on the subprocess's path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tms_real

ROOT = Path(__file__).resolve().parents[1]


def test_core_mode_refuses_a_cpu_machine_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "core"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 2
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert lines == ["gpu-check core: needs a CUDA GPU (torch.cuda.is_available() is False on this machine)"]


def test_an_unknown_mode_is_refused() -> None:
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "everything"], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 2 and "usage" in res.stderr


@pytest.mark.slow
def test_core_check_logic_runs_on_cpu_with_the_pausing_memory_saver(tmp_path: Path) -> None:
    """Also the guard of the check's order: the trainer is read (logprobs, exported weights) only while resident."""
    tms_real.require_real()
    out = tmp_path / "core.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "standin_gpu_stack"), str(ROOT)])}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_core.py"), "--device", "cpu", "--small",
                          "--steps", "2", "--prompts", "4", "--n", "4", "--max-new-tokens", "8", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["ok"] and "error" not in got
    assert set(got["checks"]) >= {"colocated_versions_agree", "colocated_logprobs_agree", "megatron_float16module",
                                  "megatron_packed_matches_padded"}
    assert got["ipc"] == {"skipped": "cpu"}
    assert set(got["figures"]) == {"update_gbps", "ipc_gbps", "freed_train_gb", "gen_tokens_per_s",
                                   "megatron_step_s", "megatron_tokens_per_s"}
    assert json.loads(res.stdout.strip().splitlines()[-1])["ok"]

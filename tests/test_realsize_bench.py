"""bench/realsize.py's smallest configuration (one layer of Qwen2.5-0.5B's shape at a quarter of its width, two GRPO
steps, the reference engine + the torch trainer through ``milehpc run --site local``), so the benchmark cannot rot:
its JSON carries every figure, and the trainer rank's measured peak (above the baseline run's) is the estimate's
within the benchmark's goal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mpi]

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"pair", "layers", "params", "steps", "gen_tokens_per_s", "logprob_tokens_per_s", "train_tokens_per_s",
        "sync_bytes", "sync_s", "export_s", "flat_s", "sync_gbps", "flat_gbps", "sync_vs_flat", "ckpt_bytes",
        "ckpt_write_gbps", "ckpt_read_gbps", "memory"}


def test_the_smallest_realsize_configuration_runs_and_its_estimate_holds() -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "realsize.py"), "--layers", "1", "--width-div", "4", "--steps", "2",
           "--prompts", "1", "--samples", "2", "--max-new-tokens", "4", "--pairs", "reference+torch"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = json.loads(proc.stdout.splitlines()[-1])["results"]
    assert set(result) >= KEYS and result["steps"] == 2
    # One sync of the model without its tied lm_head: the embedding, one layer, the final norm.
    assert result["sync_bytes"] == 4 * result["params"]
    assert all(result[k] > 0 for k in ("gen_tokens_per_s", "logprob_tokens_per_s", "train_tokens_per_s", "sync_s",
                                       "flat_s", "ckpt_write_gbps", "ckpt_read_gbps"))
    trainer = result["memory"]["trainer"]
    # At this tiny size (~230 MB) the measured figure is a difference of two processes' peak RSS, which the
    # allocator's retained memory moves by tens of MB from run to run (145-216 MB measured for the same run, under
    # load and not; the baseline's peak alone 297-331 MB), so the benchmark's goal of 20% (met at the real size:
    # README) cannot be asserted here. What can: the estimate does not under-count (the measured peak at most 20% and
    # one glibc mmap threshold, 32 MiB, above it) and is not a gross over-count (at least half of it measured).
    est = trainer["estimated"]
    assert 0.5 * est <= trainer["measured"] <= 1.2 * est + (32 << 20), trainer

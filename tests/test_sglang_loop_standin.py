"""The real loop under real mpirun with ``rollout.engine = "sglang"``, against the CPU stand-in of ``sglang`` and the
real ``torch_memory_saver`` with its CUDA binding faked (tests/standin_gpu_stack/, on PYTHONPATH of the job only).

Everything else is real: ``milehpc run`` → mpirun → ``milehpc launch`` on every rank, milehpc's SGLang engine
plugin, its update-group sync (trainer stage leader + engine leaders, gloo), the router, the health check (the
stand-in's "scheduler" is a real child process that the test kills) and the colocated step driver. The stand-ins
record every call they get, per rank, so the tests check the order the loop drives them in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tms_real
from tiny_model import TINY_MODEL

pytestmark = [pytest.mark.mpi]

ROOT = Path(__file__).resolve().parents[1]
UPDATE = ["update_weights_from_distributed", "flush_cache"]


def run_standin(tmp_path: Path, body: str, crash: str) -> tuple[list[dict], dict[int, list[dict]]]:
    """Run the job; returns (metrics records, per-rank list of the stand-ins' recorded calls)."""
    job, log, rdir = tmp_path / "job.toml", tmp_path / "calls", tmp_path / "run"
    job.write_text(textwrap.dedent(body) + TINY_MODEL)
    log.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILEHPC_PROGRESS": "plain", "MILEHPC_STANDIN_LOG": str(log),
           "MILEHPC_STANDIN_CRASH": crash,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "standin_gpu_stack"), str(ROOT)])}
    milehpc = Path(sys.executable).with_name("milehpc")
    proc = subprocess.run([str(milehpc), "run", str(job), "--site", "local", "--run-dir", str(rdir)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (rdir / "metrics.jsonl").read_text().splitlines()]
    calls = {int(f.stem[4:]): [json.loads(line) for line in f.read_text().splitlines()] for f in log.iterdir()}
    return records, calls


def names(calls: list[dict]) -> list[str]:
    return [c["call"] for c in calls]


def test_standin_sglang_separate_ranks_sync_restart_and_router(tmp_path) -> None:
    """1 trainer + 2 SGLang engine ranks. Weights go through SGLang's update group before every generation; engine
    1's scheduler dies after its first batch (no sync is due before the next one, update_weights_interval = 2): the
    router gives engine 0 the whole batch 1, engine 1 restarts in place and is re-synced before it generates."""
    records, calls = run_standin(tmp_path, """
        name = "sglang-standin"
        [data]
        source = "task:reverse"
        params = { min_len = 1, max_len = 4 }
        [rollout]
        engine = "sglang"
        engines = 2
        prompts_per_step = 4
        n_samples = 2
        max_new_tokens = 4
        [trainer]
        micro_batch_size = 8
        [run]
        steps = 4
        update_weights_interval = 2
    """, crash="2:generate:1")
    assert records[0]["dist/mpi_world_size"] == 3 and records[0]["dist/trainer_world_size"] == 1
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["rollout/groups"] == 4 and r["rollout/samples"] == 8 for r in records)
    assert all(0.0 <= r["rollout/reward_mean"] <= 1.0 for r in records)
    # Versions: weights of step 2 (interval 2) reach batches 2 and 3; batches 0-1 use the initial ones.
    assert [r["async/staleness_max"] for r in records] == [0.0, 1.0, 0.0, 1.0]
    from milehpc.samples.dumps import read_rollouts

    assert {s.weight_version for s in read_rollouts(tmp_path / "run", 3)[0]} == {2}
    assert sorted(calls) == [1, 2]  # the trainer rank starts no engine

    healthy = names(calls[1])
    group = ["init_weights_update_group", *UPDATE]
    # The first sync comes before the first generation (SGLang started from dummy weights).
    assert healthy[:5] == ["Engine", *group, "generate"]
    # Batch 1: engine 0 alone generates all 4 groups (8 samples); then it joins the rebuilt group for the re-sync.
    assert healthy[5] == "generate" and calls[1][5]["prompts"] == 8
    assert healthy[6:] == ["destroy_weights_update_group", *group, *UPDATE, "generate", "generate"]

    dead = names(calls[2])
    assert dead == ["Engine", *group, "generate",  # batch 0, then the scheduler dies
                    "shutdown", "Engine", *group,  # restart + re-sync of version 0; nothing for batch 1
                    *UPDATE, "generate", "generate"]  # version 2, batches 2 and 3
    assert [c["instance"] for c in calls[2] if c["call"] == "Engine"] == [1, 2]


def test_standin_sglang_colocated_miles_order_per_step(tmp_path) -> None:
    """2 colocated ranks (each trainer + engine). Per step, in Miles' order: generate → release rollout memory →
    train (resumed, in the tagged region) → pause train → resume weights → update from tensors → resume KV cache.
    Rank 1's engine dies after onloading its KV cache at the end of step 0: it is restarted and re-synced from the
    trainer's snapshot before step 1 generates."""
    tms_real.require_real()  # the real torch_memory_saver, its CUDA binding faked (tests/tms_real.py)
    records, calls = run_standin(tmp_path, """
        name = "sglang-colocated-standin"
        [data]
        source = "task:reverse"
        params = { min_len = 1, max_len = 4 }
        [rollout]
        engine = "sglang"
        engines = 2
        prompts_per_step = 4
        n_samples = 2
        max_new_tokens = 4
        [trainer]
        dp = 2
        micro_batch_size = 8
        [resources]
        colocate = true
        [run]
        steps = 3
    """, crash="1:resume_memory_occupation:2")
    assert records[0]["dist/mpi_world_size"] == 2 and records[0]["dist/trainer_world_size"] == 2
    assert [r["rollout/samples"] for r in records] == [8.0, 8.0, 8.0]
    assert all(r["colocate/update_gb"] > 0 and r["time/colocate_update_weights"] > 0 for r in records)
    from milehpc.samples.dumps import read_rollouts

    assert [{s.weight_version for s in read_rollouts(tmp_path / "run", k)[0]} for k in range(3)] == [{0}, {1}, {2}]

    def tagged(c: dict) -> str:
        tags = c.get("tags") or c.get("tag")
        return f"{c['call']}:{','.join(tags) if isinstance(tags, list) else tags}" if tags else c["call"]

    start = ["region:train",  # the trainer is built in the pausable region
             "region:train", "pause:train",  # the first update (no SFT here: the region is the empty warm-up)
             "update_weights_from_tensor", "flush_cache"]
    step = ["generate", "release_memory_occupation:cuda_graph,kv_cache,weights",
            "resume:train", "region:train", "pause:train",
            "resume_memory_occupation:weights", "update_weights_from_tensor", "flush_cache",
            "resume_memory_occupation:kv_cache,cuda_graph"]
    seq0 = [tagged(c) for c in calls[0]]
    assert seq0 == ["Engine", *start, *step * 3]
    seq1 = [tagged(c) for c in calls[1]]
    restart = ["shutdown", "Engine", "update_weights_from_tensor", "flush_cache"]
    assert seq1 == ["Engine", *start, *step, *restart, *step * 2]

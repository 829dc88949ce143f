"""The colocated loop under real mpirun with ``rollout.engine = "sglang"``, against the CPU stand-in of ``sglang`` and
the real ``torch_memory_saver`` with its CUDA binding faked (tests/standin_gpu_stack/, on PYTHONPATH of the job only).

Colocated SGLang needs torch_memory_saver's CUDA allocator for the trainer, which no CPU has; this is the one place
the sglang stand-in remains. Separate SGLang rollout ranks run against the real engine (tests/test_sglang_loop_real.py),
and the release/resume ordering against the real engine's calls (tests/test_sglang_contract.py). Everything else here
is real: ``milehpc run`` → mpirun → ``milehpc launch`` on every rank, the colocated step driver and the memory saver's
Python layer. The stand-ins record every call they get, per rank, so the tests check the order the loop drives them in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tms_real
from local_job import run_local_job

pytestmark = [pytest.mark.mpi]

ROOT = Path(__file__).resolve().parents[1]


def run_standin(tmp_path: Path, body: str, crash: str) -> tuple[list[dict], dict[int, list[dict]]]:
    """Run the job; returns (metrics records, per-rank list of the stand-ins' recorded calls)."""
    log = tmp_path / "calls"
    log.mkdir()
    records, _ = run_local_job(tmp_path, body, {
        "MILEHPC_STANDIN_LOG": str(log), "MILEHPC_STANDIN_CRASH": crash,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "standin_gpu_stack"), str(ROOT)])})
    calls = {int(f.stem[4:]): [json.loads(line) for line in f.read_text().splitlines()] for f in log.iterdir()}
    return records, calls


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

    # Every update is one weight-update session, as SGLang requires (fault 2 of issue 12).
    update = ["begin_weight_update", "update_weights_from_tensor", "end_weight_update", "flush_cache"]
    start = ["region:train",  # the trainer is built in the pausable region
             "region:train", "pause:train",  # the first update (no SFT here: the region is the empty warm-up)
             *update]
    step = ["generate", "release_memory_occupation:cuda_graph,kv_cache,weights",
            "resume:train", "region:train", "pause:train",
            "resume_memory_occupation:weights", *update,
            "resume_memory_occupation:kv_cache,cuda_graph"]
    seq0 = [tagged(c) for c in calls[0]]
    assert seq0 == ["Engine", *start, *step * 3]
    seq1 = [tagged(c) for c in calls[1]]
    restart = ["shutdown", "Engine", *update]
    assert seq1 == ["Engine", *start, *step, *restart, *step * 2]

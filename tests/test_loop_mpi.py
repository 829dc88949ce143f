"""The RL loop under real mpirun, through `milehpc run --site local` (the README path): GRPO learning with
1 rollout + 2 trainer ranks, fp32 train–inference agreement right after each sync, the one-step-off and
async weight schedules, and the colocated layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
from test_eval import write_val

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


def run_job(tmp_path: Path, body: str, *, hidden: int = 32, timeout: int = 400,
            env: dict[str, str] | None = None) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    job = tmp_path / "job.toml"
    job.write_text(textwrap.dedent(body) + MODEL.format(hidden=hidden, inter=2 * hidden))
    return run_cli(tmp_path, job, timeout=timeout, env=env)


def run_cli(tmp_path: Path, job: Path, *, timeout: int, env: dict[str, str] | None = None,
            args: Sequence[str] = ()) -> list[dict]:
    """The metrics of `milehpc run JOB --site local ARGS` (e.g. ``--set`` overrides) in ``tmp_path/run``."""
    rdir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILEHPC_PROGRESS": "plain", **(env or {})}
    milehpc = Path(sys.executable).with_name("milehpc")
    proc = subprocess.run([str(milehpc), "run", str(job), "--site", "local", "--run-dir", str(rdir), *args],
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


@pytest.mark.smoke  # the quick tier's end-to-end launch of the RL loop (scripts/test.sh --quick)
def test_sync_loop_logprobs_agree_right_after_each_sync(tmp_path) -> None:
    """Also: the rollout rank takes 8 s longer to build its engine (as a large model loads) than the 5-s collective
    timeout, and the job still starts: the ranks wait for each other's start-up under resources.startup_timeout_s.
    (Measured: with startup_timeout_s = 6.5 this start-up times out, so the 8 s are not hidden by the trainer's build.)"""
    slow = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent / "slow_start"),
                                                        os.environ.get("PYTHONPATH")])),
            "MILEHPC_TEST_SLOW_ENGINE": "1:8",
            "MILEHPC_HEARTBEAT_TIMEOUT": "60"}  # not min(5 s, 60 s): a loaded CI machine can delay a heartbeat
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
        [resources]
        collective_timeout_s = 5
    """, env=slow)
    assert records[0]["dist/mpi_world_size"] == 2
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records:
        assert r["async/staleness_max"] == 0.0
        assert r["train/logprob_diff_max"] <= 1e-5, r["train/logprob_diff_max"]
    assert records[-1]["train/lr"] == 1e-3
    # The per-phase profile of each step (bench/async_loop.py --profile): the trainer's compute split into its
    # parts, the export inside the sync, and the rollout rank's wait for and loading of the weights of each batch
    # after the first (the sync loop: it waits while the trainer trains).
    for r in records:
        parts = r["time/train_prepare"] + r["time/train_fwd_bwd"] + r["time/train_optim"]
        assert min(r["time/train_prepare"], r["time/train_fwd_bwd"], r["time/train_optim"]) > 0, r
        assert parts <= r["time/train_compute"] <= r["time/train"], r
    assert [r["step"] for r in records if "time/sync_export" in r] == [0, 1, 2]
    assert all(0 < r["time/sync_export"] <= r["time/sync"] for r in records[:3])
    assert [r["step"] for r in records if "time/wait_weights" in r] == [1, 2, 3]
    assert all(r["time/wait_weights"] > 0 and r["time/load_weights"] > 0 for r in records[1:])


def test_one_step_off_and_async_weight_schedules(tmp_path) -> None:
    """Also the evaluation on held-out prompts (run.eval_every) on separate ranks, and `milehpc eval` of the run's
    last checkpoint giving the loop's numbers of that step (tests/test_eval.py has the rest)."""
    val = write_val(tmp_path / "val.jsonl")
    body = """
        name = "{name}"
        [data]
        source = "task:sort"
        params = {{ min_len = 2, max_len = 3 }}
        val_source = "{val}"
        [rollout]
        prompts_per_step = 2
        n_samples = 2
        max_new_tokens = 4
        [trainer]
        micro_batch_size = 8
        [reward]
        by_source = {{ sorting = "position_match", reversing = "position_match" }}
        [eval]
        batch_size = 3
        n_samples = 2
        pass_k = [1, 2]
        correct_threshold = 0.3
        [run]
        steps = 6
        loop = "{loop}"
        max_staleness = 2
        dump_rollouts = true
        eval_every = 3
    """
    off = run_job(tmp_path / "off", body.format(name="off", loop="one_step_off", val=val))
    # Batch k+1 is generated while step k trains: exactly one version behind from step 1 on.
    assert [r["async/staleness_max"] for r in off] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    fully = run_job(tmp_path / "async", body.format(name="async", loop="async", val=val))
    assert len(fully) == 6
    assert all(r["async/staleness_max"] <= 2 and r["async/dropped_groups"] == 0 for r in fully)
    for records in (off, fully):  # after step 2 (every 3 steps) and after the last one
        assert [r["step"] for r in records if "eval/acc" in r] == [2, 5]
        assert records[5]["eval/prompts"] == 10 and records[5]["eval/sorting/prompts"] == 5
    # The last checkpoint (6 steps done) evaluated after the fact, in one process: the loop's numbers.
    from click.testing import CliRunner

    from milehpc.cli import cli

    res = CliRunner().invoke(cli, ["eval", str(tmp_path / "off" / "run"), "--data", str(val), "--json"])
    assert res.exit_code == 0, res.output
    offline = json.loads(res.stdout)
    assert offline["step"] == 6 and offline["file"].endswith("eval/step_6.json")
    assert off[5]["eval/weight_version"] == 6  # the weights after the last step, pushed for the evaluation alone
    assert offline["metrics"] == {k: v for k, v in off[5].items() if k.startswith("eval/")}
    assert offline["metrics"]["eval/reward_mean"] > 0  # partial credit: a comparison of more than zeros
    again = CliRunner().invoke(cli, ["eval", str(tmp_path / "off" / "run"), "--data", str(val)])
    assert again.exit_code == 2 and "--force" in again.output
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
        val_source = "VAL"
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
        [checkpoint]
        interval_steps = 2
        [reward]
        by_source = { sorting = "position_match", reversing = "position_match" }
        [eval]
        batch_size = 3
        [run]
        steps = 3
        eval_every = 5                # only after the last step
    """.replace("VAL", str(write_val(tmp_path / "val.jsonl"))))
    assert records[0]["dist/mpi_world_size"] == 2 and records[0]["dist/trainer_world_size"] == 2
    # Each engine evaluated its share of the held-out batches; `milehpc eval` on one engine gives the same numbers.
    assert [r["step"] for r in records if "eval/acc" in r] == [2] and records[2]["eval/prompts"] == 10
    from click.testing import CliRunner

    from milehpc.cli import cli

    res = CliRunner().invoke(cli, ["eval", str(tmp_path / "run"), "--data", str(tmp_path / "val.jsonl"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["metrics"] == {k: v for k, v in records[2].items() if k.startswith("eval/")}
    assert [r["rollout/samples"] for r in records] == [8.0, 8.0, 8.0]  # both engines' shares counted
    # `milehpc export` joins the two ranks' FSDP2 shards (tests/test_export.py).
    from test_export import check_export_matches_rollouts

    check_export_matches_rollouts(tmp_path / "run", 2, tmp_path / "hf")

"""DAPO as a recipe (issue 17, item 4): the overlong reward shaping (soft punishment) and overlong filtering worked by
hand, examples/dapo.toml learning on the CPU demo task in one process (~30 s), and the README's recipe table: every
row's settings load and pass every job rule."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest
import torch

from milehpc.algorithms.api import Algorithm, overlong_penalty
from milehpc.config import rules
from milehpc.config.load import load_job
from milehpc.samples import Sample, Status
from milehpc.samples.batch import to_batch

ROOT = Path(__file__).resolve().parents[1]
VALID_JOB = ROOT / "tests" / "corpus" / "valid-job.toml"


def test_soft_overlong_penalty_hand_worked():
    # max_len 10, buffer 4, factor 0.5: free up to 10 - 4 = 6 tokens, then -(L - 6) / 4 * 0.5.
    got = overlong_penalty(torch.tensor([3, 6, 7, 9, 10]), 10, 4, 0.5).tolist()
    assert got == pytest.approx([0.0, 0.0, -0.125, -0.375, -0.5])


def grpo_batch(lengths, rewards, statuses):
    samples = [Sample(prompt_ids=[1], response_ids=[2] * n, rollout_logprobs=[-1.0] * n, reward=r, status=s,
                      group=0, index=i) for i, (n, r, s) in enumerate(zip(lengths, rewards, statuses, strict=True))]
    return to_batch(samples, 0)


def test_overlong_shaping_moves_the_group_baseline():
    # One group, both answers right (reward 1) but of lengths 4 and 8 with max_new_tokens 8 and buffer 4: the penalty
    # is 0 and -(8 - 4) / 4 * 1 = -1, so GRPO sees scores 1 and 0: mean 0.5, unbiased std sqrt(0.5); the raw
    # rewards alone (1, 1) would give both advantage 0.
    job = load_job(VALID_JOB, ["algorithm.overlong_buffer=4", "rollout.max_new_tokens=8"])
    algo = Algorithm.from_job(job)
    b = grpo_batch([4, 8], [1.0, 1.0], [Status.COMPLETED, Status.TRUNCATED])
    metrics = algo.compute_advantages(b)
    std = statistics.stdev([1.0, 0.0])
    assert b.advantages[:, 0].tolist() == pytest.approx([0.5 / (std + 1e-6), -0.5 / (std + 1e-6)])
    assert metrics["reward/overlong_penalty"] == pytest.approx(-0.5)
    assert b.rewards.tolist() == [1.0, 1.0]  # the batch's own rewards are left as they were


def test_overlong_filter_trains_on_no_truncated_sample_yet_keeps_it_in_the_group():
    # Rewards 1 (completed, 2 tokens) and 0 (truncated, 3 tokens): GRPO's baseline still counts both
    # (mean 0.5, std sqrt(0.5)), but the truncated row's mask is zeroed, so the step counts 2 tokens, 1 sequence.
    job = load_job(VALID_JOB, ["algorithm.overlong_filter=true"])
    b = grpo_batch([2, 3], [1.0, 0.0], [Status.COMPLETED, Status.TRUNCATED])
    metrics = Algorithm.from_job(job).compute_advantages(b)
    assert b.response_mask.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    assert (b.num_tokens, b.num_seqs) == (2, 1)
    assert b.advantages[0, 0].item() == pytest.approx(0.5 / (statistics.stdev([1.0, 0.0]) + 1e-6))
    assert b.advantages[1].abs().sum() == 0
    assert metrics["reward/overlong_filtered_fraction"] == 0.5


@pytest.mark.slow
def test_the_dapo_example_learns_on_the_cpu_demo_task():
    from milehpc.runtime.loop import run_local

    # examples/dapo.toml in one process (the sync loop on one trainer rank), 40 of its 90 steps.
    job = load_job(ROOT / "examples" / "dapo.toml", ["trainer.dp=1", 'run.loop="sync"', "run.steps=40"])
    alg = job.algorithm
    assert (alg.loss_params["clip_high"] > alg.loss_params["clip_low"], job.rollout.dynamic_filter,
            alg.loss_agg_mode, alg.overlong_buffer > 0) == (True, True, "token-mean", True)
    history = run_local(job)
    rewards = [h["rollout/reward_mean"] for h in history]
    start, end = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert end >= start + 0.08, (start, end, rewards)
    assert any(h["train/reward/overlong_penalty"] < 0 for h in history)  # the shaping was on
    assert any(h["rollout/filtered_groups"] > 0 for h in history)  # and dynamic sampling dropped groups


# ---- the README's recipe table ------------------------------------------------------------------------------------

RECIPES = ("GRPO", "Dr. GRPO", "DAPO", "GSPO", "PPO", "REINFORCE++", "RLOO", "On-policy distillation")


def recipe_rows() -> dict[str, list[str]]:
    """Recipe name -> its ``--set`` overrides: the backticked ``key=value`` items of the table's second column."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| Recipe | Job-spec settings"):]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        name, settings = [cell.strip() for cell in line.strip("|").split("|")][:2]
        rows[name] = re.findall(r"`([^`]+=[^`]+)`", settings)
    return rows


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_row_of_the_readme_loads_and_passes_the_job_rules(recipe):
    rows = recipe_rows()
    assert set(rows) == set(RECIPES)
    job = load_job(VALID_JOB, rows[recipe])
    rules.check_job_rules(job, file=str(VALID_JOB))
    Algorithm.from_job(job)  # the plugins and their params resolve too

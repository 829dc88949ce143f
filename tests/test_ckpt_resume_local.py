"""The sync loop in one process is interrupted by SIGUSR1 (→ checkpoint request → checkpoint → requeue exit) at
random steps, resumed, and ends with parameters bitwise equal to an uninterrupted run with the same seed."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch

from milehpc.checkpoint import list_checkpoints
from milehpc.config.job import JobSpec
from milehpc.config.schema import build
from milehpc.runtime import signals
from milehpc.runtime.loop import run_local

STEPS = 6
TINY = {
    "name": "ckpt-local",
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
              "max_position_embeddings": 64},
    "data": {"source": "task:sort", "params": {"min_len": 3, "max_len": 4}},
    "rollout": {"prompts_per_step": 4, "n_samples": 4, "max_new_tokens": 6, "partial_rollout": True,
                "over_sample": 1.5, "dynamic_filter": True},
    "trainer": {"micro_batch_size": 32, "lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 2},
    "algorithm": {"kl_coef": 0.01},
    # partial credit: rewards differ within a group, so every step really trains (and depends on the samples)
    "reward": {"name": "toy_match", "params": {"partial": 1.0}},
    "run": {"steps": STEPS, "loop": "sync", "seed": 5, "dump_rollouts": False},
    "checkpoint": {"keep": 2},
}


def _job() -> JobSpec:
    return build(JobSpec, TINY)


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    newest = list_checkpoints(run_dir / "checkpoints")[0]
    assert newest.step == STEPS
    state = torch.load(newest.path / "rank-00000.pt", weights_only=True)["state"]
    return {**state["trainer"]["trainer"]["model"],
            **{f"opt.{k}": v for k, v in _flat(state["trainer"]["trainer"]["optimizer"]["state"]).items()}}


def _flat(opt_state: dict) -> dict[str, torch.Tensor]:
    return {f"{p}.{k}": v for p, d in opt_state.items() for k, v in d.items() if torch.is_tensor(v)}


def _run_interrupted(run_dir: Path, stops: list[int]) -> int:
    """Run to the end, sending ourselves SIGUSR1 (as Slurm sends the batch shell) after each step in ``stops``;
    every interruption must end in a requeue exit after a checkpoint at that step. Returns the number of runs."""
    previous = signals.forward_signals(run_dir, (signal.SIGUSR1,))
    try:
        runs, limit = 0, len(stops) + 1
        while True:
            runs += 1
            assert runs <= limit

            def on_step(step: int, metrics: dict) -> None:
                if step + 1 in stops:
                    stops.remove(step + 1)
                    os.kill(os.getpid(), signal.SIGUSR1)

            try:
                run_local(_job(), run_dir, on_step=on_step, checkpointing=True)
                return runs
            except signals.RequeueExit as err:
                assert err.exit_code == signals.EXIT_REQUEUE == 75
                assert not signals.request_path(run_dir).exists()  # consumed
                assert signals.checkpointed_path(run_dir).is_file()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run_local(_job(), run_dir, checkpointing=True)
    return _final_params(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("interruptions", [1, 2])
def test_interrupted_sync_loop_ends_bitwise_equal(tmp_path: Path, reference: dict[str, torch.Tensor],
                                                  interruptions: int, capsys: pytest.CaptureFixture[str]) -> None:
    stops = sorted(random.Random(interruptions * 7919 + os.getpid()).sample(range(1, STEPS), interruptions))
    runs = _run_interrupted(tmp_path, list(stops))
    assert runs == interruptions + 1, stops
    out = capsys.readouterr().out
    # every later run resumed from the step the previous one checkpointed (not a rerun from step 0)
    assert out.count("milehpc: resumed from") == interruptions, out
    for stop in stops:
        assert f"(step {stop}, restart 0)" in out, (stop, out)
    records = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == list(range(STEPS))  # new steps ran after each resume, each logged once
    got = _final_params(tmp_path)
    assert got.keys() == reference.keys()
    different = [k for k in got if not torch.equal(got[k], reference[k])]
    assert not different, f"interrupted at {stops}: {different[:5]}"
    # keep = 2: only the last two checkpoints remain
    assert len(list_checkpoints(tmp_path / "checkpoints")) == 2


def test_a_different_model_refuses_to_resume(tmp_path: Path) -> None:
    from milehpc.checkpoint import Checkpointer, layout_record
    from milehpc.errors import ConfigError

    job = _job()
    Checkpointer(tmp_path, layout={"parallel": {}, "model": {"hidden_size": 64}}).save(1, {})
    layout = layout_record(job, _plan_stub())
    with pytest.raises(ConfigError, match="different model"):
        Checkpointer(tmp_path, layout=layout).resume()


def _plan_stub():
    from types import SimpleNamespace

    return SimpleNamespace(world_size=1, trainer_ranks=1, tp=1, pp=1, dp=1, ep=1, rollout_ranks=1, engines=1,
                           gpus_per_engine=1, colocated=True)


@pytest.mark.slow
def test_a_target_reward_stop_leaves_a_final_checkpoint_that_resume_continues(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    window = 10  # schedule.TARGET_WINDOW: the mean of the last 10 steps must reach the target
    job = build(JobSpec, {**TINY, "run": {**TINY["run"], "steps": 14, "target_reward": 0.0}})
    history = run_local(job, tmp_path, checkpointing=True)
    assert len(history) == window  # reached (every mean is >= 0) as soon as the window is full
    [final] = [c for c in list_checkpoints(tmp_path / "checkpoints") if c.step == window]
    assert {"rank-00000.pt", "rank-00000.h5"} <= set(final.manifest["files"])
    assert final.manifest["meta"]["steps_done"] == window

    # The user raises the target (here: none) and resumes: the run continues from the final checkpoint.
    more = build(JobSpec, {**TINY, "run": {**TINY["run"], "steps": 14}})
    capsys.readouterr()
    history = run_local(more, tmp_path, checkpointing=True)
    assert f"(step {window}, restart 0)" in capsys.readouterr().out
    assert [h["step"] for h in history if "train/loss" in h] == list(range(window, 14))
    records = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == list(range(14))

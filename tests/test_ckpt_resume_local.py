"""The sync loop in one process is interrupted by SIGUSR1 (→ checkpoint request → checkpoint → requeue exit) at
random steps, resumed, and ends with parameters bitwise equal to an uninterrupted run with the same seed."""

from __future__ import annotations

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
                                                  interruptions: int) -> None:
    stops = sorted(random.Random(interruptions * 7919 + os.getpid()).sample(range(1, STEPS), interruptions))
    runs = _run_interrupted(tmp_path, list(stops))
    assert runs == interruptions + 1, stops
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

"""The step's reported loss does not depend on how the batch is cut into micro-batches: each micro-batch's loss
already carries the whole step's normaliser, so the trainers add those up, and average the per-token means
(entropy, clip fraction) by token share. The Megatron trainer sums the same way
(``milehpc.algorithms.api.add_micro_batch_metrics``; its parity with this trainer: tests/test_megatron_mpi.py)."""

from __future__ import annotations

import pytest
from test_loop_local import _batch, tiny_job

from milehpc.data.tokenizer import CharTokenizer
from milehpc.train.torch_trainer import TorchTrainer


@pytest.mark.parametrize(("advantage", "agg", "keys"), [
    ("gae", "token-mean", ("train/loss", "train/critic/value_loss", "train/actor/entropy")),
    ("grpo", "seq-mean-token-sum", ("train/loss", "train/actor/pg_loss", "train/actor/entropy"))])
def test_reported_step_loss_is_the_same_for_any_micro_batch_size(advantage: str, agg: str, keys: tuple) -> None:
    metrics = {}
    for mbs in (64, 3):  # the whole batch (16 samples) at once, then 6 micro-batches
        job = tiny_job(trainer={"micro_batch_size": mbs},
                       algorithm={"advantage": advantage, "loss_agg_mode": agg, "entropy_coef": 0.01})
        trainer = TorchTrainer(job, CharTokenizer())
        metrics[mbs] = trainer.train_step(_batch(job), 0)
    whole, cut = metrics[64], metrics[3]
    for key in keys:
        assert abs(whole[key]) > 1e-3, (key, whole)  # nothing vacuous
        assert cut[key] == pytest.approx(whole[key], rel=1e-5), (key, whole[key], cut[key])


def test_reported_ratio_extremes_are_the_steps_for_any_micro_batch_size() -> None:
    """``actor/ratio_max`` / ``ratio_min`` are the extremes over every token of the step (both PPO epochs: the
    first's ratios are exactly 1), not an average of the micro-batches' extremes."""
    metrics = {}
    for mbs in (64, 3):
        job = tiny_job(trainer={"micro_batch_size": mbs, "lr": 1e-2}, algorithm={"ppo_epochs": 2})
        metrics[mbs] = TorchTrainer(job, CharTokenizer()).train_step(_batch(job), 0)
    whole, cut = metrics[64], metrics[3]
    assert whole["train/actor/ratio_max"] > 1.0 > whole["train/actor/ratio_min"], whole  # the update moved ratios
    for key in ("train/actor/ratio_max", "train/actor/ratio_min"):
        assert cut[key] == pytest.approx(whole[key], rel=1e-5), (key, whole[key], cut[key])

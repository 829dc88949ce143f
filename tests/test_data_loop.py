"""The loop trains from a prepared dataset file: the shipped GSM8K-style sample in verl's Parquet layout (chat
messages through a real tokenizer's chat template, ``math_answer`` chosen by ``data_source``), validates on the
shipped validation Parquet every step, and every logger (metrics.jsonl, TensorBoard, W&B offline) records the same
metric names and values, the validation accuracy curve included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from required import require_module
from tiny_tokenizer import SAMPLES, build_tokenizer_folder
from wandb_records import history as wandb_history

from milehpc.config.load import job_from_dict
from milehpc.runtime.loop import run_local
from milehpc.samples.dumps import read_rollouts

require_module("wandb")


def test_steps_on_the_verl_parquet_with_validation_log_the_same_metrics_everywhere(tmp_path: Path, capsys,
                                                                                   monkeypatch) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    tok = build_tokenizer_folder(tmp_path / "tok")
    run_dir = tmp_path / "run"
    job = job_from_dict({
        "name": "gsm-sample",
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
                  "max_position_embeddings": 96, "tokenizer": str(tok)},
        "rollout": {"prompts_per_step": 2, "n_samples": 2, "max_new_tokens": 8},
        "trainer": {"micro_batch_size": 4},
        "data": {"source": str(SAMPLES / "gsm8k_style_train.parquet"), "max_prompt_tokens": 64,
                 "val_source": str(SAMPLES / "gsm8k_style_val.parquet")},
        "reward": {"by_source": {"gsm8k_style": {"name": "math_answer", "params": {"no_answer": -0.5}}}},
        "eval": {"greedy": True, "n_samples": 2, "pass_k": [1, 2], "max_new_tokens": 8},
        "logging": {"loggers": ["jsonl", "tensorboard", "wandb"], "params": {"wandb": {"project": "t"}}},
        "run": {"steps": 3, "eval_every": 1}})
    history = run_local(job, run_dir)
    steps = [0, 1, 2]
    assert [h["step"] for h in history] == steps
    out = capsys.readouterr().out
    assert "data: " in out and "train prompts from" in out and "longer than data.max_prompt_tokens = 64" in out, out
    # Validation after every step, per data source, each with that step's new weights: the accuracy curve.
    for h in history:
        assert h["eval/weight_version"] == h["step"] + 1, h
        assert h["eval/gsm8k_style/prompts"] == h["eval/prompts"] > 0, h
        assert {"eval/acc", "eval/gsm8k_style/acc", "eval/gsm8k_style/pass@2", "eval/reward_mean"} <= set(h), h

    # The samples came from the file, through the chat template, scored by the reward their data_source names.
    samples, _ = read_rollouts(run_dir, 1)
    assert samples and all(s.metadata["data_source"] == "gsm8k_style" for s in samples)
    assert all(s.prompt_text.startswith("<|im_start|>user\n") and "####" in s.prompt_text for s in samples)
    assert all(isinstance(s.reward, dict) and {"correct", "has_answer"} <= set(s.reward) for s in samples)

    jsonl = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    wandb = wandb_history(run_dir)
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for step in steps:
        logged = {k: v for k, v in jsonl[step].items() if k not in ("step", "time")}
        assert logged and {"rollout/reward_mean", "train/grad_norm", "eval/gsm8k_style/acc"} <= set(logged)
        assert wandb[step] == logged  # same names, same float64 values
    assert set(events.Tags()["scalars"]) == set(logged)
    for key in logged:
        tb = {e.step: e.value for e in events.Scalars(key)}
        assert tb == pytest.approx({s: jsonl[s][key] for s in steps}, rel=1e-6, abs=1e-6), key  # float32 in TB
    curve = {e.step: e.value for e in events.Scalars("eval/gsm8k_style/acc")}
    assert curve == pytest.approx({h["step"]: h["eval/gsm8k_style/acc"] for h in history})

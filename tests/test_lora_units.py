"""[trainer.lora] in one process: the torch trainer trains a peft adapter over a frozen base (the base is in neither
the optimizer nor the checkpoint), a sync moves the adapter alone, the reference engine applies it exactly (peft's
own merge, bit for bit, replaced rather than piled up at every sync), the weight check compares adapters, and an
interrupted run resumes bitwise equal."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from local_interrupt import run_cut_and_resumed
from required import require_module

from milehpc.checkpoint import list_checkpoints
from milehpc.config.job import JobSpec
from milehpc.config.load import job_from_dict
from milehpc.data.tokenizer import build_tokenizer
from milehpc.errors import ConfigError
from milehpc.rollout.reference import build_engine
from milehpc.runtime.loop import run_local
from milehpc.samples import Sample
from milehpc.train.torch_trainer import TorchTrainer
from milehpc.weights.check import compare_named_tensors
from milehpc.weights.inplace import load_in_place

require_module("peft")

LORA = {"rank": 4, "alpha": 8.0, "modules_to_save": ["lm_head"]}


def lora_job(**tables) -> JobSpec:
    data = {"name": "lora", "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                                      "intermediate_size": 64, "max_position_embeddings": 64},
            "data": {"source": "task:sort", "params": {"min_len": 3, "max_len": 4}},
            "rollout": {"prompts_per_step": 4, "n_samples": 4, "max_new_tokens": 6},
            "trainer": {"micro_batch_size": 32, "lr": 1e-2, "lora": dict(LORA)},
            "run": {"steps": 4, "loop": "sync", "seed": 3, "dump_rollouts": False}}
    for key, value in tables.items():
        data[key] = {**data.get(key, {}), **value}
    return job_from_dict(data, file="job.toml")


def _randomize_adapter(trainer: TorchTrainer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.module.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def test_only_the_adapter_is_trained_checkpointed_and_synced() -> None:
    job = lora_job()
    trainer = TorchTrainer(job, build_tokenizer("toy"))
    adapter = [n for n, p in trainer.module.named_parameters() if p.requires_grad]
    assert adapter and all(".lora_A." in n or ".lora_B." in n or ".modules_to_save." in n for n in adapter)
    owned = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert owned == {id(p) for _, p in trainer.module.named_parameters() if p.requires_grad}
    state = trainer.state_dict_for_checkpoint()["model"]
    assert set(state) == {"adapter", "base_source", "base_fingerprint"}
    assert len(state["adapter"]) == len(adapter) and state["base_source"] == "seeded build (run.seed = 3)"
    named = list(trainer.export_weights())
    assert {n for n, _ in named} == {"lora.scaling", "lm_head.weight"} | {
        n.removeprefix("base_model.model.").replace(".default.", ".") for n in adapter if ".lora_" in n}
    assert 0 < trainer.sync_bytes < trainer.full_model_bytes
    assert trainer.sync_bytes == sum(t.numel() * t.element_size() for _, t in named)


def test_the_engine_applies_each_sync_exactly_as_peft_merges_it() -> None:
    job = lora_job()
    trainer = TorchTrainer(job, build_tokenizer("toy"))
    engine = build_engine(job)
    for seed in (1, 2):  # the second sync replaces the first adapter, it does not add to it
        _randomize_adapter(trainer, seed)
        load_in_place(engine, trainer.export_weights(), seed)
        merged = copy.deepcopy(trainer.module).merge_and_unload().state_dict()
        got = engine.model.state_dict()
        assert merged.keys() == got.keys()
        assert [k for k in merged if not torch.equal(merged[k], got[k])] == [], seed
    check = compare_named_tensors(list(trainer.export_weights()), dict(engine.named_parameters()))
    assert check.ok and check.checked == len(list(trainer.export_weights())), check.summary()
    engine.adapter["model.layers.0.mlp.down_proj.lora_B.weight"] += 1e-3
    check = compare_named_tensors(list(trainer.export_weights()), dict(engine.named_parameters()))
    assert [m.name for m in check.mismatches] == ["model.layers.0.mlp.down_proj.lora_B.weight"]
    # The sampled tokens' logprobs: the engine's merged weights against the trainer's peft forward.
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    from milehpc.rollout.engine import SamplingParams

    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=5, n=2))
    lps = trainer.compute_logprobs(samples)
    diff = max(abs(a - b) for s, row in zip(samples, lps, strict=True)
               for a, b in zip(s.rollout_logprobs, row, strict=True))
    assert diff < 1e-5, diff


def test_a_pattern_matching_no_linear_layer_is_one_line_naming_the_field() -> None:
    job = lora_job(trainer={"lora": {**LORA, "target_modules": ["q_proj", "qkv_proj"]}})
    with pytest.raises(ConfigError) as info:
        TorchTrainer(job, build_tokenizer("toy"))
    assert str(info.value).startswith("trainer.lora.target_modules: expected a pattern matching a linear layer")
    assert "'qkv_proj'" in str(info.value) and "\n" not in str(info.value)


def test_globs_pick_modules_by_full_name() -> None:
    job = lora_job(trainer={"lora": {**LORA, "target_modules": ["model.layers.*.self_attn.[qv]_proj"]}})
    trainer = TorchTrainer(job, build_tokenizer("toy"))
    adapted = {n.split(".lora_")[0] for n, _ in trainer.export_weights() if ".lora_" in n}
    assert adapted == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"}


def test_a_checkpoint_over_another_base_is_refused() -> None:
    job = lora_job()
    state = TorchTrainer(job, build_tokenizer("toy")).state_dict_for_checkpoint()
    other = TorchTrainer(lora_job(run={"seed": 4}), build_tokenizer("toy"))
    with pytest.raises(ConfigError, match="expected the base the LoRA checkpoint was trained on"):
        other.load_checkpoint_state(state)


# ---- exact resume -------------------------------------------------------------------------------------------------

RESUME = {"algorithm": {"kl_coef": 0.01}, "reward": {"name": "toy_match", "params": {"partial": 1.0}},
          "trainer": {"micro_batch_size": 32, "lr": 1e-2, "sft_warmup_steps": 2, "sft_lr": 1e-2,
                      "lora": {**LORA, "dropout": 0.1}}}


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    newest = list_checkpoints(run_dir / "checkpoints")[0]
    state = torch.load(newest.path / "rank-00000.pt", weights_only=True)["state"]["trainer"]["trainer"]
    opt = {f"opt.{p}.{k}": v for p, d in state["optimizer"]["state"].items() for k, v in d.items()}
    return {**state["model"]["adapter"], **{f"ref.{k}": v for k, v in state["ref"]["adapter"].items()}, **opt}


def test_an_interrupted_lora_run_resumes_bitwise_equal(tmp_path: Path) -> None:
    job = lora_job(**RESUME)
    run_local(job, tmp_path / "whole", checkpointing=True)
    want = _final(tmp_path / "whole")
    state = torch.load(list_checkpoints(tmp_path / "whole" / "checkpoints")[0].path / "rank-00000.pt",
                       weights_only=True)["state"]["trainer"]["trainer"]
    assert not any("base_layer" in k or "original_module" in k for k in state["model"]["adapter"])
    assert len(state["optimizer"]["state"]) == len(state["model"]["adapter"])  # no base in the moments

    run_dir = tmp_path / "cut"
    run_cut_and_resumed(job, run_dir, stop_after=1)
    got = _final(run_dir)
    assert got.keys() == want.keys()
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in got.items())  # it did train


def test_sft_warmup_trains_the_adapter_alone() -> None:
    job = lora_job()
    trainer = TorchTrainer(job, build_tokenizer("toy"))
    base = {n: p.detach().clone() for n, p in trainer.module.named_parameters() if not p.requires_grad}
    opt = trainer.sft_optimizer(1e-2)
    sample = Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 2], group=0)
    trainer.sft_step([sample], opt)
    trainer.sft_step([sample], opt)
    after = dict(trainer.module.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in base.items())
    assert any(after[n].abs().sum() > 0 for n in after if ".lora_B." in n)

"""``[trainer.lora]`` with ``rollout.engine = "sglang"`` without the engine: the job rule (what SGLang's LoRA cannot
load is refused on the login node in one line), the adapter a sync hands to SGLang's LoRA API (peft names, config,
refusals), the engine's LoRA server args, and that the adapter goes by the bucketed broadcast to the rollout rank.
The real engine: tests/test_sglang_lora_contract.py and tests/test_sglang_lora_loop_real.py."""

from __future__ import annotations

import pytest

from milehpc.config.load import job_from_dict
from milehpc.config.rules import check_job_rules
from milehpc.errors import ConfigError, RuntimeFailure

MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64}


def job(lora: dict, engine: str = "sglang", **model):
    return job_from_dict({"name": "l", "model": {**MODEL, **model}, "rollout": {"engine": engine},
                          "trainer": {"lora": lora}}, file="job.toml")


def test_sglang_lora_refuses_an_moe_model() -> None:
    with pytest.raises(ConfigError, match=r"^job.toml: model.num_experts: expected a dense model .* got model.num_"):
        check_job_rules(job({"rank": 4}, num_experts=4, moe_top_k=2), file="job.toml")


@pytest.mark.parametrize(("targets", "why"), [
    (["c_attn"], "got ['c_attn']"),
    (["model.layers.*.self_attn.q_proj"], "['q_proj'] without ['v_proj']"),
    (["q_proj", "k_proj", "o_proj"], "['k_proj', 'q_proj'] without ['v_proj']"),
])
def test_sglang_lora_refuses_target_modules_sglang_cannot_adapt(targets, why) -> None:
    with pytest.raises(ConfigError) as info:
        check_job_rules(job({"target_modules": targets}), file="job.toml")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("job.toml: trainer.lora.target_modules: expected modules SGLang"), msg
    assert why in msg, msg


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["o_proj", "down_proj"], ["*_proj"], ["q_*"]])
def test_sglang_lora_accepts_what_sglang_loads_and_leaves_wildcards_to_the_ranks(targets) -> None:
    check_job_rules(job({"target_modules": targets}), file="job.toml")
    check_job_rules(job({"target_modules": ["lm_head"], "modules_to_save": ["lm_head"]}, engine="reference"))


def spec(**kw):
    from milehpc.config.job import LoraSpec

    return LoraSpec(**{"rank": 4, "alpha": 8.0, **kw})


def test_the_synced_adapter_becomes_peft_names_and_config() -> None:
    import torch

    from milehpc.rollout import sglang_lora

    a, b = torch.ones(4, 32), torch.zeros(32, 4)
    named = [("lora.scaling", torch.tensor([2.0], dtype=torch.float64)),
             *[(f"model.layers.0.self_attn.{m}.lora_{x}.weight", t) for m in ("q_proj", "v_proj") for x, t in
               (("A", a), ("B", b))]]
    tensors = sglang_lora.adapter_tensors(named, spec())
    assert sorted(tensors) == sorted(f"base_model.model.{n}" for n, _ in named[1:])
    a.add_(1)  # the sync's buffers are reused: the engine keeps copies
    assert float(tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"][0, 0]) == 1.0
    assert sglang_lora.config_dict(tensors, spec()) == {
        "peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "task_type": "CAUSAL_LM"}
    with pytest.raises(RuntimeFailure, match="modules_to_save"):
        sglang_lora.adapter_tensors([*named, ("lm_head.weight", torch.ones(2, 2))], spec())
    with pytest.raises(RuntimeFailure, match="scaling"):
        sglang_lora.adapter_tensors(named, spec(alpha=16.0))
    only_q = {n: t for n, t in tensors.items() if "q_proj" in n}
    with pytest.raises(ConfigError, match="q_proj and v_proj together"):
        sglang_lora.config_dict(only_q, spec())


def test_engine_args_enable_lora_with_a_cpu_backend_on_the_cpu_only() -> None:
    from milehpc.config.rules import SGLANG_LORA_MODULES
    from milehpc.rollout import sglang_lora

    gpu = sglang_lora.server_args(spec(rank=16), cpu=False)
    assert gpu == {"enable_lora": True, "max_lora_rank": 16, "lora_target_modules": list(SGLANG_LORA_MODULES),
                   "max_loras_per_batch": 2}
    assert sglang_lora.server_args(spec(), cpu=True)["lora_backend"] == "torch_native"
    names = {sglang_lora.adapter_name(v, n) for v, n in ((3, 1), (4, 2), (4, 3))}
    assert len(names) == 3  # a version loaded again gets a name of its own


def test_the_adapter_travels_to_the_rollout_rank_not_into_sglangs_update_group() -> None:
    from milehpc.weights.sync import direct_weight_sync

    assert direct_weight_sync(job_from_dict({"name": "f", "model": dict(MODEL), "rollout": {"engine": "sglang"}}))
    assert not direct_weight_sync(job({"rank": 4}))

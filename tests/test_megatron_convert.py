"""Megatron <-> HF conversion on small random Llama / Qwen2 / Qwen2-MoE / Mixtral models (pure torch: no
megatron import, no process group). The Megatron-side checks (logits, TP shards of a real model) are in
test_megatron_mpi.py."""

from __future__ import annotations

import pytest
import torch
import transformers

from milehpc.config.job import ModelSpec
from milehpc.errors import ConfigError
from milehpc.models import hf_config
from milehpc.train.megatron import convert
from milehpc.train.megatron.model import arch_of, padded_vocab_size

V = 37


def _hf(kind: str, hidden: int = 64) -> transformers.PreTrainedModel:
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=24, num_local_experts=4,
                                         num_experts_per_tok=2)
    else:
        spec = ModelSpec(arch="llama" if kind == "llama" else "qwen2", hidden_size=hidden, num_layers=2, num_heads=4,
                         num_kv_heads=2, intermediate_size=48, num_experts=4 if kind == "qwen2_moe" else 0)
        cfg = hf_config(spec, V)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # every entry distinct, so any misplaced row or column shows
    return model


KINDS = ["qwen2", "llama", "qwen2_moe", "mixtral"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["transformers", "checkpoint"])
def test_hf_megatron_hf_round_trip_is_exact(kind: str, layout: str) -> None:
    model = _hf(kind)
    arch = arch_of(model.config)
    hf = dict(model.state_dict())
    mg = convert.from_hf(hf, arch)
    back = dict(convert.to_hf(mg.items(), arch, moe_layout=layout))
    if layout == "transformers":
        assert set(back) == set(hf)
        assert all(torch.equal(back[k], hf[k]) for k in hf)
    again = convert.from_hf(back, arch)  # the checkpoint layout reads back to the same Megatron tensors
    assert set(again) == set(mg) and all(torch.equal(again[k], mg[k]) for k in mg)


def test_checkpoint_layout_names_are_the_per_expert_ones() -> None:
    for kind, names in (("mixtral", ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.3.w1.weight",
                                     "block_sparse_moe.experts.3.w2.weight", "block_sparse_moe.experts.3.w3.weight")),
                        ("qwen2_moe", ("mlp.gate.weight", "mlp.experts.3.gate_proj.weight",
                                       "mlp.experts.3.down_proj.weight", "mlp.shared_expert_gate.weight"))):
        model = _hf(kind)
        arch = arch_of(model.config)
        out = dict(convert.to_hf(convert.from_hf(dict(model.state_dict()), arch).items(), arch, moe_layout="checkpoint"))
        for n in names:
            assert f"model.layers.1.{n}" in out, n


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_slices_gather_back_exactly(kind: str, tp: int) -> None:
    model = _hf(kind)
    arch = arch_of(model.config)
    mg = convert.from_hf(dict(model.state_dict()), arch, padded_vocab=padded_vocab_size(V, tp))
    split = 0
    for name, full in mg.items():
        shards = convert.tp_split(name, full, tp)
        assert len(shards) == tp
        if convert.tp_dim(name) is not None:
            split += 1
            assert sum(s.shape[convert.tp_dim(name)] for s in shards) == full.shape[convert.tp_dim(name)]
        assert torch.equal(convert.tp_gather(name, shards), full)
    assert split >= 2 + 3 * arch.num_layers  # embeddings, output, qkv, proj, fc1/fc2 at least


def test_fc1_shards_hold_gate_and_up_slices_of_the_same_rows() -> None:
    gate = torch.arange(8.0).repeat_interleave(3).view(8, 3)
    up = 100 + gate
    fused = torch.cat([gate, up])
    shards = convert.tp_split("decoder.layers.0.mlp.linear_fc1.weight", fused, 2)
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))


def test_qkv_is_interleaved_per_query_group() -> None:
    model = _hf("qwen2")
    arch = arch_of(model.config)  # 4 heads, 2 KV groups, head_dim 16: per group [q, q, k, v]
    d = arch.head_dim
    q = torch.arange(4 * d, dtype=torch.float32)[:, None].repeat(1, 2)
    k, v = 1000 + torch.arange(2 * d, dtype=torch.float32)[:, None].repeat(1, 2), -1 - q[: 2 * d]
    fused = convert.qkv_from_hf(q, k, v, arch)
    group1 = fused[4 * d: 8 * d]
    assert torch.equal(group1[: 2 * d], q[2 * d:]) and torch.equal(group1[2 * d: 3 * d], k[d:])
    assert torch.equal(group1[3 * d:], v[d:])
    assert all(torch.equal(a, b) for a, b in zip(convert.qkv_to_hf(fused, arch), (q, k, v), strict=True))


def test_padded_vocab_rows_are_zero_and_trimmed_on_export_but_norms_are_not() -> None:
    model = _hf("qwen2", hidden=96)  # hidden > vocab: only vocab-sized tensors may be trimmed
    arch = arch_of(model.config)
    mg = convert.from_hf(dict(model.state_dict()), arch, padded_vocab=40)
    assert mg["output_layer.weight"].shape[0] == 40 and not mg["output_layer.weight"][V:].any()
    back = dict(convert.to_hf(mg.items(), arch))
    assert back["lm_head.weight"].shape[0] == V and back["model.norm.weight"].shape == (96,)


def test_pipeline_stage_renaming_and_local_shards() -> None:
    model = _hf("qwen2")
    arch = arch_of(model.config)
    mg = convert.from_hf(dict(model.state_dict()), arch, padded_vocab=38)
    # PP stage 2 of 2 holds global layer 1 as its local layer 0.
    local = ["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.final_layernorm.weight",
             "output_layer.weight"]
    shard = convert.local_shard(mg, local, tp=2, tp_rank=1, layer_offset=1)
    assert torch.equal(shard[local[0]], convert.tp_split(local[0], mg["decoder.layers.1.self_attention.linear_qkv.weight"],
                                                        2)[1])
    named = list(convert.rename_layers([(local[0], shard[local[0]])], layer_offset=1))
    assert named[0][0] == "decoder.layers.1.self_attention.linear_qkv.weight"


def test_converter_plugin_gathers_tp_shards() -> None:
    from milehpc.weights.converters import find_converter

    model = _hf("llama")
    arch = arch_of(model.config)
    mg = convert.from_hf(dict(model.state_dict()), arch, padded_vocab=38)
    sharded = [(n, convert.tp_split(n, t, 2)) for n, t in mg.items()]
    out = dict(find_converter("megatron", "hf", {"tp": 2})(sharded, arch=arch))
    assert set(out) == set(model.state_dict())
    assert all(torch.equal(out[k], v) for k, v in model.state_dict().items())


def test_unknown_names_and_unsupported_configs_fail_clearly() -> None:
    arch = arch_of(_hf("qwen2").config)
    with pytest.raises(KeyError, match="unknown parameter"):
        list(convert.to_hf([("decoder.layers.0.mystery.weight", torch.zeros(1))], arch))
    with pytest.raises(ConfigError, match="model_type in: .*qwen3.*; got 'gpt2'"):
        arch_of(transformers.GPT2Config())

"""The SGLang plugin's request/response mapping, tested against SGLang's own signatures.

sglang cannot be installed here (it pulls a CUDA torch), so its signatures are written down below as stand-ins,
copied as *facts* (parameter names, defaults, field names, output shapes) from sgl-project/sglang at commit
001067ff; every test that uses them says "standin" in its name:

* ``python/sglang/srt/entrypoints/engine.py`` — ``Engine.generate``, ``init_weights_update_group``,
  ``update_weights_from_distributed``, ``update_weights_from_tensor``, ``release_memory_occupation``,
  ``resume_memory_occupation``, ``get_weights_by_name``;
* ``python/sglang/srt/sampling/sampling_params.py`` — the API fields of ``SamplingParams``;
* ``python/sglang/srt/managers/tokenizer_manager.py`` / ``managers/schedule_batch.py`` — the output dict,
  ``output_token_logprobs`` tuples, ``finish_reason`` JSON, base64 int32 ``routed_experts``;
* ``python/sglang/srt/server_args.py`` — the ServerArgs fields milehpc sets.
"""

from __future__ import annotations

import base64
import inspect

import numpy as np
import pytest
import torch

from milehpc.config.load import job_from_dict
from milehpc.config.precision import resolve_precision
from milehpc.config.sglang_options import parse_options
from milehpc.errors import ConfigError, RuntimeFailure
from milehpc.rollout import sglang_mapping as sm
from milehpc.rollout.engine import SamplingParams
from milehpc.samples import Sample, Status


# ---- signature facts (stand-ins: sglang cannot be imported here) -------------------------------------------------
class SGLangEngineSignatureStandIn:
    """Parameter lists of sglang.srt.entrypoints.engine.Engine (bodies omitted)."""

    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None, audio_data=None,
                 video_data=None, mm_hashes=None, mm_content_hashes=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=None, lora_path=None,
                 custom_logit_processor=None, require_reasoning=False, return_hidden_states=False,
                 return_routed_experts=False, routed_experts_start_len=0, stream=False, bootstrap_host=None,
                 bootstrap_port=None, bootstrap_room=None, routed_dp_rank=None, disagg_prefill_dp_rank=None,
                 data_parallel_rank=None, external_trace_header=None, rid=None, session_params=None, priority=None,
                 session_id=None, *, cache_salt=None): ...

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"): ...

    def destroy_weights_update_group(self, group_name): ...

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None): ...

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True): ...

    def release_memory_occupation(self, tags=None): ...

    def resume_memory_occupation(self, tags=None): ...

    def get_weights_by_name(self, name, truncate_size=100): ...

    def flush_cache(self): ...


# The API fields of sglang.srt.sampling.sampling_params.SamplingParams.
SGLANG_SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed",
}
# ServerArgs fields milehpc sets (each checked present in sglang/srt/server_args.py).
SGLANG_SERVER_ARGS_FIELDS = {
    "model_path", "tokenizer_path", "skip_tokenizer_init", "tp_size", "nnodes", "node_rank", "dist_init_addr",
    "base_gpu_id", "random_seed", "port", "log_level", "dtype", "quantization", "enable_memory_saver",
    "mem_fraction_static", "enable_return_routed_experts", "speculative_algorithm", "speculative_draft_model_path",
    "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens", "load_format",
    "custom_sigquit_handler", "enable_weights_cpu_backup", "enable_draft_weights_cpu_backup",
}
SGLANG_QUANTIZATION_CHOICES_USED = {"fp8", "mxfp8"}  # both in server_args.QUANTIZATION_CHOICES


def sglang_output_standin(output_ids, logprobs, finish, *, routed=None, prompt_tokens=0):
    """An output dict shaped exactly as TokenizerManager._handle_batch_output builds it (skip_tokenizer_init)."""
    meta = {"id": "rid-0", "finish_reason": finish, "prompt_tokens": prompt_tokens, "weight_version": "default",
            "completion_tokens": len(output_ids), "cached_tokens": 0,
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, output_ids, strict=True)]}
    if routed is not None:
        meta["routed_experts"] = routed
    return {"output_ids": list(output_ids), "meta_info": meta}


def job(**sections):
    base = {"name": "t", "rollout": {"engine": "sglang"}}
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return job_from_dict(base, file="job.toml")


# ---- requests ---------------------------------------------------------------------------------------------------
def test_generate_kwargs_bind_to_sglang_engine_signature_standin():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=5, stop_token_ids=[2], n=3, seed=11)
    reqs = sm.build_requests([[5, 6, 7], [8, 9]], sp)
    kwargs = sm.generate_kwargs(reqs, return_routed_experts=True)
    bound = inspect.signature(SGLangEngineSignatureStandIn.generate).bind(None, **kwargs)  # raises if a name is off
    assert bound.arguments["return_logprob"] is True and bound.arguments["return_routed_experts"] is True
    assert kwargs["input_ids"] == [[5, 6, 7]] * 3 + [[8, 9]] * 3  # n requests per prompt, grouped
    assert [r.group for r in reqs] == [0, 0, 0, 1, 1, 1]
    for params in kwargs["sampling_params"]:
        assert set(params) <= SGLANG_SAMPLING_FIELDS
        assert params["top_k"] == -1  # SGLang's "whole vocabulary"
        assert params["max_new_tokens"] == 5 and params["stop_token_ids"] == [2]
        assert params["no_stop_trim"] is True and params["skip_special_tokens"] is False
    seeds = [p["sampling_seed"] for p in kwargs["sampling_params"]]
    assert len(set(seeds)) == 6  # one seed per sample, or the n samples of a group would be identical


def test_sampling_params_pass_top_k_and_stop_strings_standin():
    params = sm.sampling_params(SamplingParams(top_k=20, stop=["\n\n"], temperature=0.0))
    assert set(params) <= SGLANG_SAMPLING_FIELDS
    assert params["top_k"] == 20 and params["stop"] == ["\n\n"] and params["temperature"] == 0.0
    assert "sampling_seed" not in params and "stop_token_ids" not in params


def test_partial_rollouts_continue_with_the_budget_left():
    sp = SamplingParams(max_new_tokens=6, n=2)
    half = Sample(prompt_ids=[1, 2], response_ids=[7, 8], rollout_logprobs=[-0.5, -0.25], group=4, index=9,
                  weight_version=3, status=Status.ABORTED, label="x")
    full = Sample(prompt_ids=[1, 2], response_ids=[7] * 6, rollout_logprobs=[-1.0] * 6, group=4, index=10)
    reqs = sm.build_requests([], sp, [half, full])
    assert len(reqs) == 1  # the finished one has no budget left
    (r,) = reqs
    assert r.input_ids == [1, 2, 7, 8] and r.sampling_params["max_new_tokens"] == 4
    out = sm.to_sample(sglang_output_standin([9, 3], [-0.1, -0.2], {"type": "length", "length": 4}), r,
                       weight_version=5)
    assert out.response_ids == [7, 8, 9, 3] and out.rollout_logprobs == [-0.5, -0.25, -0.1, -0.2]
    assert out.status == Status.TRUNCATED and out.group == 4 and out.index == 9 and out.label == "x"
    assert out.weight_version == 3  # the policy of the first token
    assert out.metadata["version_spans"] == [[2, 5]]


# ---- responses --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("finish", "status"), [
    ({"type": "stop", "matched": 2}, Status.COMPLETED),
    ({"type": "stop", "matched": "\n\n"}, Status.COMPLETED),
    ({"type": "length", "length": 3}, Status.TRUNCATED),
    ({"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}, Status.ABORTED),
    (None, Status.ABORTED),
])
def test_finish_reasons_map_to_status_standin(finish, status):
    req = sm.build_requests([[4, 5]], SamplingParams(max_new_tokens=3))[0]
    s = sm.to_sample(sglang_output_standin([6, 7, 2], [-1.5, -0.5, -0.01], finish), req, weight_version=2)
    assert s.status == status
    assert s.prompt_ids == [4, 5] and s.response_ids == [6, 7, 2]
    assert s.rollout_logprobs == [-1.5, -0.5, -0.01] and s.loss_mask == [1, 1, 1] and s.weight_version == 2


def test_unknown_finish_reason_and_inconsistent_output_are_errors_standin():
    req = sm.build_requests([[4]], SamplingParams())[0]
    with pytest.raises(RuntimeFailure, match="unknown finish_reason"):
        sm.to_sample(sglang_output_standin([6], [-1.0], {"type": "eos??"}), req, weight_version=0)
    bad = sglang_output_standin([6, 7], [-1.0, -2.0], {"type": "stop", "matched": 7})
    bad["output_ids"] = [6, 8]
    with pytest.raises(RuntimeFailure, match="disagree"):
        sm.to_sample(bad, req, weight_version=0)
    no_lp = {"output_ids": [6], "meta_info": {"finish_reason": {"type": "length", "length": 1}}}
    with pytest.raises(RuntimeFailure, match="output_token_logprobs"):
        sm.to_sample(no_lp, req, weight_version=0)


def test_routed_experts_decode_like_sglang_encodes_them_standin():
    layers, topk, prompt, resp = 3, 2, [10, 11, 12, 13], [20, 21, 22]
    rows = len(prompt) + len(resp) - 1  # one row per token fed to the model
    ids = np.arange(rows * layers * topk, dtype=np.int32).reshape(rows, layers, topk) % 8
    # What TokenizerManager does with the scheduler's int32 tensor: pybase64.b64encode(t.numpy().tobytes())
    encoded = base64.b64encode(ids.tobytes()).decode("utf-8")
    assert encoded == sm.encode_routed_experts(ids.tolist())
    req = sm.build_requests([prompt], SamplingParams(max_new_tokens=3))[0]
    s = sm.to_sample(sglang_output_standin(resp, [-0.3] * 3, {"type": "length", "length": 3}, routed=encoded),
                     req, weight_version=1, moe_shape=(layers, topk))
    # Response token j was sampled by the forward pass at position len(prompt) - 1 + j.
    assert s.routed_experts == ids[len(prompt) - 1:].tolist() and len(s.routed_experts) == len(resp)
    assert s.metadata["prompt_routed_experts"] == ids[:len(prompt) - 1].tolist()
    with pytest.raises(RuntimeFailure, match="expected"):
        sm.decode_routed_experts(encoded, rows + 1, layers, topk)
    with pytest.raises(RuntimeFailure, match="no routed_experts"):
        sm.to_sample(sglang_output_standin(resp, [-0.3] * 3, None), req, weight_version=1, moe_shape=(layers, topk))


# ---- weight updates ------------------------------------------------------------------------------------------------
def test_weight_metadata_binds_and_round_trips_dtypes_standin():
    named = [("model.embed_tokens.weight", torch.zeros(10, 4, dtype=torch.bfloat16)),
             ("model.norm.weight", torch.zeros(4, dtype=torch.float32)),
             ("lm_head.weight", torch.zeros(10, 4, dtype=torch.float16))]
    meta = sm.weight_metadata(named)
    inspect.signature(SGLangEngineSignatureStandIn.update_weights_from_distributed).bind(
        None, **meta, group_name=sm.group_name(0), flush_cache=False)
    assert meta["names"] == [n for n, _ in named]
    assert meta["dtypes"] == ["bfloat16", "float32", "float16"]
    # The scheduler's side of the contract: getattr(torch, dtype) and torch.empty(shape, dtype=...).
    for (_, t), dt, shape in zip(named, meta["dtypes"], meta["shapes"], strict=True):
        assert torch.empty(shape, dtype=getattr(torch, dt)).shape == t.shape and getattr(torch, dt) == t.dtype
    inspect.signature(SGLangEngineSignatureStandIn.init_weights_update_group).bind(
        None, master_address="10.0.0.1", master_port=29500, rank_offset=sm.rank_offset(2, 4), world_size=13,
        group_name=sm.group_name(1), backend="nccl")
    assert sm.rank_offset(0, 4) == 1 and sm.rank_offset(2, 4) == 9  # rank 0 = the trainer's stage leader


def test_buckets_respect_the_size_and_keep_order():
    named = [(f"w{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    got = list(sm.buckets(named, bucket_bytes=80))
    assert [[n for n, _ in b] for b in got] == [["w0", "w1"], ["w2"], ["w3"], ["w4"], ["w5"]]
    assert [n for b in got for n, _ in b] == [n for n, _ in named]


# ---- options, server args, precision -------------------------------------------------------------------------------
def test_server_args_are_sglang_fields_and_follow_the_spec_standin(tmp_path):
    draft = tmp_path / "eagle"
    spec = job_from_dict({"name": "t", "model": {"num_experts": 4},
                          "rollout": {"engine": "sglang", "engines": 1, "gpus_per_engine": 2, "options": {
                              "speculative": {"algorithm": "EAGLE", "draft_model_path": str(draft), "num_steps": 3,
                                              "eagle_topk": 4, "num_draft_tokens": 8},
                              "server_args": {"enable_weights_cpu_backup": True}}},
                          "trainer": {"precision": "fp8", "fp8_recipe": "mxfp8", "dp": 2},
                          "resources": {"colocate": True}}, file="job.toml")
    opts = parse_options(spec.rollout.options, file="job.toml")
    layout = sm.EngineLayout(engine=1, engine_rank=1, gpus_per_engine=2, dist_init_addr="node3:41000", port=30016)
    args = sm.server_args(spec, opts, resolve_precision(spec), layout, model_path="/m", tokenizer_path=None)
    assert set(args) <= SGLANG_SERVER_ARGS_FIELDS
    assert args["tp_size"] == 2 and args["nnodes"] == 2 and args["node_rank"] == 1 and args["base_gpu_id"] == 0
    assert args["dist_init_addr"] == "node3:41000" and args["random_seed"] == spec.run.seed + 1
    assert args["dtype"] == "bfloat16" and args["quantization"] in SGLANG_QUANTIZATION_CHOICES_USED
    assert args["quantization"] == "mxfp8"
    assert args["enable_memory_saver"] is True and args["mem_fraction_static"] == 0.5
    assert args["enable_return_routed_experts"] is True and args["skip_tokenizer_init"] is True
    assert args["speculative_algorithm"] == "EAGLE" and args["speculative_draft_model_path"] == str(draft)
    assert (args["speculative_num_steps"], args["speculative_eagle_topk"], args["speculative_num_draft_tokens"]) \
        == (3, 4, 8)
    assert args["enable_weights_cpu_backup"] is True
    # Colocated with a draft model: its weights survive the release (the update refills the target model only).
    assert args["enable_draft_weights_cpu_backup"] is True


def test_only_a_colocated_draft_model_is_backed_up_and_the_backup_is_milehpcs_to_set():
    """Issue 30: a colocated EAGLE engine's release drops the draft's weights (no CPU copy), and the sync sends the
    target model's only; separate rollout ranks never release, so they need no backup."""
    spec = {"speculative": {"algorithm": "EAGLE", "draft_model_path": "/d", "num_steps": 3, "num_draft_tokens": 4}}
    layout = sm.EngineLayout(0, 0, 1, None, 30000)
    for colocate, want in ((True, True), (False, None)):
        j = job(rollout={"options": spec}, resources={"colocate": colocate})
        args = sm.server_args(j, parse_options(j.rollout.options), resolve_precision(j), layout, model_path="/m",
                              tokenizer_path=None)
        assert args.get("enable_draft_weights_cpu_backup") is want, colocate
    colocated_plain = job(resources={"colocate": True})
    args = sm.server_args(colocated_plain, parse_options({}), resolve_precision(colocated_plain), layout,
                          model_path="/m", tokenizer_path=None)
    assert "enable_draft_weights_cpu_backup" not in args  # no draft model, nothing to back up
    with pytest.raises(ConfigError, match="server_args.enable_draft_weights_cpu_backup: set by milehpc"):
        parse_options({"server_args": {"enable_draft_weights_cpu_backup": False}}, file="job.toml")


@pytest.mark.parametrize(("options", "field", "text"), [
    ({"speculative": {"algorithm": "EAGLE"}}, "rollout.options.speculative.draft_model_path", "draft model"),
    ({"speculative": {"draft_model_path": "/d", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 6}},
     "rollout.options.speculative.num_draft_tokens", "num_steps + 1 = 4"),
    ({"speculative": {"draft_model_path": "/d", "num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 9}},
     "rollout.options.speculative.num_draft_tokens", "at most"),
    ({"speculative": {"draft_model_path": "/d", "eagle_topk": 0}}, "rollout.options.speculative.eagle_topk", ">= 1"),
    ({"speculative": {"algorithm": "MEDUSA"}}, "rollout.options.speculative.algorithm", "one of"),
    ({"server_args": {"tp_size": 8}}, "rollout.options.server_args.tp_size", "rollout.gpus_per_engine"),
    ({"mem_fraction_static": 1.5}, "rollout.options.mem_fraction_static", "<= 0.95"),
    ({"nonsense": 1}, "rollout.options.nonsense", "unknown key"),
])
def test_bad_options_give_one_line_naming_the_field(options, field, text):
    with pytest.raises(ConfigError) as info:
        parse_options(options, file="job.toml")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"job.toml: {field}: ") and text in msg


def test_nextn_needs_no_draft_model_and_chain_is_accepted():
    opts = parse_options({"speculative": {"algorithm": "NEXTN", "num_steps": 2, "num_draft_tokens": 3}})
    assert opts.spec.server_args() == {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2,
                                              "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3}


def test_unknown_server_arg_is_rejected_against_the_field_list_standin():
    sm.check_server_args_known({"enable_weights_cpu_backup": True}, SGLANG_SERVER_ARGS_FIELDS)
    with pytest.raises(ConfigError, match="rollout.options.server_args.enable_warp_drive: not an SGLang"):
        sm.check_server_args_known({"enable_warp_drive": True}, SGLANG_SERVER_ARGS_FIELDS)


def test_a_dense_single_gpu_engine_gets_no_moe_multinode_or_memory_saver_args():
    layout = sm.EngineLayout(0, 0, 1, None, 30000)
    plain = sm.server_args(job(), parse_options({}), resolve_precision(job()), layout, model_path="/m",
                           tokenizer_path=None)
    assert "nnodes" not in plain and "enable_return_routed_experts" not in plain
    assert "enable_memory_saver" not in plain and "mem_fraction_static" not in plain


@pytest.mark.parametrize(("precision", "recipe", "engine", "quant", "fp8"), [
    ("fp32", "delayed", "float32", None, None),
    ("bf16", "delayed", "bfloat16", None, None),
    ("fp8", "delayed", "bfloat16", "fp8", "hybrid"),
    ("fp8", "tensorwise", "bfloat16", "fp8", "hybrid"),
    ("fp8", "blockwise", "bfloat16", "fp8", "e4m3"),
    ("fp8", "mxfp8", "bfloat16", "mxfp8", "e4m3"),
])
def test_precision_reaches_trainer_and_engine_consistently(precision, recipe, engine, quant, fp8):
    spec = job(trainer={"precision": precision, "fp8_recipe": recipe})
    p = resolve_precision(spec)
    assert p.sglang_server_args() == ({"dtype": engine} | ({"quantization": quant} if quant else {}))
    mcfg = p.megatron_config()
    assert mcfg["bf16"] is (precision != "fp32") and mcfg.get("fp8") == fp8
    assert mcfg["params_dtype"] == ("float32" if precision == "fp32" else "bfloat16")
    assert (p.te_recipe_class() is None) is (precision != "fp8")


def test_megatron_config_keys_are_real_transformer_config_fields():
    """Against the installed megatron-core (real, not a stand-in): names and allowed values."""
    import dataclasses
    import typing

    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    hints = typing.get_type_hints(TransformerConfig)
    for recipe in ("delayed", "tensorwise", "blockwise", "mxfp8"):
        cfg = resolve_precision(job(trainer={"precision": "fp8", "fp8_recipe": recipe})).megatron_config()
        assert set(cfg) <= set(fields)
        assert cfg["fp8"] in typing.get_args(typing.get_args(hints["fp8"])[0])
        assert cfg["fp8_recipe"] in typing.get_args(typing.get_args(hints["fp8_recipe"])[0])

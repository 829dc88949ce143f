"""Megatron-core checks on ONE process (a world of one gloo rank), one launch (importing megatron takes seconds):

    python tests/megatron_single_checks.py OUT.json

tests/test_megatron_single.py asserts on the JSON. Groups:

* ``te``      — contract: the parameter names of Megatron's transformer-engine layer spec, derived from megatron-core
  itself (the TE spec tree built by megatron-core's own ``TESpecProvider``, and megatron-core's own local -> TE
  key renames, ``sharded_state_dict_keys_map``), vs the HF <-> Megatron converters (issue 12, fault 6).
* ``packed``  — packed (THD-layout) micro-batches vs the padded layout on the local spec: logprobs and a training
  step; and the trainer under TE's attention semantics (causal, the mask argument ignored, THD segments honoured)
  vs HF logprobs (fault 7).
* ``extra``   — MoE logits vs HF (Qwen2-MoE, Mixtral-style router), bf16 (``Float16Module``), the SFT warm-up with
  and without the distributed optimizer.
"""

from __future__ import annotations

import json
import re
import sys
import warnings
from typing import Any

from megatron_checks import V, _job, _samples


# ---- te: the transformer-engine spec's names -----------------------------------------------------------------
def te_layer_spec(num_experts: int | None) -> tuple[Any, Any]:
    """Megatron's TE layer spec and its backend provider, built without transformer-engine installed.

    megatron-core's ``extensions.transformer_engine`` imports without TE (its TE classes stay importable), but
    ``gpt_layer_specs`` binds ``TESpecProvider`` only when ``import transformer_engine`` works, and the spec asks TE's
    version: bind megatron's own provider and answer with the TE version the gpu extra pins."""
    from megatron.core import utils as mutils
    from megatron.core.extensions import transformer_engine_spec_provider as tsp
    from megatron.core.models.gpt import gpt_layer_specs as g
    from packaging.version import Version

    from milehpc.config.tested_versions import TESTED_TRANSFORMER_ENGINE

    mutils._te_version = Version(TESTED_TRANSFORMER_ENGINE)
    g.TESpecProvider = tsp.TESpecProvider
    return g.get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts), tsp.TESpecProvider()


def _slot(submodules: Any, path: str) -> Any:
    """The module class a spec puts at ``path`` ("self_attention.linear_qkv"), or None."""
    obj = submodules
    for part in path.split("."):
        obj = getattr(obj, "submodules", obj)
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return getattr(obj, "module", obj)


def te_keys(local_model: Any, num_experts: int | None) -> tuple[set[str], dict[str, str]]:
    """The state-dict keys the same model has under the TE spec: the local model's keys with megatron-core's
    local -> TE renames applied where the TE spec really fuses (no module of its own at the source slot, a
    LayerNorm+Linear module at the target)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp

    te_spec, provider = te_layer_spec(num_experts)
    fused = provider.column_parallel_layer_norm_linear()
    local_spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm")
    renames = {}
    for src, dst in local_spec.submodules.sharded_state_dict_keys_map.items():
        owner = dst.rsplit(".", 1)[0]
        if _slot(te_spec.submodules, src.rstrip(".")) is IdentityOp and _slot(te_spec.submodules, owner) is fused:
            renames[src] = dst
    keys = set()
    for k in local_model.state_dict():
        if k.endswith("_extra_state"):
            continue
        m = re.match(r"^(decoder\.layers\.\d+\.)(.*)$", k)
        if m:
            for src, dst in renames.items():
                if m.group(2).startswith(src):
                    k = m.group(1) + dst + m.group(2)[len(src):]
        keys.add(k)
    return keys, renames


def _converter_findings(arch: Any, hf_sd: dict, local_named: dict, te_named: dict, keys: set[str],
                        local_keys: list[str]) -> dict[str, Any]:
    """The converters against the TE names; an exception (the old converters' KeyError on TE names) is recorded
    as the finding instead of ending the launch."""
    import torch

    from milehpc.train.megatron import convert

    out: dict[str, Any] = {}
    try:
        out["from_hf_vs_te_keys"] = sorted(set(convert.from_hf(hf_sd, arch, fused_norms=True)) ^ keys)
    except Exception as err:
        out["from_hf_vs_te_keys"] = f"{type(err).__name__}: {err}"
    try:  # the trainer's load: the converter's full tensors -> a TE-spec model's names
        shard = convert.local_shard(local_named, sorted(keys), tp=1, tp_rank=0, layer_offset=0)
        out["load_into_te_names_exact"] = set(shard) == keys and all(torch.equal(shard[k], te_named[k]) for k in keys)
    except Exception as err:
        out["load_into_te_names_exact"] = f"{type(err).__name__}: {err}"
    try:  # and TE-named full tensors -> the local spec's names
        out["load_into_local_names"] = len(convert.local_shard(te_named, local_keys, tp=1, tp_rank=0, layer_offset=0))
    except Exception as err:
        out["load_into_local_names"] = f"{type(err).__name__}: {err}"
    try:  # the export: a TE-spec model's parameters -> HF
        exported = dict(convert.to_hf(te_named.items(), arch))
        out["export_from_te_names_exact"] = exported.keys() == hf_sd.keys() and all(
            torch.equal(exported[k], hf_sd[k]) for k in hf_sd)
    except Exception as err:
        out["export_from_te_names_exact"] = f"{type(err).__name__}: {err}"
    return out


def check_te() -> dict[str, Any]:

    from milehpc.models import build_model
    from milehpc.train.megatron import convert
    from milehpc.train.megatron import model as mm
    from milehpc.train.megatron.trainer import init_parallel

    out: dict[str, Any] = {}
    for kind, extra in (("qwen2", {}), ("llama", {"arch": "llama"}),
                        ("qwen2_moe", {"num_experts": 4, "moe_top_k": 2, "intermediate_size": 32})):
        job = _job(model=extra)
        hf = build_model(job.model, V, seed=5)
        arch = mm.arch_of(hf.config)
        init_parallel(1, 1, 1, moe=arch.is_moe)
        local_model = mm.build_gpt(arch, mm.transformer_config(arch, job.trainer), tp=1)
        keys, renames = te_keys(local_model, arch.num_experts or None)
        hf_sd = dict(hf.state_dict())
        out[f"{kind}_renames"] = renames
        out[f"{kind}_te_has_fused_qkv_norm"] = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys
        # The full tensors under TE names, renamed with megatron-core's renames (independent of the converter).
        local_named = convert.from_hf(hf_sd, arch)
        te_named = {}
        for name, t in local_named.items():
            m = re.match(r"^(decoder\.layers\.\d+\.)(.*)$", name)
            for src, dst in renames.items():
                if m and m.group(2).startswith(src):
                    name = m.group(1) + dst + m.group(2)[len(src):]
            te_named[name] = t
        local_keys = [k for k in local_model.state_dict() if not k.endswith("_extra_state")]
        out[f"{kind}_local_param_count"] = len(local_keys)

        out.update({f"{kind}_{k}": v for k, v in _converter_findings(arch, hf_sd, local_named, te_named, keys,
                                                                      local_keys).items()})
    return out


# ---- packed: THD packing and TE's mask semantics --------------------------------------------------------------
def _maxdiff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def _hf_logprobs(hf: Any, samples: list[Any]) -> list[list[float]]:
    """Each sample alone through the HF model: no padding anywhere."""
    import torch

    rows = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            lp = torch.log_softmax(hf(input_ids=ids).logits[0].float(), -1)
            p = len(s.prompt_ids)
            rows.append([float(lp[p - 1 + j, t]) for j, t in enumerate(s.response_ids)])
    return rows


def _te_attention_semantics(module: Any) -> None:
    """Make the local-spec model attend as TE's attention does under the TE spec's ``AttnMaskType.causal``:
    the ``attention_mask`` argument is not read (plain causal over the row), and ``PackedSeqParams`` (THD) make it
    causal within each ``cu_seqlens`` segment. Written here from TE's documented behaviour, independent of milehpc."""
    import torch

    forward = module.forward

    def te_forward(input_ids: Any, position_ids: Any, attention_mask: Any, *args: Any,
                   packed_seq_params: Any = None, **kwargs: Any) -> Any:
        mask = None  # causal: TE ignores the mask it is given
        if packed_seq_params is not None:
            assert packed_seq_params.qkv_format == "thd"
            cu = packed_seq_params.cu_seqlens_q.long()
            n = int(input_ids.shape[1])
            assert int(cu[-1]) == n, (cu, n)
            seg = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
            pos = torch.arange(n)
            mask = ~((seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None]))[None, None]
        return forward(input_ids, position_ids, mask, *args, **kwargs)

    module.forward = te_forward


def check_packed() -> dict[str, Any]:
    from milehpc.models import build_model
    from milehpc.train.megatron.trainer import MegatronTrainer

    out: dict[str, Any] = {}
    samples = _samples(11, n=7)
    job = _job(tp=1, micro_batch_size=3)
    padded = MegatronTrainer(job, pad_id=0, vocab_size=V)
    packed = MegatronTrainer(job, pad_id=0, vocab_size=V)
    packed.packed, packed.thd = True, False  # the local spec: packed rows with a block-diagonal causal mask
    out["packed_vs_padded_logprobs"] = _maxdiff(padded.compute_logprobs(samples), packed.compute_logprobs(samples))
    a, b = padded.train_step(samples, 0), packed.train_step(samples, 0)
    out["packed_vs_padded_grad_norm_rel"] = abs(a["train/grad_norm"] - b["train/grad_norm"]) / a["train/grad_norm"]
    out["packed_vs_padded_after_step"] = _maxdiff(padded.compute_logprobs(samples), packed.compute_logprobs(samples))

    # Under the TE spec the trainer decides the input layout itself (te -> packed THD); here the local model is
    # given TE's attention semantics and the trainer is told its spec is TE's.
    te = MegatronTrainer(job, pad_id=0, vocab_size=V)
    te.te = True
    te.packed, te.thd = True, True
    _te_attention_semantics(te.module)
    hf = build_model(job.model, V, seed=job.run.seed).eval()
    out["te_semantics_vs_hf_logprobs"] = _maxdiff(te.compute_logprobs(samples), _hf_logprobs(hf, samples))
    out["te_semantics_train_step_grad_norm"] = te.train_step(samples, 0)["train/grad_norm"]
    return out


# ---- extra: MoE logits, bf16, SFT warm-up -----------------------------------------------------------------------
def _sglang_export_names(tr: Any, job: Any) -> dict[str, Any]:
    """Issue 30, fault 8: for a job whose engine is SGLang the trainer's own export (no layout asked for) names the
    experts one by one, as tests/test_moe_names.py shows SGLang's model classes load them."""
    from dataclasses import replace

    from milehpc.models import moe_names

    stacked = list(tr.export_weights(moe_layout="transformers"))
    tr.job = replace(job, rollout=replace(job.rollout, engine="sglang"))
    try:
        default = [n for n, _ in tr.export_weights()]
    finally:
        tr.job = job
    want = [n for name, t in stacked for n, _ in moe_names(name, t, tr.arch.model_type, "checkpoint")]
    return {"stacked_left": [n for n in default if n.endswith(("experts.gate_up_proj", "experts.down_proj"))],
            "as_sglang_loads": sorted(default) == sorted(want)}


def check_extra() -> dict[str, Any]:
    from milehpc.models import build_model
    from milehpc.train.megatron.trainer import MegatronTrainer

    out: dict[str, Any] = {}
    samples = _samples(13, n=6)
    import torch
    import transformers

    mixtral = transformers.MixtralConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=32, num_local_experts=4,
                                         num_experts_per_tok=2)
    for kind, model in (("qwen2_moe", {"num_experts": 4, "moe_top_k": 2, "intermediate_size": 32}),
                        ("mixtral", None)):
        job = _job(model=model or {})
        if model is None:
            torch.manual_seed(2)
            hf = transformers.AutoModelForCausalLM.from_config(mixtral).eval()
            tr = MegatronTrainer(job, pad_id=0, vocab_size=V, hf_model=hf)
        else:
            tr = MegatronTrainer(job, pad_id=0, vocab_size=V)
            hf = build_model(job.model, V, seed=job.run.seed).eval()
        out[f"{kind}_model_type"] = tr.arch.model_type
        out[f"{kind}_vs_hf_logprobs"] = _maxdiff(tr.compute_logprobs(samples), _hf_logprobs(hf, samples))
        out[f"{kind}_sglang_export"] = _sglang_export_names(tr, job)

    job = _job(precision="bf16")
    tr = MegatronTrainer(job, pad_id=0, vocab_size=V)
    hf = build_model(job.model, V, seed=job.run.seed).eval()
    out["bf16_wrapper"] = type(tr.ddp.module).__name__
    out["bf16_param_dtype"] = str(next(tr.module.parameters()).dtype)
    out["bf16_vs_hf_fp32_logprobs"] = _maxdiff(tr.compute_logprobs(samples), _hf_logprobs(hf, samples))
    first = tr.train_step(samples, 0)
    out["bf16_grad_norm"] = first["train/grad_norm"]

    for dist_opt in (False, True):
        tr = MegatronTrainer(_job(distributed_optimizer=dist_opt), pad_id=0, vocab_size=V)
        opt = tr.sft_optimizer(3e-3)
        losses = [tr.sft_step(samples, opt)["sft/loss"] for _ in range(8)]
        out[f"sft_distopt{int(dist_opt)}_first_last"] = [losses[0], losses[-1]]
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    groups = sys.argv[2:] or ["te", "packed", "extra"]
    results: dict[str, Any] = {}
    for name in groups:
        try:
            results[name] = {"te": check_te, "packed": check_packed, "extra": check_extra}[name]()
        except Exception as err:  # each group reports on its own: one failure does not hide the others
            import traceback

            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

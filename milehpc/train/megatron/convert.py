"""Megatron-core <-> HF (transformers) names and layouts for the families of milehpc.config.families (Llama /
Mistral / Qwen2 / Qwen3 dense, Qwen2-MoE / Qwen3-MoE / Mixtral).

Megatron layout (the local and the transformer-engine layer specs differ only in the two pre-norms, see below):

* ``self_attention.linear_qkv``: Q, K and V fused and **interleaved per query group**: for each of the
  ``num_kv_heads`` groups, ``[q heads of the group (num_heads/num_kv_heads * head_dim rows), k (head_dim), v
  (head_dim)]``. TP splits whole groups, so the TP shards simply concatenate along dim 0.
* ``mlp.linear_fc1``: SwiGLU's gate and up fused as ``cat([gate, up])`` **per TP rank**: rank r holds
  ``[gate_r; up_r]``, so gathering takes the halves of every shard apart first.
* column-parallel (dim 0): word embeddings, output layer, qkv, fc1; row-parallel (dim 1): linear_proj, fc2;
  norms (Qwen3's per-head ``q_layernorm``/``k_layernorm`` too) and the MoE router are replicated.
* the transformer-engine spec fuses the pre-attention and pre-MLP RMSNorms into the following linear layer
  (``TELayerNormColumnParallelLinear``): ``self_attention.linear_qkv.layer_norm_weight`` and
  ``mlp.linear_fc1.layer_norm_weight`` instead of the local spec's ``input_layernorm.weight`` and
  ``pre_mlp_layernorm.weight`` (MoE layers keep a separate ``pre_mlp_layernorm``). The converter reads both
  spellings (:func:`local_name`) and writes either (``from_hf(..., fused_norms=True)`` for the TE spec).
* layers are numbered per pipeline stage (``decoder.layers.0..``); the converter works with global layer indices,
  the trainer renames (each PP stage exports its own layers, as slime does with one sync group per stage).

HF MoE layout: ``moe_layout="transformers"`` gives transformers 5's in-memory names (``mlp.gate``,
``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) which the reference engine loads;
``"checkpoint"`` gives the per-expert checkpoint names SGLang loads (Qwen2-MoE: ``mlp.experts.{e}.gate_proj/
up_proj/down_proj``; Mixtral: ``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1/w3/w2``;
:mod:`milehpc.models` names them for both trainers, and picks the layout from the rollout engine).
Qwen2-MoE's sigmoid-gated shared expert is Megatron's ``mlp.shared_experts`` with ``gate_weight``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from milehpc.models import checkpoint_expert_names, checkpoint_router_name

if TYPE_CHECKING:
    import torch

    from milehpc.train.megatron.model import Arch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

# Per-layer names that map one to one (Megatron suffix -> HF suffix).
_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    # Qwen3's per-head q/k RMSNorm ([head_dim]: every TP rank holds all of it, like the other norms)
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
# The transformer-engine spec's fused norms (TE LayerNormLinear's ``layer_norm_weight``) -> the local spec's name.
# megatron-core maps the same pairs in the local spec's ``sharded_state_dict_keys_map`` (checkpoints of one spec
# load into the other); tests/test_megatron_te_contract.py checks these against megatron-core.
_TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_FUSED_OF = {v: k for k, v in _TE_FUSED_NORMS.items()}
# Fused gate/up (SwiGLU fc1) -> the HF prefix of its gate_proj/up_proj.
_FC1 = {"mlp.linear_fc1.weight": "mlp.", "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert."}


def local_name(name: str) -> str:
    """A Megatron parameter name in the local spec's spelling (TE fused-norm names -> separate norm names)."""
    m = _LAYER.match(name)
    if m and m.group(2) in _TE_FUSED_NORMS:
        return f"decoder.layers.{m.group(1)}.{_TE_FUSED_NORMS[m.group(2)]}"
    return name


_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


# ---- TP layout ------------------------------------------------------------------------------------------------
def tp_dim(name: str) -> int | None:
    """The dim a Megatron parameter is split along over TP ranks (None = replicated)."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
                      "linear_fc1.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def _is_fc1(name: str) -> bool:
    return name.endswith("linear_fc1.weight")


def tp_split(name: str, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The TP shards of a full Megatron tensor (inverse of :func:`tp_gather`)."""
    import torch

    dim = tp_dim(name)
    if dim is None or tp == 1:
        return [full.clone() for _ in range(tp)]
    if _is_fc1(name):
        gate, up = full.chunk(2, dim=0)
        return [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0), strict=True)]
    return [s.clone() for s in full.chunk(tp, dim=dim)]


def tp_gather(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Join the TP shards of one Megatron tensor into the full tensor."""
    import torch

    dim = tp_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if _is_fc1(name):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


# ---- QKV -----------------------------------------------------------------------------------------------------
def qkv_to_hf(qkv: torch.Tensor, arch: Arch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused interleaved qkv ([groups * (q_per_group + 2) * head_dim, ...]) -> (q, k, v)."""
    g, d = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // g
    x = qkv.reshape(g, (per + 2) * d, *qkv.shape[1:])
    q, k, v = x.split([per * d, d, d], dim=1)
    rest = qkv.shape[1:]
    return q.reshape(g * per * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def qkv_from_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Arch) -> torch.Tensor:
    import torch

    g, d = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // g
    rest = q.shape[1:]
    x = torch.cat([q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return x.reshape(g * (per + 2) * d, *rest)


# ---- Megatron -> HF --------------------------------------------------------------------------------------------
def to_hf(named: Iterable[tuple[str, torch.Tensor]], arch: Arch, *, moe_layout: str = "transformers",
          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (TP-gathered) Megatron tensors with global layer indices -> HF names and layouts.

    MoE experts must come as ``mlp.experts.local_experts.{global expert}.*``; in the transformers layout the
    experts of a layer are stacked, so they are buffered until the layer has all of them.
    """
    import torch

    pending: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in named:
        if name in _TOP:
            if name == "output_layer.weight" and arch.tie_word_embeddings:
                continue
            yield _TOP[name], t if name == "decoder.final_layernorm.weight" else _trim_vocab(t, arch)
            continue
        m = _LAYER.match(name)
        if not m:
            raise KeyError(f"megatron->hf: unknown parameter {name!r}")
        layer, rest = int(m.group(1)), _TE_FUSED_NORMS.get(m.group(2), m.group(2))
        pre = f"model.layers.{layer}."
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), qkv_to_hf(t, arch), strict=True):
                yield f"{pre}self_attn.{proj}.{kind}", part
        elif rest in _FC1:
            gate, up = t.chunk(2, dim=0)
            yield f"{pre}{_FC1[rest]}gate_proj.weight", gate
            yield f"{pre}{_FC1[rest]}up_proj.weight", up
        elif rest == "mlp.router.weight" and moe_layout == "checkpoint":
            yield checkpoint_router_name(arch.model_type, pre), t
        elif rest in _SIMPLE:
            yield pre + _SIMPLE[rest], t
        elif em := _EXPERT.match(rest):
            e, which = int(em.group(1)), em.group(2)
            if moe_layout == "checkpoint":
                gate_name, up_name, down_name = checkpoint_expert_names(arch.model_type, pre, e)
                if which == "linear_fc1":
                    gate, up = t.chunk(2, dim=0)
                    yield gate_name, gate
                    yield up_name, up
                else:
                    yield down_name, t
                continue
            bucket = pending.setdefault((layer, which), {})
            bucket[e] = t
            if len(bucket) == arch.num_experts:
                stacked = torch.stack([bucket[i] for i in range(arch.num_experts)])
                hf = "gate_up_proj" if which == "linear_fc1" else "down_proj"
                yield f"{pre}mlp.experts.{hf}", stacked
                del pending[(layer, which)]
        else:
            raise KeyError(f"megatron->hf: unknown parameter {name!r}")
    if pending:
        raise ValueError(f"megatron->hf: incomplete experts for {sorted(pending)}")


def _trim_vocab(t: torch.Tensor, arch: Arch) -> torch.Tensor:
    return t[: arch.vocab_size] if t.shape[0] > arch.vocab_size else t


# ---- HF -> Megatron --------------------------------------------------------------------------------------------
def from_hf(hf: dict[str, torch.Tensor], arch: Arch, *, padded_vocab: int | None = None, fused_norms: bool = False,
            ) -> dict[str, torch.Tensor]:
    """A full HF state dict (transformers or checkpoint MoE layout) -> full Megatron tensors, global layer indices.
    ``fused_norms`` names the pre-norms as the transformer-engine spec does (``linear_qkv.layer_norm_weight``; dense
    MLPs also ``linear_fc1.layer_norm_weight``); the default is the local spec's names."""
    import torch

    out: dict[str, torch.Tensor] = {}

    def pad(t: torch.Tensor) -> torch.Tensor:
        if padded_vocab is None or padded_vocab == t.shape[0]:
            return t
        return torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])

    out["embedding.word_embeddings.weight"] = pad(hf["model.embed_tokens.weight"])
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not arch.tie_word_embeddings:
        out["output_layer.weight"] = pad(hf["lm_head.weight"])
    inv = {v: k for k, v in _SIMPLE.items()}
    for i in range(arch.num_layers):
        pre, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            if f"{pre}self_attn.q_proj.{kind}" in hf:
                q, k, v = (hf[f"{pre}self_attn.{p}.{kind}"] for p in ("q_proj", "k_proj", "v_proj"))
                out[f"{mp}self_attention.linear_qkv.{kind}"] = qkv_from_hf(q, k, v, arch)
        for hf_suffix, m_suffix in inv.items():
            if pre + hf_suffix in hf:
                out[mp + m_suffix] = hf[pre + hf_suffix]
        for m_suffix, hf_prefix in _FC1.items():
            if f"{pre}{hf_prefix}gate_proj.weight" in hf:
                out[mp + m_suffix] = torch.cat([hf[f"{pre}{hf_prefix}gate_proj.weight"],
                                                hf[f"{pre}{hf_prefix}up_proj.weight"]])
        if arch.is_moe:
            _experts_from_hf(hf, pre, mp, arch, out)
        if fused_norms:
            # MoE layers: TE fuses only the input norm (the router reads the normed input, so pre_mlp stays).
            for norm in ("input_layernorm.weight",) + (() if arch.is_moe else ("pre_mlp_layernorm.weight",)):
                out[mp + _FUSED_OF[norm]] = out.pop(mp + norm)
    return out


def _experts_from_hf(hf: dict[str, torch.Tensor], pre: str, mp: str, arch: Arch, out: dict[str, torch.Tensor],
                     ) -> None:
    import torch

    if f"{pre}mlp.experts.gate_up_proj" not in hf:  # checkpoint layout
        out[f"{mp}mlp.router.weight"] = hf[checkpoint_router_name(arch.model_type, pre)]
        for e in range(arch.num_experts):
            gate, up, down = checkpoint_expert_names(arch.model_type, pre, e)
            out[f"{mp}mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat([hf[gate], hf[up]])
            out[f"{mp}mlp.experts.local_experts.{e}.linear_fc2.weight"] = hf[down]
        return
    gate_up, down = hf[f"{pre}mlp.experts.gate_up_proj"], hf[f"{pre}mlp.experts.down_proj"]
    for e in range(arch.num_experts):
        out[f"{mp}mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
        out[f"{mp}mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]


# ---- per-rank views (PP stage, EP rank) ------------------------------------------------------------------------
def rename_layers(named: Iterable[tuple[str, torch.Tensor]], layer_offset: int = 0, expert_offset: int = 0,
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stage-local names -> global names (layer index + offset; local expert index + offset), or the inverse
    with negative offsets."""
    for name, t in named:
        m = _LAYER.match(name)
        if m:
            rest = m.group(2)
            em = _EXPERT.match(rest)
            if em:
                rest = f"mlp.experts.local_experts.{int(em.group(1)) + expert_offset}.{em.group(2)}.weight"
            name = f"decoder.layers.{int(m.group(1)) + layer_offset}.{rest}"
        yield name, t


def local_shard(full: dict[str, torch.Tensor], local_names: Iterable[str], *, tp: int, tp_rank: int,
                layer_offset: int, expert_offset: int = 0, expert_tp: int = 1) -> dict[str, torch.Tensor]:
    """What one rank (its PP stage, EP rank and TP rank) holds of the full Megatron tensors, by local name.
    Routed experts are split over ``expert_tp`` ranks (the trainer keeps them whole: 1).
    Names may be either spec's spelling on either side (:func:`local_name`)."""
    canonical = {local_name(k): k for k in full}
    out = {}
    for local in local_names:
        (global_name, _), = rename_layers([(local, None)], layer_offset, expert_offset)  # type: ignore[list-item]
        src = full[global_name] if global_name in full else full[canonical[local_name(global_name)]]
        if ".local_experts." in local:
            out[local] = tp_split(local, src, expert_tp)[tp_rank % expert_tp]
        else:
            out[local] = tp_split(local, src, tp)[tp_rank]
    return out


def load_hf_weights(module: Any, hf_state: dict[str, torch.Tensor], arch: Arch, *, tp: int, dtype: Any,
                    skip: tuple[str, ...] = ()) -> None:
    """Load a full HF state dict into this rank's shard of ``module`` (its PP stage, TP rank and experts); the
    parameters named in ``skip`` are the caller's to fill (a critic's value head)."""
    from megatron.core import parallel_state as ps

    from milehpc.train.megatron.model import expert_offset, layer_offset, padded_vocab_size

    full = from_hf(hf_state, arch, padded_vocab=padded_vocab_size(arch.vocab_size, tp))
    names = [n for n in module.state_dict() if not n.endswith("_extra_state") and n not in skip]
    shard = local_shard(full, names, tp=tp, tp_rank=ps.get_tensor_model_parallel_rank(),
                        layer_offset=layer_offset(module), expert_offset=expert_offset(arch))
    missing = module.load_state_dict({k: v.to(dtype) for k, v in shard.items()}, strict=False)
    bad = [k for k in missing.missing_keys if not k.endswith("_extra_state") and k not in skip]
    bad += list(missing.unexpected_keys)
    if bad:
        raise RuntimeError(f"megatron trainer: converted HF weights do not fit the model: {bad[:5]}")


def megatron_to_hf(named_tensors: Iterable[tuple[str, torch.Tensor | list[torch.Tensor]]], *, hf_config: Any = None,
                   arch: Arch | None = None, moe_layout: str = "transformers", tp: int = 1,
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The "megatron-to-hf" weight converter plugin: full Megatron tensors with global layer indices (or, for
    ``tp`` > 1, the list of a tensor's TP shards, gathered here) -> HF names and layouts. The model is given as an
    HF config or an :class:`~milehpc.train.megatron.model.Arch`."""
    from milehpc.train.megatron.model import arch_of

    if arch is None:
        if hf_config is None:
            raise ValueError("megatron-to-hf needs the model: hf_config= or arch=")
        arch = arch_of(hf_config)
    named = ((n, tp_gather(n, list(t)) if isinstance(t, list | tuple) else t) for n, t in named_tensors)
    yield from to_hf(named, arch, moe_layout=moe_layout)

"""Megatron-core GPTModel for the families of milehpc.config.families (Qwen2/2.5, Qwen3, Llama 2/3.x, Mistral;
MoE: Qwen2-MoE, Qwen3-MoE, Mixtral).

The HF config is the single source of truth for the architecture (what the rollout engine builds from the same
job spec or loads from the same checkpoint folder); :func:`transformer_config` maps it onto Megatron's
TransformerConfig: RMSNorm, RoPE (theta from the HF config; Llama 3.x's "llama3" frequency scaling), SwiGLU
(``gated_linear_unit``), GQA (``num_query_groups``), Qwen2's QKV bias, Qwen3's per-head q/k RMSNorm
(``qk_layernorm``), tied embeddings, and for MoE a softmax top-k router that renormalises over the chosen experts
(Mixtral's rule) or not (Qwen's default) with routing replay available.

Layer spec: the local (pure megatron-core) spec on CPU; the transformer-engine spec on GPUs when the job asks
for it (``trainer.precision`` bf16/fp8 or ``trainer.options.transformer_engine = true``) and TE imports there; bf16
on a GPU without TE (ROCm) takes the local spec, fp8 refuses in one line (:func:`te_spec_choice`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError, missing_dependency

if TYPE_CHECKING:
    import torch

    from milehpc.config.job import ModelSpec, TrainerSpec


@dataclass(frozen=True)
class Arch:
    """What the converters and the model builder need to know about an HF config."""

    model_type: str  # a key of milehpc.config.families.FAMILIES
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    num_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate_size: int = 0
    shared_expert_size: int = 0  # Qwen2-MoE: a sigmoid-gated shared expert next to the routed ones
    moe_norm_topk: bool = True  # renormalise the top-k probabilities (Mixtral) or not (Qwen2-MoE default)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k (weights [head_dim], replicated over TP)
    # Llama 3.x "llama3" RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_llama3: tuple[float, float, float, int] | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _rope(hf_config: Any) -> tuple[float, tuple[float, float, float, int] | None]:
    """(theta, llama3 scaling or None) of an HF config; any other rope_type is refused in one line."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    theta = float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                       int(rope["original_max_position_embeddings"]))
    raise ConfigError(f"megatron trainer: expected rope_type 'default' or 'llama3' in config.json, got {kind!r}",
                      field="model.path")


def arch_of(hf_config: Any) -> Arch:
    """Read the HF (transformers) config of a supported family (milehpc.config.families)."""
    from milehpc.config.families import check_family, check_megatron_family

    mt = hf_config.model_type
    fam = check_family(mt)
    check_megatron_family(mt)
    theta, llama3 = _rope(hf_config)
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and getattr(hf_config, "use_sliding_window", True) and \
            window < hf_config.max_position_embeddings:
        raise ConfigError(f"megatron trainer: expected no sliding window shorter than max_position_embeddings "
                          f"({hf_config.max_position_embeddings}) in a {mt} config.json, got sliding_window = "
                          f"{window}", field="model.path")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    experts = int(getattr(hf_config, "num_local_experts" if mt == "mixtral" else "num_experts", 0) or 0) \
        if fam.moe else 0
    if mt in ("qwen2_moe", "qwen3_moe") and (hf_config.mlp_only_layers or hf_config.decoder_sparse_step != 1):
        raise ConfigError(f"megatron trainer: expected every layer an MoE layer in a {mt} config.json, got "
                          f"mlp_only_layers = {hf_config.mlp_only_layers}, decoder_sparse_step = "
                          f"{hf_config.decoder_sparse_step}", field="model.path")
    return Arch(
        model_type=mt,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta,
        max_position_embeddings=hf_config.max_position_embeddings,
        qkv_bias=mt in ("qwen2", "qwen2_moe") or bool(getattr(hf_config, "attention_bias", False)),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        num_experts=experts,
        moe_top_k=getattr(hf_config, "num_experts_per_tok", 0) if experts else 0,
        moe_intermediate_size=getattr(hf_config, "moe_intermediate_size", hf_config.intermediate_size) if experts
        else 0,
        shared_expert_size=(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if mt == "qwen2_moe" else 0,
        moe_norm_topk=bool(getattr(hf_config, "norm_topk_prob", True)) if mt != "mixtral" else True,
        qk_norm=fam.qk_norm,
        rope_llama3=llama3,
    )


def hf_config_for(model: ModelSpec, vocab_size: int, *, pad_id: int = 0, eos_id: int = 2) -> Any:
    """The HF config of a job's model: the checkpoint's config.json, or the one the loop's model builder
    (milehpc.models) makes from the job spec's table, so trainer and rollout engine agree on every constant."""
    if model.path:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model.path, local_files_only=True)
    from milehpc.models import hf_config

    return hf_config(model, vocab_size, pad_id=pad_id, eos_id=eos_id)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Megatron splits the vocabulary over TP ranks; pad to a multiple of tp (rows beyond the HF vocab are masked)."""
    return -(-vocab_size // tp) * tp


def transformer_config(
    arch: Arch,
    trainer: TrainerSpec,
    *,
    routing_replay: bool = False,
    use_cpu_initialization: bool = True,
) -> Any:
    """Megatron's TransformerConfig for ``arch`` with the job's parallel sizes, precision and options."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    opts = trainer.options
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}[trainer.precision]
    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=trainer.tp,
        pipeline_model_parallel_size=trainer.pp,
        expert_model_parallel_size=trainer.ep,
        use_cpu_initialization=use_cpu_initialization,
        params_dtype=dtype,
        bf16=trainer.precision in ("bf16", "fp8"),
        pipeline_dtype=dtype,
        init_method_std=float(opts.get("init_std", 0.02)),
    )
    # Issue 33 item 3: activation recomputation (full: every layer's input kept, the layer recomputed in backward;
    # selective: the core attention alone, Megatron's default module) and sequence parallelism over the TP group.
    if trainer.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif trainer.recompute == "selective":
        kw.update(recompute_granularity="selective")
    if trainer.sequence_parallel:
        kw.update(sequence_parallel=True)
    if trainer.vpp > 1:  # interleaved 1F1B over the PP rank's model chunks (milehpc.train.megatron.chunks)
        # Unbatched p2p: with the chunks' ring, a PP rank's previous and next ranks can be the same one (PP = 2), and
        # a batch of isend/irecv to one peer pairs by posting order, which mixed activations and gradients on gloo
        # (measured: M > PP micro-batches gave wrong gradients); the unbatched ops order sends and receives by rank
        # parity, over two groups when PP = 2.
        kw.update(virtual_pipeline_model_parallel_size=trainer.vpp, batch_p2p_comm=False)
    if trainer.precision == "fp8":
        from milehpc.config.precision import megatron_fp8_format

        kw.update(fp8=megatron_fp8_format(trainer.fp8_recipe), fp8_recipe=trainer.fp8_recipe)
    if arch.is_moe:
        kw.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_top_k,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            # Renormalised (Mixtral): top-k on logits, softmax over the k. Not renormalised (Qwen2-MoE): softmax
            # over all experts, then top-k of those probabilities.
            moe_router_pre_softmax=not arch.moe_norm_topk,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type=str(opts.get("moe_load_balancing", "none")),
            moe_aux_loss_coeff=float(opts.get("moe_aux_loss_coeff", 0.0)),
            # alltoall needs CUDA streams; allgather runs on CPU (and is fine at small EP).
            moe_token_dispatcher_type=str(opts.get("moe_dispatcher") or ("alltoall" if torch.cuda.is_available()
                                                                         else "allgather")),
            moe_grouped_gemm=False,
            moe_enable_routing_replay=routing_replay,
        )
        if arch.shared_expert_size:
            kw.update(moe_shared_expert_intermediate_size=arch.shared_expert_size, moe_shared_expert_gate=True)
    return TransformerConfig(**kw)


def te_spec_choice(trainer: TrainerSpec, *, cuda: bool, have_te: bool) -> bool:
    """Whether the job's model takes the transformer-engine layer spec, from what this node has: ``cuda`` (a GPU)
    and ``have_te`` (megatron-core's own ``HAVE_TE``: transformer-engine and its Megatron extension import).

    Never on CPU, where TE cannot run, nor with LoRA (its adapters need the local spec's separate input norms,
    :mod:`milehpc.train.megatron.lora`). bf16 takes TE where it imports and the local spec where it does not (a
    GPU without TE, ROCm included: megatron-core 0.16.1's ``get_gpt_layer_with_transformer_engine_spec`` builds
    ``TESpecProvider()``, a NameError without TE). fp8, or ``transformer_engine = true``, needs TE: one line."""
    if not cuda or trainer.lora is not None:
        return False
    asked = trainer.options.get("transformer_engine")
    wanted = bool(trainer.precision in ("bf16", "fp8") if asked is None else asked)
    if wanted and not have_te:
        if trainer.precision == "fp8" or asked:  # FP8 GEMMs are TE's; asked for by name: no silent fallback
            what = "trainer.precision = 'fp8'" if trainer.precision == "fp8" else \
                "trainer.options.transformer_engine = true"
            raise missing_dependency(f"{what} (megatron-core's transformer-engine layer spec)", "transformer-engine")
        return False
    return wanted


def use_transformer_engine(trainer: TrainerSpec) -> bool:
    """:func:`te_spec_choice` on this node (inside the job: imports torch and megatron-core)."""
    import torch

    cuda = torch.cuda.is_available()
    have_te = False
    if cuda:
        from megatron.core.models.gpt import gpt_layer_specs

        have_te = bool(gpt_layer_specs.HAVE_TE)  # the condition its TE spec depends on, read from megatron itself
    return te_spec_choice(trainer, cuda=cuda, have_te=have_te)


class SequenceParallelRMSNorm:
    """torch's RMSNorm for the local spec under sequence parallelism, where megatron-core's ``WrappedTorchNorm`` refuses
    (``assert not config.sequence_parallel``; Apex's and TE's norms are what it expects). A norm is per token, so a rank
    normalising its slice of the sequence computes exactly its part; its weight then sees only that slice's gradient,
    and the ``sequence_parallel`` mark makes ``finalize_model_grads`` sum it over the TP group (what TE's and Apex's
    norms mark)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> Any:
        import torch

        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def layer_spec(arch: Arch, *, te: bool, sequence_parallel: bool = False) -> Any:
    if te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=arch.num_experts or None,
                                                          qk_layernorm=arch.qk_norm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=arch.num_experts or None, normalization="RMSNorm",
                                    qk_layernorm=arch.qk_norm)
    if sequence_parallel:
        sub = spec.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = SequenceParallelRMSNorm
        if arch.qk_norm:
            attn = sub.self_attention.submodules
            attn.q_layernorm = attn.k_layernorm = SequenceParallelRMSNorm
    return spec


def block_spec(arch: Arch, config: Any, *, te: bool, vp_stage: int | None = None) -> Any:
    """The transformer layer spec, or under sequence parallelism on the local spec the whole block's (its final norm
    too is :class:`SequenceParallelRMSNorm`) for virtual stage ``vp_stage``."""
    spec = layer_spec(arch, te=te, sequence_parallel=bool(config.sequence_parallel))
    if te or not config.sequence_parallel:
        return spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=SequenceParallelRMSNorm)


def build_gpt(arch: Arch, config: Any, *, tp: int, te: bool = False, pre_process: bool | None = None,
              post_process: bool | None = None, share_embeddings: bool | None = None, keep_rng: bool = False,
              vp_stage: int | None = None) -> Any:
    """This pipeline stage's GPTModel (parallel_state must be initialised). Logits stay vocab-parallel.
    ``share_embeddings`` defaults to the HF config's tied embeddings; ``keep_rng`` leaves the process's and
    Megatron's RNG streams as they were (a second model built after the policy, whose weights are loaded anyway,
    must not change what the policy's run draws next). ``vp_stage``: the model chunk of that virtual stage
    (``trainer.vpp``), with the first/last stage's ends only where the virtual stage is the first/last."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if keep_rng:
        import torch
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker()
        states = dict(tracker.get_states())
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            model = build_gpt(arch, config, tp=tp, te=te, pre_process=pre_process, post_process=post_process,
                              share_embeddings=share_embeddings, vp_stage=vp_stage)
        if states:
            tracker.set_states(states)
        return model
    if arch.is_moe and config.moe_enable_routing_replay:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()  # the registry is per process; one model per trainer
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(arch, config, te=te, vp_stage=vp_stage),
        vocab_size=padded_vocab_size(arch.vocab_size, tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        if pre_process is None else pre_process,
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        if post_process is None else post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings if share_embeddings is None else share_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rope_theta,
        vp_stage=vp_stage,
    )
    if arch.rope_llama3 is not None:
        # GPTModel's own rope_scaling passes only the factor (low/high 1/4, original context 8192 fixed); the same
        # megatron-core formula (HF's _compute_llama3_parameters) with all four of the config's values.
        factor, low, high, original = arch.rope_llama3
        rope = model.rotary_pos_emb
        rope.inv_freq = rope._apply_scaling(rope.inv_freq, factor=factor, low_freq_factor=low, high_freq_factor=high,
                                            original_max_position_embeddings=original)
    return model


def layer_offset(module: Any) -> int:
    """The global index of this pipeline stage's first layer of ``module`` (a GPTModel)."""
    layers = module.decoder.layers
    return int(layers[0].layer_number) - 1 if len(layers) else 0


def expert_offset(arch: Arch) -> int:
    """The global index of this expert-parallel rank's first routed expert (0 for a dense model)."""
    if not arch.is_moe:
        return 0
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank() * (arch.num_experts // ps.get_expert_model_parallel_world_size())


def freeze(module: Any, config: Any) -> Any:
    """A frozen, forward-only model (a KL reference, a teacher): no gradients, eval mode, bf16 wrapped as the
    policy is."""
    module.requires_grad_(False).eval()
    if config.bf16:
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(config, module)
    return module


def attention_mask(valid: torch.Tensor) -> torch.Tensor:
    """Causal + key-padding mask in Megatron's convention: bool [B, 1, T, T], True = masked out.

    ``valid`` is [B, T] (1 for real tokens). Padded query rows keep their diagonal so no row is fully masked.
    """
    import torch

    t = valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()
    allowed = causal[None] & valid.bool()[:, None, :]
    allowed |= torch.eye(t, dtype=torch.bool, device=valid.device)[None]
    return (~allowed)[:, None]

"""HF-architecture models for the reference engine and trainer: a tiny Qwen2/Llama built from the job's
``[model]`` table (random init, seeded) or a checkpoint loaded from a local folder. No downloads."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from milehpc.config.job import ModelSpec


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
            "float16": torch.float16}[name]


# (config class, causal LM class, token-classification class) per family. Importing the model modules directly
# skips transformers' lazy top-level namespace, whose first touch scans every model it ships (seconds).
_FAMILIES = {
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2Config", "Qwen2ForCausalLM",
              "Qwen2ForTokenClassification"),
    "llama": ("transformers.models.llama.modeling_llama", "LlamaConfig", "LlamaForCausalLM",
              "LlamaForTokenClassification"),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  "Qwen2MoeForTokenClassification"),
}


def _family(name: str) -> tuple[Any, Any, Any]:
    import importlib

    module, *names = _FAMILIES[name]
    mod = importlib.import_module(module)
    config_mod = importlib.import_module(module.replace("modeling_", "configuration_"))
    return getattr(config_mod, names[0]), getattr(mod, names[1]), getattr(mod, names[2])


def hf_config(spec: ModelSpec, vocab_size: int, *, pad_id: int = 0, eos_id: int = 2) -> Any:
    """The HF config for ``spec`` (Qwen2 or Llama shapes; MoE via Qwen2-MoE when ``num_experts > 0``)."""

    common = dict(
        vocab_size=spec.vocab_size or vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, pad_token_id=pad_id, eos_token_id=eos_id,
        bos_token_id=None, attn_implementation="sdpa",
    )
    if (spec.vocab_size or vocab_size) < vocab_size:
        raise ConfigError(f"expected vocab_size >= the tokenizer's {vocab_size}, got {spec.vocab_size}",
                          field="model.vocab_size")
    if spec.num_experts > 0:  # a Qwen2-MoE: the job rules refuse another arch on the login node
        return _family("qwen2_moe")[0](**common, num_experts=spec.num_experts, num_experts_per_tok=spec.moe_top_k,
                                       moe_intermediate_size=spec.intermediate_size,
                                       shared_expert_intermediate_size=spec.intermediate_size)
    return _family(spec.arch)[0](**common)


def causal_lm_class(spec: ModelSpec) -> type:
    """The transformers causal-LM class of ``spec``'s family (its name is what an HF config's ``architectures``
    lists)."""
    return _family("qwen2_moe" if spec.num_experts > 0 else spec.arch)[1]


def build_model(spec: ModelSpec, vocab_size: int, *, seed: int = 0, pad_id: int = 0, eos_id: int = 2,
                value_head: bool = False) -> torch.nn.Module:
    """A causal LM (or, with ``value_head``, a per-token scalar critic) from ``spec``.

    Random init is seeded so every rank that builds the model gets identical weights.
    """
    import torch

    dtype = torch_dtype(spec.dtype)
    if spec.path:
        import transformers as tf

        path = Path(spec.path)
        if not path.is_dir():
            raise ConfigError(f"expected a local HF checkpoint folder, got {spec.path!r}", field="model.path")
        if value_head:
            # The checkpoint has no value head: its fresh init is seeded, so every trainer rank (and both
            # trainers) start the critic from the same head.
            config = tf.AutoConfig.from_pretrained(path, local_files_only=True, num_labels=1)
            config.classifier_dropout = 0.0  # as below (a keyword here would not reach the config)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = tf.AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype,
                                                                          local_files_only=True)
        else:
            model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        return model
    config = hf_config(spec, vocab_size, pad_id=pad_id, eos_id=eos_id)
    causal_lm, token_cls = causal_lm_class(spec), _family("qwen2_moe" if spec.num_experts > 0 else spec.arch)[2]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if value_head:
            config.num_labels = 1
            # No dropout before the value head (transformers defaults to 0.1; verl's critic sets 0): values must
            # not depend on the random stream, in the advantages' pass or in the loss's.
            config.classifier_dropout = 0.0
            model = token_cls(config)
        else:
            model = causal_lm(config)
    return model.to(dtype)


def save_model(model: Any, path: str | Path) -> None:
    """Write an HF folder that ``model.path`` can load."""
    model.save_pretrained(str(path))

"""Tiny random HF models of every supported family (milehpc.config.families), built with transformers (no
downloads): GQA everywhere, each family's own twist on. Shared by tests/test_model_families.py, its one-process
Megatron script (tests/model_family_checks.py) and the TP=2 x PP=2 case of tests/megatron_checks.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 48, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
# Llama 3.x frequency scaling with a short original context, so that the 16 frequencies of a 16-wide head fall in
# all three of its bands (kept, interpolated, divided by the factor).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}

# family -> extra config keys (on top of SHAPE)
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": {"tie_word_embeddings": True},  # QKV bias; tied embeddings
    "qwen3": {"head_dim": 32},  # q/k RMSNorm; head_dim != hidden / heads as in the real Qwen3 sizes
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": True},
    "llama": {"rope_parameters": LLAMA3_ROPE},  # Llama 3.x
    "mistral": {"sliding_window": None},
    "glm4": {"head_dim": 16},  # QKV bias, fused gate_up_proj, post-attention/post-MLP norms, half-width RoPE
}


def tiny_config(kind: str, vocab_size: int, **extra: Any) -> Any:
    import transformers

    from milehpc.config.families import FAMILIES

    cls = getattr(transformers, FAMILIES[kind].config_class)
    return cls(vocab_size=vocab_size, pad_token_id=0, eos_token_id=2, bos_token_id=None,
               **{**SHAPE, **FAMILY_CONFIGS[kind], **extra})


def tiny_model(kind: str, vocab_size: int, *, seed: int = 0, **extra: Any) -> Any:
    """A random model of ``kind``; weights drawn N(0, 0.1) (norms around 1) so that a misplaced row shows."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, vocab_size, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


def save_tiny(kind: str, folder: str | Path, vocab_size: int, *, seed: int = 0, **extra: Any) -> Any:
    """``tiny_model`` saved as a local HF folder (what ``model.path`` loads); returns the model."""
    model = tiny_model(kind, vocab_size, seed=seed, **extra)
    model.save_pretrained(str(folder))
    return model

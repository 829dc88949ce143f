"""The vision tower's size from a vision-language ``config.json`` alone (login-safe: no torch, no transformers), for
the memory estimate (:mod:`milehpc.memory`); the models themselves are :mod:`milehpc.models_vl`'s."""

from __future__ import annotations

from typing import Any


def vision_tower_tensors(config: dict[str, Any]) -> list[int]:
    """Element counts of the vision tower's parameter tensors a VL ``config.json`` (``config``) describes, as
    transformers builds them (login-safe: from the numbers alone). Qwen2.5-VL: RMSNorms and a gated MLP per block,
    a patch embedding without bias; Qwen3-VL: LayerNorms and a plain MLP per block, a biased patch embedding, a
    learned position grid, and a merger per deepstack layer besides the final one (its norm over the merged patch)."""
    v = config.get("vision_config") or {}
    qwen3 = str(config.get("model_type", "")).startswith("qwen3_vl")
    h, i = int(v.get("hidden_size", 1152 if qwen3 else 1280)), int(v.get("intermediate_size", 4304 if qwen3 else 3420))
    merged, out = h * int(v.get("spatial_merge_size", 2)) ** 2, int(v.get("out_hidden_size", 3584))
    patch = int(v.get("in_channels", 3)) * int(v.get("temporal_patch_size", 2)) * int(
        v.get("patch_size", 16 if qwen3 else 14)) ** 2
    norm = [h, h] if qwen3 else [h]  # LayerNorm's weight and bias, or RMSNorm's weight
    mlp = [h * i, i, i * h, h] if qwen3 else [h * i, i, h * i, i, i * h, h]  # (gate,) up, down with biases
    block = norm * 2 + [3 * h * h, 3 * h, h * h, h] + mlp  # the norms, qkv and the output projection

    def merger(norm_width: int) -> list[int]:
        return [norm_width] * (2 if qwen3 else 1) + [merged * merged, merged, out * merged, out]

    ends = [patch * h] + ([h, int(v.get("num_position_embeddings", 2304)) * h] if qwen3 else [])
    ends += merger(h)
    if qwen3:  # the deepstack mergers normalise the merged patch
        ends += merger(merged) * len(v.get("deepstack_visual_indexes", (8, 16, 24)))
    return block * int(v.get("depth", 27 if qwen3 else 32)) + ends

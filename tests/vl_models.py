"""Tiny random Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE models with their processor, built in code (no downloads): a
byte-level BPE tokenizer with Qwen's vision special tokens and a chat template that renders image parts, a PIL
image processor with 4-pixel patches, and a 2-block vision tower in front of a 2-layer LM, saved as a local folder
that ``AutoProcessor`` and ``AutoModelForImageTextToText`` load. Qwen3-VL's tower also hands deepstack features
(both its blocks') to both LM layers.

``patch=SGLANG_PATCH`` builds the same model with the real family's 14-pixel patches, the only size SGLang serves
(sglang 0.5.23 ``srt/models/qwen2_5_vl.py`` ``get_image_feature``: patch rows that are not ``raw_patch_dim = 1176``
= 3 x 2 x 14 x 14 wide are taken for precomputed features, not pixels)."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

# Qwen's vision tokens (names as in Qwen2.5-VL's tokenizer; the ids are this tiny tokenizer's own)
VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION]
# ChatML with Qwen-VL's image parts: {"type": "image"} -> <|vision_start|><|image_pad|><|vision_end|>, which the
# processor widens to one <|image_pad|> per merged patch.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
IMAGE_SIZE = 16  # pixels a side of the example's images: 4 x 4 patches of 4 pixels -> 2 x 2 = 4 image tokens
PATCH, MERGE = 4, 2
SGLANG_PATCH = 14
# Images are resized to SIDE[patch] pixels a side: 4 x 4 patches (4 image tokens) at the example's patch; 8 x 8 at
# SGLang's (16 image tokens, so that its windows of 2 x 2 merged patches are 4 windows, not the whole image).
SIDE = {PATCH: IMAGE_SIZE, SGLANG_PATCH: 8 * SGLANG_PATCH}
TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        # mrope over a 16-wide head: 8 frequencies split (t, h, w) = (2, 3, 3)
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
VISION_CFG = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": PATCH,
              "spatial_merge_size": MERGE, "temporal_patch_size": 2, "out_hidden_size": 64}
# What each family adds: Qwen2.5-VL's windowed attention; Qwen3-VL's interleaved mrope (8 frequencies: t takes
# 4, h and w 2 each), a 4 x 4 learned position grid resampled to each image, and deepstack features of both blocks.
QWEN3_TEXT = {**TEXT, "head_dim": 16,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                  "mrope_interleaved": True}}
FAMILY = {
    "qwen2_5_vl": ("Qwen2_5_VL", TEXT, {**VISION_CFG, "window_size": 16, "fullatt_block_indexes": [1]}),
    "qwen3_vl": ("Qwen3VL", QWEN3_TEXT, {**VISION_CFG, "num_position_embeddings": 16,
                                         "deepstack_visual_indexes": [0, 1]}),
    "qwen3_vl_moe": ("Qwen3VLMoe", {**QWEN3_TEXT, "num_experts": 4, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 32, "decoder_sparse_step": 1},
                     {**VISION_CFG, "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]}),
}


def build_tokenizer(out: Path) -> Any:
    """A small BPE tokenizer over digits, letters and punctuation with Qwen-VL's specials (saved to ``out``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [string.digits, string.ascii_letters, "what digit is drawn? the answer is", string.punctuation]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_processor(out: Path, family: str = "qwen2_5_vl", patch: int = PATCH) -> Any:
    """Image processor + tokenizer as one processor folder of ``family`` (``AutoProcessor`` loads it)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = build_tokenizer(out)
    area = SIDE[patch] * SIDE[patch]
    images = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=MERGE, temporal_patch_size=2,
                                      min_pixels=area, max_pixels=area)
    # The processor class requires a video processor (videos are not used here).
    videos = Qwen2VLVideoProcessor(patch_size=patch, merge_size=MERGE, temporal_patch_size=2)
    # Qwen3-VL-MoE ships no processor of its own: its checkpoints name Qwen3-VL's.
    name = "Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen3VLProcessor"
    proc = getattr(transformers, name)(image_processor=images, tokenizer=tok, video_processor=videos,
                                       chat_template=CHAT_TEMPLATE)
    proc.save_pretrained(out)
    return proc


def tiny_vl_config(tokenizer: Any, family: str = "qwen2_5_vl", patch: int = PATCH, **text: Any) -> Any:
    import transformers

    prefix, text_base, vision = FAMILY[family]
    if patch != PATCH:  # Qwen2.5-VL's windows stay 2 x 2 merged patches wide (window_size is in pixels)
        vision = {**vision, "patch_size": patch,
                  **({"window_size": vision["window_size"] * patch // PATCH} if "window_size" in vision else {})}
    ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION, strict=True)}
    text_cfg = {**text_base, **text, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None}
    return getattr(transformers, f"{prefix}Config")(text_config=text_cfg, vision_config=vision, **ids)


def save_tiny_vl(folder: str | Path, *, family: str = "qwen2_5_vl", seed: int = 0, patch: int = PATCH,
                 **text: Any) -> Any:
    """A random tiny model of ``family`` (a key of FAMILY) with ``patch``-pixel patches (a key of SIDE) and its
    processor saved in ``folder`` (what ``model.path`` and ``model.tokenizer`` load); returns the model."""
    import torch
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    proc = build_processor(folder, family, patch)
    torch.manual_seed(seed)
    cls = getattr(transformers, f"{FAMILY[family][0]}ForConditionalGeneration")
    model = cls(tiny_vl_config(proc.tokenizer, family, patch, **text)).eval()
    # N(0, 0.1) weights (norms around 1), as tests/family_models.py: transformers' 0.02 init leaves attention near
    # uniform, where a wrong position or a misplaced image feature hardly changes a logprob.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name and name.endswith(".weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return model

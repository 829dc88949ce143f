"""Vision-language models (milehpc.config.families.VISION_FAMILIES: Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) for the
reference engine and the torch trainer: the model from a local folder and the extra inputs a forward over image
prompts takes (the processor side, prompt tokenisation and pixels, is :mod:`milehpc.data.images`).

Both the engine and the trainer feed a VL model the same way (:func:`vision_inputs`): the pixels of every row's
images (:func:`milehpc.data.images.rows_pixels`) with their patch grids, and 3-D (temporal, height, width)
rotary positions from the model's own ``get_rope_index``. After the prompt every position is text, one more in all
three dimensions per token, so the engine continues from the prompt's last position + 1 and the trainer's
positions over prompt + response are the same numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def is_vision_model(model: Any) -> bool:
    """A model that takes images (its config has a vision tower)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


# The keyword that carries Qwen3-VL's deepstack inputs (image places, per-layer features) through the model's
# forward to its language model: the forward names ``visual_pos_masks`` itself (None without pixels), so they
# cannot be passed under their own names; its ``**kwargs`` reach the language model, where a hook unpacks them.
DEEPSTACK_KW = "milehpc_deepstack"


def load_vl_model(path: str | Path, dtype: torch.dtype) -> Any:
    """The image-text-to-text model of a local folder (transformers' class for its ``model_type``)."""
    import transformers as tf

    return tf.AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype, local_files_only=True)


def _unpack_deepstack(_module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    carried = kwargs.pop(DEEPSTACK_KW, None)
    if carried is not None:
        kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"] = carried
    return args, kwargs


def vision_inputs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  pixels: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, Any]:
    """Keyword inputs of a forward over ``input_ids`` ([B, T]) whose row ``i`` shows the images ``pixels[i]``
    (each its patch rows and grid, :func:`milehpc.data.images.pixels`): ``inputs_embeds`` with the images' features
    in the row's first image placeholders and ``position_ids`` [3, B, T] (pass ``input_ids=None``).

    Only the prompt's placeholders take features: a response may sample the placeholder token too, which
    transformers' own forward would count as an image place (and refuse the mismatch)."""
    import torch

    core = model.model if hasattr(model, "model") else model
    merge = int(model.config.vision_config.spatial_merge_size) ** 2
    flat = [p for row in pixels for p in row]
    is_image = input_ids == int(model.config.image_token_id)
    places = torch.tensor([sum(int(g.prod()) // merge for _, g in row) for row in pixels], device=input_ids.device)
    types = (is_image & (is_image.cumsum(-1) <= places[:, None])).to(torch.int)
    embeds = model.get_input_embeddings()(input_ids)
    if not flat:  # text rows only: plain positions in all three dimensions
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return {"inputs_embeds": embeds, "position_ids": pos[None].expand(3, -1, -1)}
    grid = torch.stack([g for _, g in flat]).to(input_ids.device)
    out = core.get_image_features(torch.cat([p for p, _ in flat]).to(input_ids.device), grid, return_dict=True)
    places = types.bool()
    embeds = embeds.masked_scatter(places[..., None], torch.cat(list(out.pooler_output)).to(embeds.dtype))
    position_ids, _ = core.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grid,
                                          attention_mask=attention_mask)
    kw = {"inputs_embeds": embeds, "position_ids": position_ids}
    deepstack = getattr(out, "deepstack_features", None)
    if deepstack:  # Qwen3-VL: features of early vision blocks, added to the first LM layers' outputs at the image
        # places, as its own forward does (DEEPSTACK_KW: how they reach the language model)
        kw[DEEPSTACK_KW] = (places, [torch.cat(list(f)).to(embeds.dtype) for f in deepstack])
        if not getattr(core.language_model, "_milehpc_deepstack", False):  # once per model, however it was built
            core.language_model.register_forward_pre_hook(_unpack_deepstack, with_kwargs=True)
            core.language_model._milehpc_deepstack = True
    return kw


def vision_parameter(name: str) -> bool:
    """Whether a parameter (HF name) belongs to the vision tower (what ``model.freeze_vision`` freezes and the
    weight sync then leaves out)."""
    return name.startswith(("model.visual.", "visual."))

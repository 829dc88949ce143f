"""The model families milehpc trains and serves end to end: the ONE list every layer reads (login-side rules,
the HF model builder, the Megatron converters). Login-safe: stdlib only; transformers is named, never imported.

A local checkpoint folder names its family in ``config.json`` (``model_type``); ``[model].arch`` names the family
of a random model built from the ``[model]`` table (an MoE table builds the family's MoE sibling).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from milehpc.errors import ConfigError


@dataclass(frozen=True)
class Family:
    """One HF family: where transformers keeps it and what its attention and MLP look like."""

    module: str  # transformers.models.<x>.modeling_<x>
    config_class: str
    causal_lm: str
    token_classification: str
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    moe: bool = False
    moe_of: str | None = None  # the MoE family a random [model] table with num_experts > 0 builds
    # What the Megatron converters and layer spec can express. GLM-4's extra post-attention and post-MLP norms are
    # not in megatron-core's TransformerLayer: the torch trainer (and the engines) run it through transformers.
    megatron: bool = True
    vision: bool = False  # a vision-language model (milehpc.models_vl): images in the prompts



def _tf(name: str, prefix: str, **kw: object) -> Family:
    return Family(f"transformers.models.{name}.modeling_{name}", f"{prefix}Config", f"{prefix}ForCausalLM",
                  f"{prefix}ForTokenClassification", **kw)  # type: ignore[arg-type]


# model_type -> family. Llama covers Llama 2 and 3.x (rope_type "llama3" scaling); Mistral without a sliding
# window shorter than its context (Megatron's local attention has none); GLM-4 (GLM-4-0414, GLM-Z1) with the torch
# trainer.
FAMILIES: dict[str, Family] = {
    "qwen2": _tf("qwen2", "Qwen2", moe_of="qwen2_moe"),
    "qwen2_moe": _tf("qwen2_moe", "Qwen2Moe", moe=True),
    "qwen3": _tf("qwen3", "Qwen3", qk_norm=True, moe_of="qwen3_moe"),
    "qwen3_moe": _tf("qwen3_moe", "Qwen3Moe", qk_norm=True, moe=True),
    "llama": _tf("llama", "Llama"),
    "mistral": _tf("mistral", "Mistral"),
    "mixtral": _tf("mixtral", "Mixtral", moe=True),
    "glm4": _tf("glm4", "Glm4", megatron=False),
}

# model_type -> vision-language family (milehpc.models_vl), kept apart from FAMILIES: they load from a folder only
# (no random [model] table), through transformers' image-text-to-text class, and train with the torch trainer alone.
# Qwen3-VL's deepstack features go through the same code (milehpc.models_vl.vision_inputs); its MoE sibling too
# (transformers' classes on both sides: the experts stacked alike).
VISION_FAMILIES: dict[str, Family] = {
    name: Family(f"transformers.models.{name}.modeling_{name}", f"{prefix}Config",
                 f"{prefix}ForConditionalGeneration", "", megatron=False, vision=True, moe=name.endswith("_moe"))
    for name, prefix in (("qwen2_5_vl", "Qwen2_5_VL"), ("qwen3_vl", "Qwen3VL"), ("qwen3_vl_moe", "Qwen3VLMoe"))
}

# What [model].arch may name: the dense families (num_experts > 0 builds their MoE sibling where they have one).
RANDOM_ARCHS = ("qwen2", "qwen3", "llama", "mistral")
# Rollout engines that load a MoE checkpoint's own names (one tensor per expert and projection); the others run
# transformers' classes, which hold the experts stacked (milehpc.models.engine_moe_layout, memory.sync_buffers).
CHECKPOINT_MOE_ENGINES = frozenset({"sglang"})


def supported_text() -> str:
    return ", ".join(sorted({**FAMILIES, **VISION_FAMILIES}))


def check_family(model_type: object, *, file: str | None = None, field: str = "model.path") -> Family:
    """The family of ``model_type``, or one ConfigError line naming it and what is supported."""
    family = (FAMILIES.get(model_type) or VISION_FAMILIES.get(model_type)) if isinstance(model_type, str) else None
    if family is None:
        raise ConfigError(f"expected a config.json model_type in: {supported_text()}; got {model_type!r}",
                          file=file, field=field)
    return family


def check_megatron_family(model_type: str, *, file: str | None = None) -> None:
    """One ConfigError line when the Megatron trainer cannot express ``model_type`` (supported: the torch one)."""
    if not check_family(model_type, file=file).megatron:
        able = ", ".join(sorted(k for k, f in FAMILIES.items() if f.megatron))
        raise ConfigError(f"expected trainer.backend = 'torch' for a {model_type} model (the Megatron trainer takes "
                          f"{able}), got 'megatron'", file=file, field="trainer.backend")


def folder_model_type(path: str | Path) -> str | None:
    """The ``model_type`` of a local HF folder's config.json, or None when the folder is not readable here (the
    login node may not see the compute nodes' filesystem; the ranks check again when they load it)."""
    data = folder_config(str(path))
    return None if data is None else data.get("model_type", "")  # readable, no family: refused


def random_model_type(arch: str, num_experts: int, *, file: str | None = None) -> str:
    """The model_type a random model from the ``[model]`` table is built as."""
    if num_experts > 0:
        moe = FAMILIES[arch].moe_of
        if moe is None:
            raise ConfigError(f"expected arch in {', '.join(a for a in RANDOM_ARCHS if FAMILIES[a].moe_of)} for a "
                              f"mixture of experts (model.num_experts = {num_experts}), got {arch!r}",
                              file=file, field="model.arch")
        return moe
    return arch


def job_model_type(job: Any) -> str | None:
    """The model_type of a job's model: its folder's (None when unreadable here) or the random ``[model]`` table's."""
    m = job.model
    return folder_model_type(m.path) if m.path else random_model_type(m.arch, m.num_experts)


@lru_cache(maxsize=32)
def _read_config(path: str, _mtime_ns: int, _size: int) -> dict[str, Any] | None:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def folder_config(folder: str) -> dict[str, Any] | None:
    """A folder's ``config.json`` as a dict, or None when it is not readable here (cached while the file is
    unchanged: every rule reads it)."""
    path = Path(folder).expanduser() / "config.json"
    try:
        info = path.stat()
    except OSError:
        return None
    return _read_config(str(path), info.st_mtime_ns, info.st_size)


# The tool-call formats the agent generator parses (milehpc.rollout.tool_calls.PARSERS has one parser per name; a
# test keeps them equal), and the one each family's chat template teaches.
TOOL_PARSERS = ("glm45", "llama3", "mistral", "none", "qwen25")
FAMILY_PARSERS: dict[str, str] = {
    "qwen2": "qwen25", "qwen2_moe": "qwen25", "qwen3": "qwen25", "qwen3_moe": "qwen25",
    "qwen2_5_vl": "qwen25", "qwen3_vl": "qwen25", "qwen3_vl_moe": "qwen25",
    "llama": "llama3", "mistral": "mistral", "mixtral": "mistral", "glm4": "glm45",
}


def parser_name(option: str | None, model_type: str | None) -> str:
    """The tool-call parser to use: ``option`` (``generator_params.tool_parser``) when set, else the family's;
    ValueError (one line) when neither names one."""
    if option:
        if option not in TOOL_PARSERS:
            raise ValueError(f"expected a tool-call parser among {list(TOOL_PARSERS)}, got {option!r}")
        return option
    if model_type in FAMILY_PARSERS:
        return FAMILY_PARSERS[model_type]
    raise ValueError(f"expected rollout.generator_params.tool_parser (one of {', '.join(TOOL_PARSERS)}): the "
                     f"model family {model_type!r} has no known tool-call format")

"""The model's shape, from ONE place: a checkpoint folder's ``config.json`` when ``model.path`` is given, else the
``[model]`` table (login-safe: stdlib only; transformers is never imported).

With a folder, the ranks build what its ``config.json`` says, so the layout checks (TP/PP/EP divisibility, KV heads,
experts, the vocabulary against the tokenizer) must use that too. The ``[model]`` shape fields are then not used:
one set to something else than its default must agree with the folder, or the job is refused in one line (a value
left at its default is ignored; a run directory's job.json holds every default).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.config.families import check_family, folder_config
from milehpc.errors import ConfigError

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec, ModelSpec

# [model] field -> the config.json keys that hold it (the first present wins; Mixtral names its experts
# num_local_experts).
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size",),
    "num_layers": ("num_hidden_layers",),
    "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads",),
    "intermediate_size": ("intermediate_size",),
    "max_position_embeddings": ("max_position_embeddings",),
    "vocab_size": ("vocab_size",),
    "num_experts": ("num_experts", "num_local_experts"),
    "moe_top_k": ("num_experts_per_tok",),
    "tie_word_embeddings": ("tie_word_embeddings",),
}


@dataclass(frozen=True)
class ModelShape:
    """What every login-side check reads about the model; ``source`` names where it came from (for messages)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    vocab_size: int | None  # None: the tokenizer's size (a model built from the table)
    num_experts: int
    moe_top_k: int
    tie_word_embeddings: bool
    source: str = "[model]"


def table_shape(model: ModelSpec) -> ModelShape:
    """The shape a random model built from the ``[model]`` table has."""
    return ModelShape(**{name: getattr(model, name) for name in CONFIG_KEYS})


def _int(cfg: dict[str, Any], keys: tuple[str, ...], where: str, file: str | None) -> Any:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            value = cfg[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"expected {key} in {where} to be a non-negative integer, got {value!r}", file=file,
                                  field="model.path")
            return value
    return None


def folder_shape(cfg: dict[str, Any], where: str, *, file: str | None = None) -> ModelShape:
    """The shape a checkpoint's ``config.json`` (``cfg``, read from ``where``) describes."""
    got = {name: _int(cfg, keys, where, file) for name, keys in CONFIG_KEYS.items() if name != "tie_word_embeddings"}
    for name in ("hidden_size", "num_layers", "num_heads"):
        if not got[name]:
            raise ConfigError(f"expected {CONFIG_KEYS[name][0]} > 0 in {where}, got {got[name]!r}", file=file,
                              field="model.path")
    got["num_kv_heads"] = got["num_kv_heads"] or got["num_heads"]  # absent: multi-head attention
    got["num_experts"] = got["num_experts"] or 0
    got["moe_top_k"] = got["moe_top_k"] or 1
    got["intermediate_size"] = got["intermediate_size"] or 0
    got["max_position_embeddings"] = got["max_position_embeddings"] or 0
    return ModelShape(**got, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), source=where)


def model_shape(job: JobSpec, *, file: str | None = None) -> ModelShape:
    """The shape the ranks will build: ``model.path``'s config.json when this node can read it (a [model] shape
    field set to another value is refused), else the ``[model]`` table."""
    model = job.model
    cfg = folder_config(model.path) if model.path else None
    if cfg is None:
        return table_shape(model)
    check_family(cfg.get("model_type"), file=file, field="model.path")  # a family milehpc builds, before its shape
    where = os.path.join(model.path, "config.json")  # type: ignore[arg-type]
    if isinstance(cfg.get("text_config"), dict):  # a vision-language model: the LM's shape is its text_config's
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
    shape = folder_shape(cfg, where, file=file)
    _agree(model, shape, file)
    return shape


def _agree(model: ModelSpec, shape: ModelShape, file: str | None) -> None:
    """A [model] shape field changed from its default must say what the folder says (else which one is meant?)."""
    defaults = {f.name: f.default for f in dataclasses.fields(model)}
    for name in CONFIG_KEYS:
        given, folder = getattr(model, name), getattr(shape, name)
        if given != defaults[name] and given != folder:
            raise ConfigError(f"model.path is a checkpoint folder whose {shape.source} says {name} = {folder!r}: "
                              f"expected model.{name} unset (the folder's shape is used) or equal to it, got "
                              f"{given!r}", file=file, field=f"model.{name}")


def tokenizer_size(folder: str) -> int | None:
    """How many ids a tokenizer folder's ``tokenizer.json`` uses (its vocabulary and added tokens), or None when
    there is none readable here."""
    path = Path(folder).expanduser() / "tokenizer.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    vocab = (data.get("model") or {}).get("vocab") if isinstance(data.get("model"), dict) else None
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab))) if isinstance(vocab, list) else []
    ids += [t.get("id") for t in data.get("added_tokens") or [] if isinstance(t, dict)]
    ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    return max(ids) + 1 if ids else None


def check_vocabulary(job: JobSpec, *, file: str | None = None) -> None:
    """The tokenizer's ids must have rows in the model's embedding: a tokenizer folder's size against the vocabulary
    the model is built with (config.json's vocab_size, or model.vocab_size). The trainers pad the vocabulary to a
    multiple of TP themselves (rows past the checkpoint's are masked); they cannot invent rows for larger ids."""
    if job.model.tokenizer == "toy":
        return
    vocab = model_shape(job, file=file).vocab_size
    size = tokenizer_size(job.model.tokenizer) if vocab else None
    if vocab and size and size > vocab:
        raise ConfigError(f"expected a tokenizer whose ids fit the model's vocabulary of {vocab} (vocab_size), got "
                          f"{size} ids in {job.model.tokenizer}/tokenizer.json", file=file, field="model.tokenizer")


"""Writing an export folder: staged in a hidden sibling and renamed into place when complete (nothing half-written
at ``-o DIR`` on failure), never over a non-empty folder without ``force``; the HF model files (safetensors, config,
generation config) from weights in HF names; the provenance record."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError

if TYPE_CHECKING:
    import torch

PROVENANCE = "milehpc_export.json"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def check_output(out: Path, *, force: bool) -> None:
    """Refuse (one line) before any work: a file, or a non-empty folder without ``force``."""
    if out.exists() and not out.is_dir():
        raise ConfigError("expected a folder to write the export into, got a file", file=str(out), field="-o")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError("expected a new or empty folder, got a non-empty one (--force replaces it)",
                          file=str(out), field="-o")


@contextmanager
def staged(out: Path, *, force: bool) -> Iterator[Path]:
    """A temporary folder next to ``out`` to write into; on success it becomes ``out`` (an old ``out`` is replaced
    only after the new one is complete), on failure it is removed and ``out`` is untouched."""
    check_output(out, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if out.is_dir() and any(out.iterdir()):
            old = out.parent / f".{out.name}.replaced-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)  # onto a missing or empty folder: one rename
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, DTYPES[name])


def hf_model(hf_config: Any, weights: dict[str, torch.Tensor]) -> Any:
    """The transformers model of ``hf_config`` holding ``weights`` (HF names), built without initialising weights
    that are overwritten anyway (meta device, then the tensors assigned)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # a vision-language model (a vision_config): its image-text-to-text class, vision tower included
    auto = AutoModelForImageTextToText if getattr(hf_config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(hf_config)
    result = model.load_state_dict(weights, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ConfigError(f"the checkpoint's weights do not fit the job's model: missing {missing[:3]}, "
                          f"unexpected {list(result.unexpected_keys)[:3]}", field="model")
    if tied:
        model.tie_weights()
    return model


def write_model(model: Any, out: Path, *, dtype: str | None, generation: Any,
                max_shard_size: str | int = "5GB") -> str:
    """``model`` as safetensors (sharded above ``max_shard_size``, with an index) + config.json +
    generation_config.json; returns the dtype written."""
    from transformers.utils import logging as hf_logging

    if dtype is not None:
        model = model.to(torch_dtype(dtype))
    model.generation_config = generation
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the command prints one line of what it wrote instead
    try:
        model.save_pretrained(str(out), max_shard_size=max_shard_size)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    generation.save_pretrained(str(out))
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def write_provenance(out: Path, record: dict[str, Any]) -> None:
    (out / PROVENANCE).write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")

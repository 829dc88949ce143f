"""``milehpc export RUN_DIR``: one checkpoint of a run as a Hugging Face folder that ``transformers`` loads and SGLang
serves (or, for a LoRA run, a peft adapter folder), with the run's tokenizer and a provenance record."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError
from milehpc.export import folder
from milehpc.export.source import Source, full_model_state, load_source
from milehpc.export.tokenizer_files import loads_alike, write_tokenizer

if TYPE_CHECKING:
    import torch

MODEL, MERGED, ADAPTER = "model", "merged", "adapter"


@dataclass
class Exported:
    """What was written where, for the command to print."""

    out: Path
    kind: str  # model | merged | adapter
    step: int
    weight_version: int
    dtype: str | None
    files: list[str]
    notes: list[str] = field(default_factory=list)


def _kind(source: Source, adapter: bool, merged: bool, notes: list[str]) -> str:
    lora = source.job.trainer.lora is not None
    where = str(source.run_dir / "job.json")
    if adapter and merged:
        raise ConfigError("expected one of --adapter and --merged, got both (export twice for both folders)",
                          field="--adapter/--merged")
    if (adapter or merged) and not lora:
        flag = "--adapter" if adapter else "--merged"
        raise ConfigError(f"{flag} exports a LoRA run: expected [trainer.lora] in the run's job, got none",
                          file=where, field="trainer.lora")
    if adapter:
        return ADAPTER
    if lora and not merged:
        notes.append("a LoRA run: writing the base with the adapter merged (--adapter writes the peft adapter alone)")
    return MERGED if lora else MODEL


def _hf_config(source: Source, tok: Any) -> Any:
    from milehpc.train.megatron.model import hf_config_for

    return hf_config_for(source.job.model, tok.vocab_size, pad_id=tok.pad_id, eos_id=tok.eos_id)


def _generation_config(source: Source, tok: Any) -> Any:
    """The base folder's own generation config when the run started from one, else the tokenizer's special ids."""
    from transformers import GenerationConfig

    path = source.job.model.path
    if path and (Path(path) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    return GenerationConfig(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)


def _weights(source: Source, hf_config: Any) -> dict[str, torch.Tensor]:
    backend = source.job.trainer.backend
    if backend == "megatron":
        from milehpc.export.megatron import megatron_weights

        return megatron_weights(source, hf_config)
    if backend != "torch":
        raise ConfigError(f"expected a checkpoint of the torch or megatron trainer, got trainer.backend = "
                          f"{backend!r}", file=str(source.run_dir / "job.json"), field="trainer.backend")
    return full_model_state(source)


def policy_weights(source: Source, adapter: str | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's policy in HF names (what the trainer's weight sync sends an engine): the trainer's weights,
    or a LoRA run's base with its adapter (of a multi-LoRA run: the named ``adapter``) merged in."""
    if source.job.trainer.lora is not None:
        from milehpc.train.lora_export import policy_from_checkpoint

        if source.job.trainer.lora.adapters and adapter is None:
            raise ConfigError(f"a multi-LoRA run has one policy per adapter: expected one of them "
                              f"({', '.join(source.job.trainer.lora.adapters)}), got the run",
                              file=str(source.run_dir / "job.json"), field="trainer.lora.adapters")
        return dict(policy_from_checkpoint(source.job, source.trainer["model"], adapter).merge_and_unload()
                    .state_dict())
    from milehpc.data.tokenizer import build_tokenizer

    return _weights(source, _hf_config(source, build_tokenizer(source.job.model.tokenizer)))


def _model(source: Source, kind: str, hf_config: Any, adapter: str | None = None) -> Any:
    """The HF model to write: the checkpoint's weights, or a LoRA run's base with the adapter (of a multi-LoRA run:
    the named ``adapter``) merged in (or the peft model itself, for ``--adapter``)."""
    if kind == MODEL:
        return folder.hf_model(hf_config, _weights(source, hf_config))
    from milehpc.train.lora_export import policy_from_checkpoint

    policy = policy_from_checkpoint(source.job, source.trainer["model"], adapter)
    return policy if kind == ADAPTER else policy.merge_and_unload()


def _provenance(source: Source, kind: str, dtype: str) -> dict[str, Any]:
    """Where the folder came from (``milehpc_export.json``)."""
    from milehpc import __version__
    from milehpc.train.lora import base_source

    record = {
        "format": 1, "kind": kind, "run_dir": str(source.run_dir.resolve()), "job": source.job.name,
        "step": source.info.step, "weight_version": source.weight_version,
        "source_checkpoint": str(source.info.path.resolve()), "trainer_backend": source.job.trainer.backend,
        "layout": source.parallel(), "dtype": dtype, "tokenizer": source.job.model.tokenizer,
        "base": base_source(source.job), "milehpc_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    # A Megatron LoRA checkpoint is adapter-only: it has no dist checkpoint.
    if source.job.trainer.backend == "megatron" and source.job.trainer.lora is None:
        from milehpc.export.megatron import dist_checkpoint_dir

        record["dist_checkpoint"] = str(dist_checkpoint_dir(source).resolve())
    return record


def _write(source: Source, kind: str, model: Any, tmp: Path, tok: Any, dtype: str | None, notes: list[str]) -> str:
    """One folder: the model (or the peft adapter), the tokenizer and the provenance; returns the dtype written."""
    if kind == ADAPTER:
        if dtype is not None:
            model = model.to(folder.torch_dtype(dtype))
        model.save_pretrained(str(tmp))
        written = str(next(p for n, p in model.named_parameters() if "lora_" in n).dtype).removeprefix("torch.")
    else:
        written = folder.write_model(model, tmp, dtype=dtype, generation=_generation_config(source, tok))
    write_tokenizer(tok, tmp)
    other = loads_alike(tmp, tok)
    if other is not None and not any(n.startswith("transformers loads the exported tokenizer") for n in notes):
        notes.append(f"transformers loads the exported tokenizer as {other}, which splits text unlike the run's "
                     f"tokenizer; serve with the run's own (e.g. SGLang --tokenizer-path "
                     f"{source.job.model.tokenizer})")
    folder.write_provenance(tmp, _provenance(source, kind, written))
    return written


def export_run(run_dir: str | Path, out: str | Path, *, step: int | None = None, dtype: str | None = None,
               adapter: bool = False, merged: bool = False, force: bool = False) -> Exported:
    """Write checkpoint ``step`` (default: the newest) of the run in ``run_dir`` into the folder ``out``.

    ``dtype`` (fp32 | bf16 | fp16): the weights' dtype in the folder (default: as trained). A LoRA run gives the merged
    model unless ``adapter`` asks for the peft adapter folder; a multi-LoRA run one such folder per adapter,
    ``out/<adapter>/``."""
    from milehpc.data.tokenizer import build_tokenizer

    out = Path(out)
    folder.check_output(out, force=force)  # before reading gigabytes
    if dtype is not None and dtype not in folder.DTYPES:
        raise ConfigError(f"expected one of {', '.join(folder.DTYPES)}, got {dtype!r}", field="--dtype")
    source = load_source(run_dir, step)
    notes: list[str] = []
    kind = _kind(source, adapter, merged, notes)
    tok = build_tokenizer(source.job.model.tokenizer)
    hf_config = _hf_config(source, tok)
    adapters = list(source.job.trainer.lora.adapters) if source.job.trainer.lora is not None else []
    with folder.staged(out, force=force) as tmp:
        if adapters:  # multi-LoRA: a folder per adapter
            written = ""
            for name in adapters:
                (tmp / name).mkdir()
                written = _write(source, kind, _model(source, kind, hf_config, name), tmp / name, tok, dtype, notes)
            files = sorted(f"{name}/{p.name}" for name in adapters for p in (tmp / name).iterdir())
        else:
            written = _write(source, kind, _model(source, kind, hf_config), tmp, tok, dtype, notes)
            files = sorted(p.name for p in tmp.iterdir())
    return Exported(out, kind, source.info.step, source.weight_version, written, files, notes)

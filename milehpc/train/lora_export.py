"""``[trainer.lora]`` runs exported as peft adapter folders (the library side of ``milehpc export --adapter``), and the
checkpoint's policy (the job's base with the checkpoint's adapter) that ``milehpc export --merged`` merges."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError
from milehpc.train import lora

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec


def policy_from_checkpoint(job: JobSpec, model_state: dict[str, Any], adapter: str | None = None) -> Any:
    """The peft model the torch trainer held when it saved ``model_state`` (adapter-only, see
    :func:`milehpc.train.lora.checkpoint_state`): the job's base, built as the trainer builds it, with the adapter
    loaded (refused when the base differs from the one it was trained on). A multi-LoRA run: the named ``adapter``
    alone, as peft's one ``default`` adapter (so it saves as a plain adapter folder and merges alone)."""
    from dataclasses import replace

    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import build_model

    spec = job.trainer.lora
    if spec is None:
        raise ConfigError("expected a run with [trainer.lora], got none", field="trainer.lora")
    if spec.adapters and adapter not in spec.adapters:
        raise ConfigError(f"expected one of the run's adapters ({', '.join(spec.adapters)}), got {adapter!r}",
                          field="trainer.lora.adapters")
    tok = build_tokenizer(job.model.tokenizer)
    base = build_model(job.model, tok.vocab_size, seed=job.run.seed, pad_id=tok.pad_id, eos_id=tok.eos_id)
    fingerprint = lora.fingerprint(base)
    module = lora.attach(base, replace(spec, adapters={}), seed=job.run.seed)
    if spec.adapters:  # <module>.lora_A.<adapter>.weight -> peft's default adapter's name (the adapter's own
        # parts only: an adapter may share its name with a module, e.g. "mlp")
        parts = list(zip(lora.adapter_parts(adapter), lora.ADAPTER_PARTS, strict=True))

        def as_default(name: str) -> str:
            for mine, default in parts:
                name = name.replace(mine, default)
            return name

        model_state = {**model_state, "adapter": {
            as_default(n): t for n, t in model_state["adapter"].items()
            if any(mine in n for mine, _ in parts)}}
    lora.load_checkpoint_state(module, model_state, base_fingerprint=fingerprint)
    return module


def export_adapter(run_dir: str | Path, out: str | Path) -> Path:
    """The newest checkpoint's adapter of the run in ``run_dir`` as a peft adapter folder (``adapter_config.json``
    + ``adapter_model.safetensors``) that ``PeftModel.from_pretrained(base, out)`` loads over the job's base."""
    from milehpc.checkpoint import Checkpointer
    from milehpc.config.load import run_job

    run_dir = Path(run_dir)
    job = run_job(run_dir)
    if job.trainer.lora is None:
        raise ConfigError("expected a run with [trainer.lora], got none", file=str(run_dir / "job.json"),
                          field="trainer.lora")
    ckpt = Checkpointer(run_dir / "checkpoints")
    newest = ckpt.find_latest()
    if newest is None:
        raise ConfigError("expected a committed checkpoint, got none", file=str(run_dir / "checkpoints"))
    state = ckpt.load(newest).state["trainer"]["trainer"]["model"]  # trainer rank 0's shard
    policy_from_checkpoint(job, state).save_pretrained(str(out))
    return Path(out)

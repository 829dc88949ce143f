"""``[trainer.lora]`` runs exported as peft adapter folders (the library side of ``milehpc export --adapter``)."""

from __future__ import annotations

from pathlib import Path

from milehpc.errors import ConfigError
from milehpc.train.lora import load_checkpoint_state


def export_adapter(run_dir: str | Path, out: str | Path) -> Path:
    """The newest checkpoint's adapter of the run in ``run_dir`` as a peft adapter folder (``adapter_config.json``
    + ``adapter_model.safetensors``) that ``PeftModel.from_pretrained(base, out)`` loads over the job's base."""
    from milehpc.checkpoint import Checkpointer
    from milehpc.config.load import run_job
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.train.torch_trainer import TorchTrainer

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
    trainer = TorchTrainer(job, build_tokenizer(job.model.tokenizer))
    load_checkpoint_state(trainer.module, state, base_fingerprint=trainer.base_fingerprint)
    trainer.module.save_pretrained(str(out))
    return Path(out)

"""The teacher of on-policy distillation on the Megatron trainer: a frozen GPTModel built from the local HF folder
``trainer.options.teacher_path`` (its own architecture: a teacher may be larger than the student, but shares its
tokenizer), sharded over the policy's TP/PP/EP groups, forward only (no DDP, no optimizer, not checkpointed: a
resumed run loads it again from the same folder). The trainer runs it like the KL reference."""

from __future__ import annotations

import dataclasses
from typing import Any

from milehpc.errors import ConfigError


def build(trainer: Any) -> tuple[Any, int]:
    """This rank's frozen teacher shard and the teacher's (unpadded) vocabulary size; ``trainer`` is the
    :class:`~milehpc.train.megatron.trainer.MegatronTrainer` (which imports this module)."""
    from milehpc.models import build_model
    from milehpc.train.megatron import model as mm
    from milehpc.train.megatron.convert import load_hf_weights

    job = trainer.job
    tr = job.trainer
    path = str(tr.options.get("teacher_path") or "")
    if not path:  # the job rules refuse this on the login node; a trainer built directly gets the same line
        raise ConfigError("on-policy distillation needs a teacher: expected trainer.options.teacher_path = a local "
                          "HF checkpoint folder, got none", field="trainer.options.teacher_path")
    hf_model = build_model(dataclasses.replace(job.model, path=path), trainer.vocab_size)
    arch = mm.arch_of(hf_model.config)
    if arch.is_moe and tr.tp > 1:
        raise ConfigError(f"expected trainer.tp = 1 with a mixture-of-experts teacher ({path} has "
                          f"{arch.num_experts} experts), got {tr.tp}", field="trainer.tp")
    config = mm.transformer_config(arch, tr, use_cpu_initialization=trainer.device.type == "cpu")
    module = mm.build_gpt(arch, config, tp=trainer.tp, te=trainer.te, keep_rng=True)
    load_hf_weights(module, dict(hf_model.state_dict()), arch, tp=trainer.tp, dtype=config.params_dtype)
    return mm.freeze(module, config), arch.vocab_size

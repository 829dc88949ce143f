"""Built-in trainers: the torch trainer (HF models, DDP over gloo/NCCL, FSDP2 where torch supports it)."""

from __future__ import annotations

from collections.abc import Iterator

from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import Trainer

# ``trainer.options`` of the torch trainer: FSDP2 instead of DDP, the critic's learning rate, the teacher checkpoint
# folder of on-policy distillation.
TORCH_TRAINER_OPTIONS = {"fsdp": False, "critic_lr": 1e-4, "teacher_path": ""}


@hookimpl
def milehpc_trainers() -> Iterator[Trainer]:
    yield Trainer(name="torch", impl="milehpc.train.torch_trainer:from_context",
                  description="PyTorch trainer for HF-architecture models (DDP; FSDP2 with options.fsdp = true)",
                  defaults=dict(TORCH_TRAINER_OPTIONS), requires=("torch", "transformers"))

"""Built-in trainers: the torch trainer (HF models, DDP over gloo/NCCL, FSDP2 where torch supports it)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from milehpc.config.schema import opt
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import Trainer, schema_defaults


@dataclass
class TorchTrainerOptions:
    """``trainer.options`` of the torch trainer."""

    fsdp: bool = opt(False, help="FSDP2 instead of DDP over the trainer ranks")
    critic_lr: float = opt(1e-4, min=0.0, help="learning rate of the critic (GAE)")
    teacher_path: str = opt("", help="on-policy distillation: the teacher's local HF checkpoint folder")


TORCH_TRAINER_OPTIONS = schema_defaults(TorchTrainerOptions)


@hookimpl
def milehpc_trainers() -> Iterator[Trainer]:
    yield Trainer(name="torch", impl="milehpc.train.torch_trainer:from_context",
                  description="PyTorch trainer for HF-architecture models (DDP; FSDP2 with options.fsdp = true)",
                  schema=TorchTrainerOptions, requires=("torch", "transformers"))

"""Built-in Megatron-core plugins: the "megatron" trainer and the "megatron-to-hf" weight converter."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from milehpc.config.schema import opt
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import Trainer, WeightConverter


@dataclass
class MegatronOptions:
    """``trainer.options`` of the megatron trainer (the MoE names are TransformerConfig's)."""

    routing_replay: bool = opt(False, help="replay the experts the engine routed to (MoE, R3)")
    transformer_engine: bool | None = opt(None, help="transformer-engine layers; unset = when installed on a GPU")
    init_std: float = opt(0.02, min=0.0, help="std of the random initialisation (no model.path)")
    moe_load_balancing: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = opt("none")
    moe_aux_loss_coeff: float = opt(0.0, min=0.0)
    moe_dispatcher: Literal["allgather", "alltoall", "flex"] | None = opt(
        None, help="MoE token dispatcher; unset = alltoall on GPUs, allgather on the CPU")
    critic_lr: float = opt(1e-4, min=0.0, help="learning rate of the critic (GAE)")
    teacher_path: str = opt("", help="on-policy distillation: the teacher's local HF checkpoint folder")
    offload_frozen: bool = opt(False, help="keep the KL reference and the teacher in CPU memory between uses on a GPU "
                                           "(always so with resources.colocate)")


@dataclass
class MegatronToHfParams:
    moe_layout: Literal["transformers", "checkpoint"] = opt("transformers", help="HF MoE names: in-memory or on-disk")
    tp: int = opt(1, min=1)


@hookimpl
def milehpc_trainers() -> Iterator[Trainer]:
    yield Trainer(
        name="megatron", impl="milehpc.train.megatron.trainer:from_context",
        description="Megatron-core GPTModel: TP/PP/DP/EP from the plan, Megatron DDP + (distributed) optimizer, "
                    "pipeline schedules; runs on CPU (gloo) too",
        schema=MegatronOptions,
        requires=("megatron.core", "torch", "transformers"),
        # dist_checkpointing reshards model + optimizer to another TP/PP/DP layout (checkpoint.py imports nothing).
        can_reshard="milehpc.train.megatron.checkpoint:can_reshard",
    )


@hookimpl
def milehpc_weight_converters() -> Iterator[WeightConverter]:
    yield WeightConverter(
        name="megatron-to-hf", impl="milehpc.train.megatron.convert:megatron_to_hf", source="megatron", target="hf",
        description="Megatron-core names/layouts (fused interleaved QKV, fused gate/up, TP shards) -> HF names",
        schema=MegatronToHfParams, requires=("torch",),
    )

"""Built-in Megatron-core plugins: the "megatron" trainer and the "megatron-to-hf" weight converter."""

from __future__ import annotations

from collections.abc import Iterator

from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import Trainer, WeightConverter


@hookimpl
def milehpc_trainers() -> Iterator[Trainer]:
    yield Trainer(
        name="megatron", impl="milehpc.train.megatron.trainer:from_context",
        description="Megatron-core GPTModel: TP/PP/DP/EP from the plan, Megatron DDP + (distributed) optimizer, "
                    "pipeline schedules; runs on CPU (gloo) too",
        defaults={"routing_replay": False, "transformer_engine": None, "init_std": 0.02,
                  "moe_load_balancing": "none", "moe_aux_loss_coeff": 0.0, "moe_dispatcher": None},
        requires=("megatron.core", "torch", "transformers"),
        # dist_checkpointing reshards model + optimizer to another TP/PP/DP layout (checkpoint.py imports nothing).
        can_reshard="milehpc.train.megatron.checkpoint:can_reshard",
    )


@hookimpl
def milehpc_weight_converters() -> Iterator[WeightConverter]:
    yield WeightConverter(
        name="megatron-to-hf", impl="milehpc.train.megatron.convert:megatron_to_hf", source="megatron", target="hf",
        description="Megatron-core names/layouts (fused interleaved QKV, fused gate/up, TP shards) -> HF names",
        defaults={"moe_layout": "transformers", "tp": 1}, requires=("torch",),
    )

"""Built-in SGLang plugins: the ``sglang`` rollout engine (GPU containers; needs the ``sglang`` package)."""

from __future__ import annotations

from collections.abc import Iterator

from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import RolloutEngine

# The params ``[rollout.options]`` accepts for this engine (validated in full, on the login node too, by
# milehpc.rollout.sglang_mapping.parse_options; None = a table or value of its own shape).
SGLANG_OPTION_DEFAULTS = {
    "speculative": None, "server_args": {}, "mem_fraction_static": None, "return_routed_experts": None,
    "weight_bucket_mb": 512, "check_weights_truncate": 100, "health_timeout_s": 60.0, "max_restarts": 3,
}


@hookimpl
def milehpc_rollout_engines() -> Iterator[RolloutEngine]:
    yield RolloutEngine(name="sglang", impl="milehpc.rollout.sglang_engine:from_context",
                        description="SGLang in-process engine per engine group (TP over ranks, NCCL weight sync, "
                                    "colocated offload with torch_memory_saver, EAGLE speculative decoding)",
                        defaults=dict(SGLANG_OPTION_DEFAULTS), requires=("sglang",), direct_weight_sync=True,
                        check_options="milehpc.rollout.sglang_mapping:parse_options")

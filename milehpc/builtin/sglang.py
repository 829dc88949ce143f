"""Built-in SGLang plugins: the ``sglang`` rollout engine (GPU containers; needs the ``sglang`` package)."""

from __future__ import annotations

from collections.abc import Iterator

from milehpc.config.sglang_options import SGLangOptions
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import RolloutEngine


@hookimpl
def milehpc_rollout_engines() -> Iterator[RolloutEngine]:
    yield RolloutEngine(name="sglang", impl="milehpc.rollout.sglang_engine:from_context",
                        description="SGLang in-process engine per engine group (TP over ranks, NCCL weight sync, "
                                    "colocated offload with torch_memory_saver, EAGLE speculative decoding)",
                        schema=SGLangOptions, requires=("sglang",), direct_weight_sync=True,
                        check_options="milehpc.config.sglang_options:parse_options")

"""Built-in rollout engines: the reference engine (HF transformers, plain PyTorch; CPU default)."""

from __future__ import annotations

from collections.abc import Iterator

from milehpc.config.job import RolloutLoopOptions
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import RolloutEngine


@hookimpl
def milehpc_rollout_engines() -> Iterator[RolloutEngine]:
    yield RolloutEngine(name="reference", impl="milehpc.rollout.reference:from_context",
                        description="HF-transformers sampler with KV cache (CPU default; runs on GPUs too)",
                        schema=RolloutLoopOptions, requires=("torch", "transformers"))
    yield RolloutEngine(name="reference_process",
                        impl="milehpc.rollout.supervisor:reference_process_from_context",
                        description="the reference engine in a supervised child process of its rank: if it dies it "
                                    "is restarted in place, re-synced, its in-flight prompts re-queued",
                        schema=RolloutLoopOptions, requires=("torch", "transformers"))

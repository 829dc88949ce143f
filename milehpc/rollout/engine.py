"""The rollout-engine protocol every engine plugin implements (reference engine on CPU, SGLang on GPUs)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from milehpc.samples import Sample


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1  # samples per prompt
    seed: int | None = None
    # Multi-LoRA: the adapter of each prompt, one name per prompt (None: the base). SGLang serves them in one batch
    # (each request's lora_path); the reference engine, which holds one merged adapter at a time, groups by adapter.
    adapters: list[str | None] | None = None
    # Vision-language models: the image references each prompt shows (milehpc.data.images), one list per prompt;
    # None: text prompts. Engines that cannot take images are refused on the login node (milehpc.config.rules).
    images: list[list[str]] | None = None


def by_adapter(adapters: list[str | None]) -> dict[str | None, list[int]]:
    """Positions of the prompts of each adapter, adapters in the order they first appear."""
    out: dict[str | None, list[int]] = {}
    for i, name in enumerate(adapters):
        out.setdefault(name, []).append(i)
    return out


class Engine(Protocol):
    """A rollout engine living on the rollout rank(s) of one engine group: everything the loop, the weight sync
    and the colocated driver call. Implemented by the reference engine, its supervised out-of-process form and
    SGLang.

    ``generate`` is called only between weight updates: the loop never updates weights mid-generation.
    """

    tokens_generated: int
    """New tokens sampled by this engine so far (the loop's generation throughput)."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 samples: list[Sample] | None = None) -> list[Sample]:
        """Sample ``sampling.n`` responses per prompt. Returns one Sample per response, grouped by prompt, with
        response token ids and per-token logprobs. If ``samples`` (partial rollouts) is given, continue those."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights by (engine-format) name; tracks ``version``."""

    def weight_version(self) -> int:
        """The version of the weights currently loaded."""

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The engine's current weights by name (for check_weight_update_equal)."""

    def health(self) -> bool:
        """True if the engine can serve; a dead out-of-process engine returns False and may be restarted. An
        in-process engine is always healthy."""

    def restart(self) -> None:
        """Restart in place (same weights must then be re-synced by the caller); a no-op in process."""

    def release_memory(self) -> None:
        """Colocated GPU runs: give the GPU memory back (weights and KV cache) before training. May be a no-op
        (the CPU engines hold nothing worth releasing)."""

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Colocated GPU runs: take the memory back (``["weights"]`` then ``["kv_cache"]``); may be a no-op."""

    def shutdown(self) -> None:
        """Release everything."""

    def info(self) -> dict[str, Any]:
        """Facts for metrics and doctor (name, device, tp size...)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep to continue sampling exactly (e.g. the sampler's RNG); may be empty."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""


class DirectSyncEngine(Engine, Protocol):
    """An engine whose own processes receive the weight bytes (SGLang's update groups, :mod:`milehpc.weights.sglang`)
    when it runs on separate rollout ranks; its plugin says ``direct_weight_sync=True``."""

    is_leader: bool
    """This rank drives the engine (the first rank of a multi-rank engine)."""
    update_groups: dict[str, dict[str, Any]]
    """The update groups the engine has joined, by name."""

    @property
    def needs_weight_sync(self) -> bool:
        """True after a restart, until a full weight sync has filled the engine again."""

    def begin_update(self, version: int | None = None) -> None:
        """A weight sync (of ``version``, when known) starts."""

    def join_update_group(self, *, master_address: str, master_port: int, world_size: int, stage: int,
                          backend: str = "nccl", group_name: str | None = None) -> None:
        """Have the engine's processes join pipeline stage ``stage``'s update group ``group_name`` (rebuilt, under a
        new name, after a restart or a broken sync), leaving the stage's previous group."""

    def receive_bucket(self, meta: dict[str, list], *, stage: int) -> None:
        """Receive one bucket the trainer broadcasts (``meta``: names, dtypes, shapes)."""

    def finish_update(self, version: int) -> None:
        """After the last bucket of every stage: take ``version``."""

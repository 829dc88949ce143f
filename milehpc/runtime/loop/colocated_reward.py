"""``[reward_model] colocate = "rollout"``: the reward model in the rollout engine leader's own process, released from
the device while the engine generates (issue 35 item 1: "colocated with the rollout ranks as an option, offloaded
while generating"). How the release works and why it is not torch_memory_saver:
:class:`milehpc.rewards.model_scorers.DeviceWeights`; what the memory estimate counts: :mod:`milehpc.memory`
(``reward_items``). The reward ranks of their own are :mod:`milehpc.runtime.loop.reward_side`."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from milehpc.samples import Group


class ColocatedScoring:
    """``[reward_model] colocate = "rollout"``: the engine leader scores its own samples, with the reward model in
    this process, on the device only while it scores (:func:`milehpc.rewards.model_scorers.release_models`): a step
    runs ``generate -> onload -> score -> offload`` (kept in :attr:`events`, the last steps'), so the engine
    generates (and a colocated trainer trains) without it; the step reports ``reward/offloaded_gib``,
    ``time/rm_offload`` and ``time/rm_onload``. The scorer is loaded (one throw-away sample scored) and released at
    start-up, so the start-up limit, not the first step, covers the load, and the first generation already runs
    without it."""

    def __init__(self, side: Any) -> None:
        from milehpc.rewards.model_scorers import colocate_here, release_models
        from milehpc.samples import Sample

        colocate_here()
        self.events: deque[str] = deque(maxlen=32)
        probe = Sample(prompt_ids=[], prompt_text="warm-up", response_text="warm-up", label="")
        side._score([probe])  # its outcome, a score or a failure, is discarded
        release_models()

    def generate_and_score(self, side: Any, prompts: list[Any], stats: dict[str, float]) -> list[Group]:
        from milehpc.rewards.model_scorers import release_models, restore_models

        t0 = time.perf_counter()
        groups = side._generate(prompts, stats)
        self.events.append("generate")
        t1 = time.perf_counter()
        restore_models()
        self.events.append("onload")
        t2 = time.perf_counter()
        try:
            side._score([s for g in groups for s in g if s.reward is None])
            self.events.append("score")
        finally:  # off the device again before anything else runs, even when the scoring failed
            t3 = time.perf_counter()
            released = release_models()
            self.events.append("offload")
        stats["time_gen"] += t1 - t0
        stats["time_reward"] += t3 - t2
        for key, value in (("time_rm_onload", t2 - t1), ("time_rm_offload", time.perf_counter() - t3),
                           ("reward_offloaded_gib", released / 2**30)):
            stats[key] = stats.get(key, 0.0) + value
        return groups

    def at_checkpoint(self, step: int) -> None:
        """Nothing is pending: scoring ends inside :meth:`generate_and_score`."""

    def bye(self, step: int) -> None:
        """Nothing to tell: no other rank scores for this one."""

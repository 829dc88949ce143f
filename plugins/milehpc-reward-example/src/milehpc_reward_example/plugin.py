"""Registers this package's rewards with milehpc (found through the ``milehpc`` entry point)."""

from __future__ import annotations

from collections.abc import Iterator

from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import RewardFunction


@hookimpl
def milehpc_rewards() -> Iterator[RewardFunction]:
    # impl is a lazy "module:function" string: listing plugins imports nothing heavy.
    yield RewardFunction(name="length_target", impl="milehpc_reward_example.rewards:length_target",
                         defaults={"target": 8, "width": 8},
                         description="example plugin: 1 at `target` response tokens, linearly less away from it")
    yield RewardFunction(name="keyword_async", impl="milehpc_reward_example.rewards:keyword_async",
                         defaults={"keyword": "", "bonus": 1.0},
                         description="example plugin (async): bonus if the response contains `keyword`")

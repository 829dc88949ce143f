"""Registers this package's rewards with milehpc (found through the ``milehpc`` entry point)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from milehpc.config.schema import opt
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import RewardFunction


# Each reward's parameters, declared like a table of the job spec: milehpc checks `reward.params` against them on
# the login node (one line naming the field; `milehpc plugins show length_target` prints them).
@dataclass
class LengthTargetParams:
    target: int = opt(8, min=0, help="response length (tokens) that scores 1")
    width: int = opt(8, min=1, help="tokens away from target at which the score reaches 0")


@dataclass
class KeywordParams:
    keyword: str = opt("", help="the word to look for; empty = never a hit")
    bonus: float = opt(1.0, help="score of a hit")


@hookimpl
def milehpc_rewards() -> Iterator[RewardFunction]:
    # impl is a lazy "module:function" string: listing plugins imports nothing heavy.
    yield RewardFunction(name="length_target", impl="milehpc_reward_example.rewards:length_target",
                         schema=LengthTargetParams,
                         description="example plugin: 1 at `target` response tokens, linearly less away from it")
    yield RewardFunction(name="keyword_async", impl="milehpc_reward_example.rewards:keyword_async",
                         schema=KeywordParams,
                         description="example plugin (async): bonus if the response contains `keyword`")

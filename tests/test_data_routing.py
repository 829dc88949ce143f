"""Per-sample reward routing by data_source (reward.by_source): each sample is scored by its source's reward, the
others by reward.name; a data source without a reward is refused before the first step."""

from __future__ import annotations

import pytest

from milehpc.config.job import RewardSpec
from milehpc.errors import ConfigError
from milehpc.rewards.api import RewardRunner
from milehpc.rewards.routing import SourceRouter, reward_scorer
from milehpc.samples import Sample


def _sample(source: str | None, response: str, label: str, group: int) -> Sample:
    meta = {} if source is None else {"data_source": source}
    return Sample(prompt_ids=[1], response_text=response, label=label, group=group, metadata=meta)


def test_each_sample_is_scored_by_its_sources_reward() -> None:
    spec = RewardSpec(name="exact_match", by_source={"gsm8k_style": {"name": "math_answer",
                                                                      "params": {"incorrect": -1.0}}})
    scorer = reward_scorer(spec, None, sources={"gsm8k_style", "other"})
    assert isinstance(scorer, SourceRouter)
    # "so 12 #### 12" is right for math_answer (the answer after ####) and wrong for exact_match (the whole text).
    math_ok, math_bad = _sample("gsm8k_style", "so 12 #### 12", "12", 0), _sample("gsm8k_style", "#### 13", "12", 1)
    other, unsourced = _sample("other", "so 12 #### 12", "12", 2), _sample(None, "12", "12", 3)
    metrics = scorer.score([math_ok, math_bad, other, unsourced])
    assert math_ok.reward["score"] == 1.0 and math_bad.reward["score"] == -1.0  # the route's own params
    assert other.reward == 0.0 and unsourced.reward == 1.0  # reward.name: exact match of the whole response
    assert metrics["reward/count"] == 4.0


def test_without_routes_the_plain_runner_is_used_and_unrouted_sources_are_refused() -> None:
    assert isinstance(reward_scorer(RewardSpec(name="math_answer"), None), RewardRunner)
    spec = RewardSpec(by_source={"gsm8k_style": "math_answer"})
    reward_scorer(spec, None, sources={"gsm8k_style"})  # every source routed: no reward.name needed
    with pytest.raises(ConfigError, match=r"reward.by_source: data_source 'code_style' has no reward: expected it "
                                          r"in reward.by_source \(gsm8k_style\) or a reward.name"):
        reward_scorer(spec, None, sources={"gsm8k_style", "code_style"}, file="job.toml")
    with pytest.raises(ConfigError, match=r"reward.by_source.gsm8k_style.params.tolerance"):
        reward_scorer(RewardSpec(by_source={"gsm8k_style": {"name": "math_answer", "params": {"tolerance": "x"}}}),
                      None)

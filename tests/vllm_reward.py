"""The reward of the vLLM loop test, imported by its ranks (PYTHONPATH = tests/): it differs within every group from
the first step (a function of the sampled tokens), so every step moves the weights; the task's exact-match reward is
0 for every sample of an untrained model, which would leave the weights (and any stale engine) unchanged."""

from __future__ import annotations

from typing import Any


def token_reward(sample: Any) -> float:
    return (sum(sample.response_ids) % 5) / 4.0

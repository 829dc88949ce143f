"""Rewards: built-in reward functions and the runner that applies the one a job spec selects."""

from milehpc.rewards.api import RewardRunner, reward_kind

__all__ = ["RewardRunner", "reward_kind"]

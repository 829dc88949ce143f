"""Built-in rewards (registered like any third-party plugin). The toy tasks' own rewards are registered with
the tasks (``milehpc.builtin.tasks``) and can reuse :mod:`milehpc.rewards.functions`."""

from __future__ import annotations

from collections.abc import Iterator

from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import RewardFunction

_FN = "milehpc.rewards.functions:"


@hookimpl
def milehpc_rewards() -> Iterator[RewardFunction]:
    yield RewardFunction(
        name="exact_match", impl=_FN + "exact_match",
        defaults={"strip": True, "case_sensitive": True, "collapse_whitespace": False, "stop": "", "extract": "none"},
        description="1 if the (normalised, optionally extracted) response equals the label")
    yield RewardFunction(name="position_match", impl=_FN + "position_match", defaults={"strip": True, "stop": ""},
                         description="partial credit: fraction of characters in the right position")
    yield RewardFunction(
        name="math_answer", impl=_FN + "math_answer",
        defaults={"extract": "auto", "tolerance": 1e-6, "correct": 1.0, "incorrect": 0.0, "no_answer": 0.0},
        description="math: last \\boxed{} / #### / last number, compared numerically or normalised")
    yield RewardFunction(
        name="format", impl=_FN + "format_reward",
        defaults={"pattern": r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", "mode": "fullmatch",
                  "score": 1.0, "miss": 0.0},
        description="score if the response matches a regular expression (default <think>..<answer>..)")
    yield RewardFunction(name="majority_vote", impl=_FN + "majority_vote", kind="group",
                         defaults={"extract": "auto", "math": True},
                         description="group reward, no labels: 1 for agreeing with the group's majority answer")
    yield RewardFunction(name="combine", impl="milehpc.rewards.api:combine", kind="batch", defaults={"rewards": []},
                         description="weighted sum of other rewards: rewards = [{name, weight, params}, ...]")

"""Built-in rewards (registered like any third-party plugin). The toy tasks' own rewards are registered with
the tasks (``milehpc.builtin.tasks``) and can reuse :mod:`milehpc.rewards.functions`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from milehpc.config.schema import check_params, opt
from milehpc.errors import ConfigError
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import RewardFunction

_FN = "milehpc.rewards.functions:"
# milehpc.rewards.extract.extract_answer's modes.
Extract = Literal["none", "auto", "boxed", "last_number", "answer_tag", "gsm8k"]
# A registered reward, or "module:function" (loaded where the job runs).
REWARD_REF = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}|[A-Za-z_][\w.]*:[A-Za-z_][\w.]*"


@dataclass
class ExactMatchParams:
    strip: bool = opt(True, help="strip surrounding whitespace before comparing")
    case_sensitive: bool = opt(True)
    collapse_whitespace: bool = opt(False, help="runs of whitespace compare as one space")
    stop: str = opt("", help="cut the response at this string first")
    extract: Extract = opt("none", help="take the answer out of the response first")


@dataclass
class PositionMatchParams:
    strip: bool = opt(True)
    stop: str = opt("", help="cut the response at this string first")


@dataclass
class MathAnswerParams:
    extract: Extract = opt("auto")
    tolerance: float = opt(1e-6, min=0.0, help="numeric answers within this relative tolerance are equal")
    correct: float = opt(1.0)
    incorrect: float = opt(0.0)
    no_answer: float = opt(0.0, help="score when no answer can be extracted")


@dataclass
class FormatParams:
    pattern: str = opt(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", help="a Python regular expression")
    mode: Literal["fullmatch", "search"] = opt("fullmatch")
    score: float = opt(1.0)
    miss: float = opt(0.0)

    def validate(self, *, file: str | None, prefix: str) -> None:
        try:
            re.compile(self.pattern)
        except re.error as err:
            raise ConfigError(f"expected a regular expression, got {self.pattern!r} ({err})", file=file,
                              field=f"{prefix}.pattern") from None


@dataclass
class MajorityVoteParams:
    extract: Extract = opt("auto")
    math: bool = opt(True, help="compare answers as numbers where they are numbers")


@dataclass
class CodeTestsParams:
    """code_tests' parameters (declared here, not imported: listing plugins must not import the reward's module)."""

    tests_key: str = opt("tests", pattern=r".+", expect="a metadata key or 'label'",
                         help="where the sample's tests are: a metadata key, or 'label'")
    extract: bool = opt(True, help="run the last fenced code block of the response (the whole one without a block)")
    case_timeout_s: float = opt(4.0, min=0.001, help="seconds per test case")
    wall_s: float = opt(20.0, min=0.001, help="wall-clock limit of one program, seconds")
    memory_mb: int = opt(1024, min=1, help="memory limit of one program")
    max_procs: int = opt(32, min=1, help="processes one program may start")
    max_output_kb: int = opt(64, min=1, help="output kept per program")
    cache: bool = opt(True, help="score an identical (code, tests, limits) once")


@dataclass
class CombinePart:
    """One reward of ``combine``: its parameters are checked against that reward's own schema."""

    name: str = opt(pattern=REWARD_REF, expect="a reward name or module:function")
    weight: float = opt(1.0)
    params: dict[str, Any] = opt({})

    def validate(self, *, file: str | None, prefix: str) -> None:
        from milehpc import plugins

        if self.name == "combine":
            raise ConfigError("expected another reward, got 'combine' (combine cannot contain itself)", file=file,
                              field=f"{prefix}.name")
        if ":" in self.name:
            return  # a user function: its signature is checked where it is imported, inside the job
        spec = plugins.lookup("reward", self.name, file=file, field=f"{prefix}.name")
        check_params(spec, self.params, file=file, prefix=f"{prefix}.params")


@dataclass
class CombineParams:
    rewards: list[CombinePart] = opt([], help="[{name, weight = 1, params = {}}, ...]: the weighted sum of these")

    def validate(self, *, file: str | None, prefix: str) -> None:
        if not self.rewards:
            raise ConfigError("expected at least one reward, got none", file=file, field=f"{prefix}.rewards")


@hookimpl
def milehpc_rewards() -> Iterator[RewardFunction]:
    yield RewardFunction(
        name="exact_match", impl=_FN + "exact_match",
        schema=ExactMatchParams,
        description="1 if the (normalised, optionally extracted) response equals the label")
    yield RewardFunction(name="position_match", impl=_FN + "position_match", schema=PositionMatchParams,
                         description="partial credit: fraction of characters in the right position")
    yield RewardFunction(
        name="math_answer", impl=_FN + "math_answer",
        schema=MathAnswerParams,
        description="math: last \\boxed{} / #### / last number, compared numerically or normalised")
    yield RewardFunction(
        name="format", impl=_FN + "format_reward",
        schema=FormatParams,
        description="score if the response matches a regular expression (default <think>..<answer>..)")
    yield RewardFunction(name="majority_vote", impl=_FN + "majority_vote", kind="group",
                         schema=MajorityVoteParams,
                         description="group reward, no labels: 1 for agreeing with the group's majority answer")
    yield RewardFunction(name="code_tests", impl="milehpc.rewards.code_tests:code_tests", schema=CodeTestsParams,
                         description="Python code run against the sample's tests in the sandbox; fraction passed")
    yield RewardFunction(name="combine", impl="milehpc.rewards.api:combine", kind="batch", schema=CombineParams,
                         description="weighted sum of other rewards: rewards = [{name, weight, params}, ...]")

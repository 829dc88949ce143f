"""Built-in toy tasks (generated in code), their reward, and the multi-turn toy environment."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from milehpc.config.schema import opt
from milehpc.errors import ConfigError
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import Generator, RewardFunction, Task


@dataclass
class DigitStringParams:
    """``data.params`` of the sort and reverse tasks."""

    min_len: int = opt(4, min=1, max=64, help="shortest digit string")
    max_len: int = opt(5, min=1, max=64, help="longest digit string (the prompt grows with it)")
    size: int = opt(1_000_000, min=1, help="prompts in one pass over the task (made on demand)")

    def validate(self, *, file: str | None, prefix: str) -> None:
        if self.min_len > self.max_len:
            raise ConfigError(f"expected max_len >= min_len ({self.min_len}), got {self.max_len}", file=file,
                              field=f"{prefix}.max_len")


@dataclass
class AdditionParams:
    """``data.params`` of the addition task."""

    digits: int = opt(2, min=1, max=18, help="digits of each operand")
    size: int = opt(1_000_000, min=1, help="prompts in one pass over the task (made on demand)")


@dataclass
class ToyMatchParams:
    partial: float = opt(0.0, min=0.0, max=1.0, help="credit per fraction of right positions for a wrong answer")


@dataclass
class RetryParams:
    max_turns: int = opt(2, min=1, max=16, help="tries per prompt (each wrong answer gets feedback)")
    partial: float = opt(0.0, min=0.0, max=1.0, help="partial credit of toy_match")


@hookimpl
def milehpc_tasks() -> Iterator[Task]:
    yield Task(name="sort", impl="milehpc.data.tasks:sort_task", reward="toy_match", schema=DigitStringParams,
               description="sort a string of digits: sort:31452= -> 12345")
    yield Task(name="reverse", impl="milehpc.data.tasks:reverse_task", reward="toy_match", schema=DigitStringParams,
               description="reverse a string of digits: rev:31452= -> 25413")
    yield Task(name="addition", impl="milehpc.data.tasks:addition_task", reward="toy_match",
               schema=AdditionParams, description="add two numbers: add:12+34= -> 46")


@hookimpl
def milehpc_rewards() -> Iterator[RewardFunction]:
    yield RewardFunction(name="toy_match", impl="milehpc.data.tasks:toy_match", schema=ToyMatchParams,
                         description="toy tasks: 1 for the exact answer, else partial x fraction of right positions")


@hookimpl
def milehpc_generators() -> Iterator[Generator]:
    yield Generator(name="toy_retry", impl="milehpc.rollout.multiturn:retry_generator",
                    schema=RetryParams,
                    description="multi-turn toy environment: wrong answers get feedback and another try")

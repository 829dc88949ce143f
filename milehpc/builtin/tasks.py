"""Built-in toy tasks (generated in code), their reward, and the multi-turn toy environment."""

from __future__ import annotations

from collections.abc import Iterator

from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import Generator, RewardFunction, Task

_LEN = {"min_len": 4, "max_len": 5, "size": 1_000_000}


@hookimpl
def milehpc_tasks() -> Iterator[Task]:
    yield Task(name="sort", impl="milehpc.data.tasks:sort_task", reward="toy_match", defaults=dict(_LEN),
               description="sort a string of digits: sort:31452= -> 12345")
    yield Task(name="reverse", impl="milehpc.data.tasks:reverse_task", reward="toy_match", defaults=dict(_LEN),
               description="reverse a string of digits: rev:31452= -> 25413")
    yield Task(name="addition", impl="milehpc.data.tasks:addition_task", reward="toy_match",
               defaults={"digits": 2, "size": 1_000_000}, description="add two numbers: add:12+34= -> 46")


@hookimpl
def milehpc_rewards() -> Iterator[RewardFunction]:
    yield RewardFunction(name="toy_match", impl="milehpc.data.tasks:toy_match", defaults={"partial": 0.0},
                         description="toy tasks: 1 for the exact answer, else partial x fraction of right positions")


@hookimpl
def milehpc_generators() -> Iterator[Generator]:
    yield Generator(name="toy_retry", impl="milehpc.rollout.multiturn:retry_generator",
                    defaults={"max_turns": 2, "partial": 0.0},
                    description="multi-turn toy environment: wrong answers get feedback and another try")

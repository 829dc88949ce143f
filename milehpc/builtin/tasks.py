"""Built-in toy tasks (generated in code), their reward, and the multi-turn toy environment."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

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


@dataclass
class AgentParams:
    """``rollout.generator_params`` of the ``agent`` generator (milehpc.rollout.agent)."""

    agent: str = opt("", pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$", expect="'package.module:function'",
                     help="async def run(client, sample) -> reward | dict | None, with client an openai.AsyncOpenAI")
    episode_timeout_s: float = opt(120.0, min=0.001, help="an episode running longer is dropped (FAILED)")
    max_parallel: int = opt(64, min=1, help="episodes run at once on this rank")
    on_divergence: Literal["drop", "split"] = opt("drop", help="a request that does not extend the recorded "
                                                  "history: drop the episode, or split it into a new sample")
    tool_parser: Literal["qwen25", "llama3", "mistral", "glm45", "none"] | None = opt(
        None, help="the tool-call format of the model's replies (default: its family's, from config.json's "
                   "model_type; milehpc.rollout.tool_calls)")
    unix_socket: bool = opt(False, help="serve the endpoint on a Unix socket in the run directory instead of "
                                        "127.0.0.1")

    def validate(self, *, file: str | None, prefix: str) -> None:
        if not self.agent:
            raise ConfigError("expected the agent to run, as 'package.module:function', got none", file=file,
                              field=f"{prefix}.agent")


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
    yield RewardFunction(name="toy_permutation", impl="milehpc.data.tasks:toy_permutation",
                         description="toy tasks: 1 if the answer has exactly the label's digits, in any order")


@hookimpl
def milehpc_generators() -> Iterator[Generator]:
    yield Generator(name="toy_retry", impl="milehpc.rollout.multiturn:retry_generator",
                    schema=RetryParams,
                    description="multi-turn toy environment: wrong answers get feedback and another try")
    yield Generator(name="agent", impl="milehpc.rollout.agent:agent_generator", schema=AgentParams,
                    description="your OpenAI-client agent (async run(client, sample)) against this rank's "
                                "endpoint, recorded token-in/token-out")

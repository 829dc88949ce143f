"""Built-in rewards (registered like any third-party plugin). The toy tasks' own rewards are registered with
the tasks (``milehpc.builtin.tasks``) and can reuse :mod:`milehpc.rewards.functions`."""

from __future__ import annotations

import re
import string
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
    gate: str = opt("", help="an earlier reward of the list: this one is computed only where that one scored "
                             "above 0 (e.g. the judge only where the format is right); elsewhere it counts 0")

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
        for i, part in enumerate(self.rewards):
            earlier = [p.name for p in self.rewards[:i]]
            if part.gate and part.gate not in earlier:
                raise ConfigError(f"expected an earlier reward of the list ({', '.join(earlier) or 'none'}), got "
                                  f"{part.gate!r}", file=file, field=f"{prefix}.rewards[{i}].gate")


# The model rewards' parameters (milehpc.rewards.model_scorers, milehpc.rollout.judge), declared here for the same
# reason: checking a job spec must not import torch or transformers.
TEMPLATE_FIELDS = ("prompt", "response", "label")


@dataclass
class ClassifierParams:
    path: str = opt(pattern=r".+", expect="a local folder of an HF sequence-classification model",
                    help="folder that AutoModelForSequenceClassification and AutoTokenizer load")
    batch_size: int = opt(32, min=1, help="samples per forward pass")
    chat_template: bool = opt(True, help="score the chat template of [user: prompt, assistant: response] when the "
                                         "RM's tokenizer has one (else prompt + response as text)")
    label_index: int = opt(0, min=0, help="the logit read as the score (an RM with one label: 0)")
    normalize: Literal["none", "sigmoid", "standard"] = opt(
        "none", help="sigmoid: map the logit to (0, 1); standard: (logit - mean) / std")
    mean: float = opt(0.0, help="normalize = standard: the RM's mean logit")
    std: float = opt(1.0, min=1e-12, help="normalize = standard: the RM's logit spread")
    max_length: int = opt(0, min=0, help="cut longer inputs from the left to this many tokens; 0 = no cut")
    retries: int = opt(1, min=0, help="a batch whose forward pass fails is tried this many more times, then its "
                                      "samples fail (never scored 0)")
    device: str = opt("cpu", pattern=r"cpu|cuda(:\d+)?", expect="cpu, cuda or cuda:N")


@dataclass
class JudgeParams:
    path: str = opt(pattern=r".+", expect="a local folder of an HF causal LM",
                    help="the judge model's folder (AutoModelForCausalLM)")
    tokenizer: str = opt("", help="the judge's tokenizer: a local folder or 'toy'; empty = path")
    engine: str = opt("reference", pattern=r"[A-Za-z0-9_.:-]+", expect="an engine plugin's name",
                      help="the engine plugin the judge generates on (reference: in this process; sglang, vllm: "
                           "their own processes, as on the rollout ranks)")
    engine_options: dict[str, Any] = opt({}, help="the engine's options, as rollout.options for that engine (e.g. "
                                                   "sglang: cpu_memory_gib, mem_fraction_static; vllm: kv_cache_gib)")
    template: str = opt("{prompt}{response}", help="the judge's prompt; fields {prompt}, {response}, {label}")
    chat_template: bool = opt(False, help="send the template's text as a user turn through the chat template")
    answer_pattern: str = opt(r"(-?\d+(?:\.\d+)?)", help="regular expression; its first group (else the whole "
                                                          "match) of the first match in the judge's answer")
    answer_map: dict[str, float] = opt({}, help="answer text -> score (e.g. {yes = 1, no = 0}); empty: the answer "
                                                "is read as a number")
    scale: float = opt(1.0, help="the score is the answer divided by this (e.g. 10 for a 0-10 grade)")
    max_new_tokens: int = opt(16, min=1)
    batch_size: int = opt(32, min=1, help="judge prompts per engine call")
    retries: int = opt(2, min=0, help="an answer that does not parse is asked again (sampled at "
                                      "retry_temperature) this many times, then the sample fails (never scored 0)")
    retry_temperature: float = opt(1.0, min=0.0)
    seed: int = opt(0, help="the judge's sampling stream")

    def validate(self, *, file: str | None, prefix: str) -> None:
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None]
        except ValueError as err:
            raise ConfigError(f"expected a format string, got {self.template!r} ({err})", file=file,
                              field=f"{prefix}.template") from None
        bad = [f for f in fields if f not in TEMPLATE_FIELDS]
        if bad:
            known = ", ".join("{" + f + "}" for f in TEMPLATE_FIELDS)
            raise ConfigError(f"unknown field {{{bad[0]}}} (expected {known})", file=file, field=f"{prefix}.template")
        if "response" not in fields:
            raise ConfigError("expected the field {response} in the judge's template", file=file,
                              field=f"{prefix}.template")
        try:
            re.compile(self.answer_pattern)
        except re.error as err:
            raise ConfigError(f"expected a regular expression, got {self.answer_pattern!r} ({err})", file=file,
                              field=f"{prefix}.answer_pattern") from None
        if self.scale == 0:
            raise ConfigError("expected a non-zero scale, got 0", file=file, field=f"{prefix}.scale")
        from milehpc.config.reward_model import check_judge_engine

        check_judge_engine(self.engine, self.engine_options, file=file, prefix=prefix)
        if self.engine != "reference":  # an engine plugin serves the families milehpc maps for it (the reference
            from milehpc.config.families import check_family, folder_model_type  # judge takes any causal LM)

            if (model_type := folder_model_type(self.path)) is not None:
                check_family(model_type, file=file, field=f"{prefix}.path")


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
                         description="weighted sum of other rewards: rewards = [{name, weight, params, gate}, ...]")
    yield RewardFunction(name="reward_model", impl="milehpc.rewards.model_scorers:reward_model", kind="batch",
                         schema=ClassifierParams,
                         description="a learned classifier RM (AutoModelForSequenceClassification, local folder)")
    yield RewardFunction(name="judge", impl="milehpc.rollout.judge:judge", kind="batch", schema=JudgeParams,
                         description="a generative judge on an engine plugin: template in, parsed grade out")

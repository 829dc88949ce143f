"""``code_tests`` (the dataset formats, partial credit, programs that cheat or hang) and the ``python_tool``
environment, both running programs in the real bubblewrap sandbox; a sandbox failure fails only its sample."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sandbox_battery import require_bwrap

from milehpc import plugins
from milehpc.config.job import RewardSpec
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import SandboxBackend
from milehpc.rewards import RewardRunner
from milehpc.rewards.code_cases import CALL, SCRIPT, STDIO, extract_code, parse_tests
from milehpc.rollout.engine import SamplingParams
from milehpc.rollout.python_tool import python_tool_generator
from milehpc.samples import Sample, Status
from milehpc.sandbox import choice
from milehpc.sandbox.bubblewrap import Bubblewrap
from milehpc.sandbox.types import SandboxError


@pytest.fixture(autouse=True)
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A run directory whose job.json picks the sandbox (the ranks read it the same way)."""
    (tmp_path / "job.json").write_text(json.dumps({"sandbox": {"backend": "bubblewrap"}}))
    monkeypatch.setenv("MILEHPC_RUN_DIR", str(tmp_path))
    choice.reset()
    yield tmp_path
    choice.reset()


def _sample(text: str, tests: Any) -> Sample:
    s = Sample(prompt_ids=[1], response_ids=[1], response_text=text)
    s.metadata["tests"] = tests
    return s


def test_the_common_dataset_formats_are_read() -> None:
    assert [c.kind for c in parse_tests({"inputs": ["1\n"], "outputs": ["2\n"]})] == [STDIO]
    assert parse_tests({"input": ["1"], "output": ["2"]})[0].stdin == "1"
    assert parse_tests('{"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"}')[0].kind == CALL
    assert len(parse_tests({"test_list": ["assert a", "assert b"], "test_setup_code": "x = 1"})) == 2
    assert parse_tests({"test": "def check(c): pass", "entry_point": "f"})[0].code.endswith("check(f)")
    assert [c.kind for c in parse_tests(["assert f(1) == 1", "assert f(2) == 2"])] == [SCRIPT, SCRIPT]
    assert parse_tests([{"input": "1", "output": "1"}])[0].kind == STDIO
    with pytest.raises(ValueError, match="expected tests"):
        parse_tests({"nothing": 1})
    assert extract_code("text\n```python\nx = 1\n```\nmore\n```py\ny = 2\n```") == "y = 2\n"


def test_code_tests_gives_the_fraction_passed_and_zero_to_cheats_and_hangs() -> None:
    require_bwrap()
    asserts = ["assert f([1,2])==3", "assert f([])==0", "assert f([7])==7", "assert f([5,-2])==3"]
    samples = [
        _sample("def f(a):return sum(a)", asserts),
        _sample("def f(a):return max(a)", asserts),  # passes only f([7])
        _sample("```python\nimport sys\nprint(int(input())*2)\n```", {"inputs": ["2\n", "5\n"], "outputs": ["4", "11"]}),
        _sample("class Solution:\n    def add(self, a, b):\n        return a + b\n",
                {"inputs": [[1, 2], [3, 4], [0, 0]], "outputs": [3, [7], 1], "fn_name": "add"}),
        _sample("def f(x):\n    return x\n", {"test": "def check(c):\n    assert c(1) == 1\n", "entry_point": "f"}),
        _sample("import sys\nsys.exit(0)\n", asserts),  # exits before the tests run
        _sample("import os\nos._exit(0)\n", asserts),  # no result line at all
        _sample("def f(a):\n    while True:\n        pass\n", asserts),  # each case hits its time limit
    ]
    runner = RewardRunner.from_spec(RewardSpec(name="code_tests", params={"case_timeout_s": 0.5, "cache": False}))
    metrics = runner.score(samples)
    assert [s.scalar_reward for s in samples] == [1.0, 0.25, 0.5, pytest.approx(2 / 3), 1.0, 0.0, 0.0, 0.0], [s.reward for s in samples]
    assert metrics["reward/failed"] == 0 and metrics["reward/all_passed"] == pytest.approx(2 / 8)


def test_a_malformed_forged_result_line_scores_zero_and_does_not_fail_the_sample() -> None:
    """A solution can print after the harness (atexit): a result line that does not parse is a wrong answer, not a
    sandbox failure (a FAILED sample would leave its group instead of being scored)."""
    require_bwrap()
    forger = ("import atexit, json, sys\nnonce = json.load(open('cases.json'))['nonce']\n"
              "atexit.register(lambda: sys.__stdout__.write(nonce + ' {not json\\n'))\ndef f(a):return sum(a)\n")
    honest = "def f(a):return sum(a)"
    samples = [_sample(forger, ["assert f([1,2])==3"]), _sample(honest, ["assert f([1,2])==3"])]
    metrics = RewardRunner.from_spec(RewardSpec(name="code_tests", params={"cache": False})).score(samples)
    assert [s.scalar_reward for s in samples] == [0.0, 1.0], [s.reward for s in samples]
    assert metrics["reward/failed"] == 0


class _Flaky:
    """Bubblewrap that cannot start for programs containing FAILME (a sandbox fault, as a broken mount is)."""

    def __init__(self, **params: Any) -> None:
        self.inner, self.name, self.python = Bubblewrap(**params), "flaky", "python3"

    def run(self, argv: list[str], **kw: Any) -> Any:
        if any("FAILME" in str(v) for v in (kw.get("files") or {}).values()):
            raise SandboxError("sandbox 'flaky' could not start the program")
        return self.inner.run(argv, **kw)


class _FlakyPlugin:
    @hookimpl
    def milehpc_sandboxes(self) -> Iterator[SandboxBackend]:
        yield SandboxBackend(name="flaky", impl=_Flaky)


@pytest.fixture
def flaky(run_dir: Path) -> Iterator[None]:
    plugins.register(_FlakyPlugin(), name="flaky-sandbox")
    (run_dir / "job.json").write_text(json.dumps({"sandbox": {"backend": "flaky"}}))
    choice.reset()
    yield
    plugins.reset_plugin_manager()


def test_a_sandbox_failure_marks_only_its_sample(flaky: None) -> None:
    require_bwrap()
    samples = [_sample("def f(a):return a  # FAILME", ["assert f(1)==1"]), _sample("def f(a):return a", ["assert f(1)==1"])]
    metrics = RewardRunner.from_spec(RewardSpec(name="code_tests", params={"cache": False})).score(samples)
    assert samples[0].status is Status.FAILED and "could not start" in samples[0].metadata["reward_error"]
    assert samples[1].status is not Status.FAILED and samples[1].scalar_reward == 1.0
    assert metrics["reward/failed"] == 1


class _Scripted:
    """A policy that answers from a script: turn k of every sample is ``turns[k]`` (the engine is not under
    test here; the environment and its sandbox are)."""

    def __init__(self, turns: list[str]) -> None:
        from milehpc.data.tokenizer import CharTokenizer

        self.tokenizer, self.turns, self.calls = CharTokenizer(), turns, 0

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 samples: list[Sample] | None = None) -> list[Sample]:
        ids = self.tokenizer.encode(self.turns[self.calls])
        self.calls += 1
        if samples is None:
            samples = [Sample(prompt_ids=p, group=g) for g, p in enumerate(prompts) for _ in range(sampling.n)]
        for s in samples:
            s.response_ids += ids
            s.loss_mask += [1] * len(ids)
            s.rollout_logprobs += [-0.5] * len(ids)
        return samples


def test_the_python_tool_runs_the_call_in_the_sandbox_and_the_output_is_an_observation() -> None:
    require_bwrap()
    from milehpc.data.source import Prompt

    engine = _Scripted(["<py>print(6*7)<end>", "<py>open(chr(47)+chr(101)+chr(116)+chr(99)+chr(47)+chr(115)+chr(104)+chr(97)+chr(100)+chr(111)+chr(119))<end>", "42"])
    out = python_tool_generator(engine, [Prompt([1], "q", None, 0)], SamplingParams(n=2), max_turns=3,
                                open_tag="<py>", close_tag="<end>", output_open="<out>", output_close="<ou>")
    assert len(out) == 2 and engine.calls == 3
    s = out[0]
    assert s.response_text.startswith("<py>print(6*7)<end><out>42<ou>"), s.response_text
    assert "such file or directory: etcshadow<ou>42" in s.response_text, s.response_text  # /etc/shadow is absent
    obs = s.response_text.index("<out>")
    assert s.loss_mask[obs:obs + len("<out>42<ou>")] == [0] * len("<out>42<ou>")  # not trained on
    assert s.loss_mask[:obs] == [1] * obs and s.loss_mask[-2:] == [1, 1]
    assert s.metadata["tool_calls"] == 2 and s.reward is None  # the job's reward scores it afterwards


def test_a_verdict_from_a_wall_clock_kill_is_not_cached() -> None:
    """A program killed at the wall-clock limit may pass on a quieter node: only results it reached by itself are
    kept (the cache assumes programs are pure)."""
    require_bwrap()
    from milehpc.rewards import code_tests as ct

    ct._CACHE.clear()
    echo = {"inputs": ["1\n"], "outputs": ["1"]}  # stdin/stdout: the program runs alone, under the wall limit
    hang = _sample("import time\ntime.sleep(60)\n", echo)  # sleeps: wall clock, not CPU time
    quick = _sample("print(input())\n", echo)
    runner = RewardRunner.from_spec(RewardSpec(name="code_tests", params={"wall_s": 1.0, "case_timeout_s": 0.5}))
    runner.score([hang, quick])
    assert [s.scalar_reward for s in (hang, quick)] == [0.0, 1.0]
    assert [v["score"] for v in ct._CACHE.values()] == [1.0]  # the quick one only

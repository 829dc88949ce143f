"""RewardRunner: selection by name or module:function with validated params, sample/group/batch kinds, async
concurrency and timeouts, and failures that mark samples FAILED instead of killing the run."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from milehpc.config.job import RewardSpec
from milehpc.config.load import job_from_dict
from milehpc.errors import ConfigError, PluginError
from milehpc.rewards.api import RewardRunner
from milehpc.samples import Sample, Status
from milehpc.samples.batch import to_batch

CUSTOM = '''
import asyncio
import math
from milehpc.rewards import reward_kind

IN_FLIGHT = {"now": 0, "max": 0}

def length(sample, scale=1.0):
    return scale * len(sample.response_text)

def picky(sample):
    if sample.response_text == "boom":
        raise RuntimeError("reward server said no")
    if sample.response_text == "nan":
        return math.nan
    if sample.response_text == "str":
        return "high"
    if sample.response_text == "nodict":
        return {"fmt": 1.0}
    return 1.0

async def slow(sample, delay=0.05):
    IN_FLIGHT["now"] += 1
    IN_FLIGHT["max"] = max(IN_FLIGHT["max"], IN_FLIGHT["now"])
    await asyncio.sleep(delay if sample.response_text != "hang" else 30)
    IN_FLIGHT["now"] -= 1
    return {"score": 1.0, "latency": delay}

@reward_kind("group")
def rank_in_group(samples):
    # 1 for the longest response of the group, 0 for the others; a group of 3 is "broken"
    if len(samples) == 3:
        return [1.0]
    longest = max(len(s.response_text) for s in samples)
    return [float(len(s.response_text) == longest) for s in samples]

@reward_kind("batch")
def batch_mean_centered(samples):
    lens = [len(s.response_text) for s in samples]
    mean = sum(lens) / len(lens)
    return [x - mean for x in lens]
'''


@pytest.fixture
def custom(tmp_path, monkeypatch):
    name = f"milehpc_test_rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(CUSTOM))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def samples(*texts, groups=None, labels=None):
    return [Sample(prompt_ids=[1], response_ids=[2, 3], response_text=t, group=(groups or [0] * len(texts))[i],
                   label=(labels or [None] * len(texts))[i], index=i) for i, t in enumerate(texts)]


def test_registered_reward_from_a_job_spec_with_params():
    job = job_from_dict({"name": "t", "reward": {"name": "exact_match", "params": {"case_sensitive": False}}})
    runner = RewardRunner.from_spec(job.reward)
    ss = samples("Yes", "no", labels=["yes", "yes"])
    m = runner.score(ss)
    assert [s.reward for s in ss] == [1.0, 0.0]
    assert m["reward/mean"] == 0.5 and m["reward/failed"] == 0.0 and m["reward/count"] == 2.0


def test_task_reward_is_the_default_and_params_still_apply():
    runner = RewardRunner.from_spec(RewardSpec(params={"stop": ";"}), task_reward="exact_match")
    ss = samples("12;xx", labels=["12"])
    runner.score(ss)
    assert ss[0].reward == 1.0
    with pytest.raises(ConfigError, match="reward.name: no reward"):
        RewardRunner.from_spec(RewardSpec(), task_reward=None, file="job.toml")


@pytest.mark.parametrize(("spec", "error", "text"), [
    (RewardSpec(name="exact_mach"), PluginError, "job.toml: reward.name: unknown reward 'exact_mach' (expected one of:"),
    (RewardSpec(name="exact_match", params={"strip": "yes"}), ConfigError, "reward.params.strip: expected true or false"),
    (RewardSpec(name="exact_match", params={"fuzzy": True}), ConfigError, "reward.params.fuzzy: unknown parameter"),
    (RewardSpec(name="no_such_module_xyz:fn"), PluginError, "reward.name: cannot load reward 'no_such_module_xyz:fn'"),
    (RewardSpec(name="milehpc.rewards.functions:nope"), PluginError, "cannot load reward"),
])
def test_bad_reward_specs_are_one_line_errors(spec, error, text):
    with pytest.raises(error) as info:
        RewardRunner.from_spec(spec, file="job.toml")
    assert text in str(info.value) and "\n" not in str(info.value)


def test_module_function_reward_with_checked_params(custom):
    runner = RewardRunner.from_spec(RewardSpec(name=f"{custom}:length", params={"scale": 0.5}))
    ss = samples("abcd", "ab")
    runner.score(ss)
    assert [s.reward for s in ss] == [2.0, 1.0]
    with pytest.raises(ConfigError, match=r"reward.params.size: unknown parameter of reward .* \(expected one of: scale\)"):
        RewardRunner.from_spec(RewardSpec(name=f"{custom}:length", params={"size": 2}))


def test_a_raising_or_invalid_reward_fails_only_its_samples(custom):
    runner = RewardRunner.from_spec(RewardSpec(name=f"{custom}:picky"))
    ss = samples("ok", "boom", "nan", "str", "nodict", "fine")
    m = runner.score(ss)
    assert [s.status for s in ss] == [Status.COMPLETED] + [Status.FAILED] * 4 + [Status.COMPLETED]
    assert m["reward/failed"] == 4.0 and m["reward/count"] == 2.0 and m["reward/mean"] == 1.0
    assert ss[1].metadata["reward_error"] == "RuntimeError: reward server said no"
    assert "not finite" in ss[2].metadata["reward_error"]
    assert "score" in ss[4].metadata["reward_error"]
    assert ss[1].reward is None
    # The failed samples train on nothing.
    batch = to_batch(ss, 0)
    assert batch.response_mask.sum(-1).tolist() == [2.0, 0.0, 0.0, 0.0, 0.0, 2.0]


def test_already_failed_samples_are_not_scored():
    ss = samples("a", "b", labels=["a", "a"])
    ss[1].status = Status.FAILED
    m = RewardRunner.from_spec(RewardSpec(name="exact_match")).score(ss)
    assert ss[0].reward == 1.0 and ss[1].reward is None and m["reward/skipped"] == 1.0


def test_async_rewards_run_concurrently_bounded_by_max_concurrency(custom):
    import importlib

    mod = importlib.import_module(custom)
    runner = RewardRunner.from_spec(RewardSpec(name=f"{custom}:slow", max_concurrency=3))
    ss = samples(*["x"] * 10)
    m = runner.score(ss)
    assert all(s.reward == {"score": 1.0, "latency": 0.05} for s in ss)
    assert mod.IN_FLIGHT["max"] == 3  # overlapping calls, never more than the bound
    assert m["reward/latency"] == pytest.approx(0.05)


def test_async_timeout_marks_the_sample_failed(custom):
    runner = RewardRunner.from_spec(RewardSpec(name=f"{custom}:slow", timeout_s=0.2))
    ss = samples("x", "hang")
    m = runner.score(ss)
    assert ss[0].status is Status.COMPLETED and ss[1].status is Status.FAILED
    assert "took longer than 0.2 s" in ss[1].metadata["reward_error"] and m["reward/failed"] == 1.0


def test_group_reward_sees_each_group_and_a_broken_group_fails_whole(custom):
    runner = RewardRunner.from_spec(RewardSpec(name=f"{custom}:rank_in_group"))
    assert runner.kind == "group"
    ss = samples("a", "abc", "ab", "x", "y", "z", groups=[0, 0, 0, 1, 1, 1])
    ss[5].group = 2  # group 1 now has 2 samples, group 0 has 3 (broken), group 2 has 1
    m = runner.score(ss)
    assert [s.status for s in ss[:3]] == [Status.FAILED] * 3
    assert "returned 1 values for 3 samples" in ss[0].metadata["reward_error"]
    assert [s.reward for s in ss[3:]] == [1.0, 1.0, 1.0]
    assert m["reward/failed"] == 3.0


def test_batch_reward_sees_all_samples(custom):
    runner = RewardRunner.from_spec(RewardSpec(name=f"{custom}:batch_mean_centered"))
    ss = samples("a", "abc")
    runner.score(ss)
    assert [s.reward for s in ss] == [-1.0, 1.0]


def test_builtin_group_reward_by_name():
    runner = RewardRunner.from_spec(RewardSpec(name="majority_vote"))
    ss = samples("7", "7", "8", groups=[0, 0, 0])
    runner.score(ss)
    assert [s.scalar_reward for s in ss] == [1.0, 1.0, 0.0]


def test_score_works_inside_a_running_event_loop():
    runner = RewardRunner.from_spec(RewardSpec(name="exact_match"))
    ss = samples("a", labels=["a"])

    async def main():
        return runner.score(ss)

    assert asyncio.run(main())["reward/mean"] == 1.0


def test_combine_weighted_sum_of_rewards_from_a_job_spec():
    job = job_from_dict({"name": "t", "reward": {"name": "combine", "params": {"rewards": [
        {"name": "format", "weight": 0.5, "params": {"pattern": r"<answer>.*</answer>", "mode": "search"}},
        {"name": "math_answer", "params": {"extract": "answer_tag"}},
        {"name": "format", "weight": -1.0, "params": {"pattern": "sorry", "mode": "search"}},
    ]}}})
    runner = RewardRunner.from_spec(job.reward)
    ss = samples("<answer>4</answer>", "<answer>5</answer> sorry", "4", labels=["4", "4", "4"])
    m = runner.score(ss)
    assert [s.scalar_reward for s in ss] == [0.5 + 1.0, 0.5 + 0.0 - 1.0, 0.0]
    assert ss[0].reward == {"score": 1.5, "format": 0.5 / 0.5, "math_answer": 1.0, "format_2": 0.0}
    assert m["reward/math_answer"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(("rewards", "text"), [
    ([], "reward.params.rewards: expected at least one reward"),
    ([{"name": "exact_mach"}], "reward.params.rewards[0].name: unknown reward 'exact_mach'"),
    ([{"name": "format", "params": {"bogus": 1}}], "reward.params.rewards[0].params.bogus: unknown parameter"),
    ([{"name": "format", "weight": "high"}], "reward.params.rewards[0].weight: expected a number"),
    ([{"nam": "format"}], "reward.params.rewards[0].nam: unknown key (expected one of: gate, name, params, weight)"),
])
def test_combine_params_are_checked_when_the_spec_is_loaded(rewards, text):
    with pytest.raises((ConfigError, PluginError)) as info:
        RewardRunner.from_spec(RewardSpec(name="combine", params={"rewards": rewards}), file="job.toml")
    assert text in str(info.value) and str(info.value).startswith("job.toml: ")


def test_combine_fails_a_sample_that_a_component_fails_on(custom):
    runner = RewardRunner.from_spec(RewardSpec(name="combine", params={"rewards": [
        {"name": f"{custom}:picky"}, {"name": f"{custom}:length"}]}))
    ss = samples("ok", "boom")
    m = runner.score(ss)
    assert ss[0].reward == {"score": 1.0 + 2.0, f"{custom}:picky": 1.0, f"{custom}:length": 2.0}
    assert ss[1].status is Status.FAILED and "reward server said no" in ss[1].metadata["reward_error"]
    assert m["reward/failed"] == 1.0

"""The example third-party package plugins/milehpc-reward-example, installed through a real entry point (a
dist-info directory on sys.path, as pip would write it), is found by the plugin manager and selected by name
from a job spec."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from milehpc import plugins
from milehpc.config.load import job_from_dict
from milehpc.errors import ConfigError
from milehpc.rewards.api import RewardRunner
from milehpc.samples import Sample

EXAMPLE = Path(__file__).resolve().parents[1] / "plugins" / "milehpc-reward-example"


def _entry_point_group(pyproject: Path) -> str:
    import tomllib

    data = tomllib.loads(pyproject.read_text())
    (name, target), = data["project"]["entry-points"]["milehpc"].items()
    return f"[milehpc]\n{name} = {target}\n"


@pytest.fixture
def installed_example(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    info = site / "milehpc_reward_example-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: milehpc-reward-example\nVersion: 0.1.0\n")
    # The entry point exactly as the package's pyproject.toml declares it.
    (info / "entry_points.txt").write_text(_entry_point_group(EXAMPLE / "pyproject.toml"))
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("MILEHPC_NO_ENTRY_POINTS", raising=False)
    plugins.reset_plugin_manager()
    yield
    plugins.reset_plugin_manager()
    for name in [m for m in sys.modules if m.startswith("milehpc_reward_example")]:
        monkeypatch.delitem(sys.modules, name)


def test_example_plugin_is_listed_with_its_distribution(installed_example):
    entries = plugins.registry("reward")
    assert {"length_target", "keyword_async"} <= set(entries)
    entry = entries["length_target"]
    assert entry.plugin == "reward-example"
    assert entry.distribution.startswith("milehpc-reward-example ")
    assert entry.spec.defaults == {"target": 8, "width": 8}
    # Built-ins are still there, from milehpc's own entry points.
    assert entries["exact_match"].distribution.startswith("milehpc ")


def test_job_spec_selects_the_plugin_reward_by_name(installed_example):
    job = job_from_dict({"name": "t", "reward": {"name": "length_target", "params": {"target": 2, "width": 4}}},
                        file="job.toml")
    runner = RewardRunner.from_spec(job.reward, file="job.toml")
    ss = [Sample([1], [5, 6]), Sample([1], [5, 6, 7, 8, 9])]
    metrics = runner.score(ss)
    assert [s.reward for s in ss] == [1.0, 0.25]
    assert metrics["reward/failed"] == 0.0

    async_runner = RewardRunner.from_spec(
        job_from_dict({"name": "t", "reward": {"name": "keyword_async", "params": {"keyword": "because"}}}).reward)
    ss = [Sample([1], [2], response_text="yes because"), Sample([1], [2], response_text="no")]
    async_runner.score(ss)
    assert [s.scalar_reward for s in ss] == [1.0, 0.0]

    with pytest.raises(ConfigError, match="job.toml: reward.params.goal: unknown parameter"):
        RewardRunner.from_spec(job_from_dict({"name": "t", "reward": {"name": "length_target",
                                                                       "params": {"goal": 3}}}).reward, file="job.toml")


def test_without_the_package_the_name_is_unknown():
    plugins.reset_plugin_manager()
    if "length_target" in plugins.registry("reward"):
        pytest.skip("the example plugin is pip-installed in this environment")
    from milehpc.config.job import RewardSpec
    from milehpc.errors import PluginError

    with pytest.raises(PluginError, match="unknown reward 'length_target'"):
        RewardRunner.from_spec(RewardSpec(name="length_target"))

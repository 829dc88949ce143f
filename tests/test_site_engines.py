"""The rollout engines a site's container image holds (``[partitions.P.containers.RUNTIME] engines``) against the job's
``rollout.engine`` (milehpc.config.rules.engine_is_in_the_container): a containerised job whose engine the image lacks
is refused on the login node by ``plan``, ``submit`` and ``doctor`` in one line naming the job file, the field and the
engines the image has, before it queues. Run on the shipped frontier-like site (its ROCm image holds vLLM, no SGLang)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from example_inputs import frontier_sets

from milehpc.cli import cli
from milehpc.config.load import job_from_dict, load_site
from milehpc.config.rules import engine_is_in_the_container as rule
from milehpc.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
FRONTIER = ROOT / "examples" / "frontier-grpo.toml"
FRONTIER_ENGINES = "vllm, reference, reference_process"  # site-configs/frontier-like.toml
REFUSED = ("rollout.engine: expected an engine the site's apptainer image has (site field containers.apptainer.engines"
           f" = {FRONTIER_ENGINES}; an image with other engines: restate the list in the job's "
           "[site.containers.apptainer] engines), got 'sglang'")


def _cli(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, [*args, *(a for s in frontier_sets() for a in ("--set", s))])
    return res.exit_code, res.output


def _job(engine: str, *, image: str | None = "/images/rocm.sif", site: dict | None = None):
    return job_from_dict({"name": "eng", "rollout": {"engine": engine}, "container": {"image": image},
                          "site": site or {}}, file="eng.toml")


@pytest.mark.parametrize("command", [("plan", "--force"), ("submit", "--dry-run")])
def test_plan_and_submit_refuse_an_engine_the_sites_image_lacks(command: tuple[str, ...]) -> None:
    code, out = _cli(command[0], str(FRONTIER), "--site", "frontier-like", command[1], "--set", "rollout.engine='sglang'",
                     "--set", "rollout.options={}")  # (the example's options are its vLLM engine's)
    assert code == 2, out
    assert out.strip().splitlines() == [f"milehpc: error: {FRONTIER} (with --set): {REFUSED}"]


def test_doctor_fails_the_job_with_the_same_line(tmp_path: Path) -> None:
    from milehpc.doctor import FAIL, Doctor

    job = tmp_path / "sglang-on-frontier.toml"
    text = FRONTIER.read_text()
    assert 'engine = "vllm"' in text  # the example runs the engine its site's image has
    job.write_text(text.replace('engine = "vllm"', 'engine = "sglang"'))
    fails = [f for f in Doctor("frontier-like", str(job), env={}).run() if f.check == "job-on-site"]
    assert [(f.level, f.message) for f in fails] == [(FAIL, f"{job}: {REFUSED}")]


def test_engines_the_image_has_pass_and_a_job_image_restates_its_own() -> None:
    for engine in ("vllm", "reference", "reference_process"):
        rule(_job(engine), load_site("frontier-like", _job(engine), "eng.toml")[1], "eng.toml")
    # A job bringing an SGLang image of its own (built from SGLang's ROCm image) says so in its [site] table.
    own = _job("sglang", site={"containers": {"apptainer": {"engines": ["sglang"]}}})
    _site, partition = load_site("frontier-like", own, "eng.toml")
    assert partition.containers["apptainer"].engines == ["sglang"]  # the job's list replaces the site's
    rule(own, partition, "eng.toml")
    with pytest.raises(ConfigError, match=r"^eng\.toml: rollout\.engine: .*engines = sglang; .*got 'vllm'$"):
        job = _job("vllm", site={"containers": {"apptainer": {"engines": ["sglang"]}}})
        rule(job, load_site("frontier-like", job, "eng.toml")[1], "eng.toml")


@pytest.mark.parametrize(("site", "image"), [("frontier-like", None), ("frontier-like", ""), ("dgx-h100-like", "/i.sif"),
                                             ("local", "/i.sif")])
def test_no_image_or_no_declared_list_is_not_checked(site: str, image: str | None) -> None:
    """Without a container the engine is the user's own environment's; a site that declares no list says nothing."""
    job = _job("sglang", image=image)
    rule(job, load_site(site, job, "eng.toml")[1], "eng.toml")


@pytest.mark.parametrize(("engines", "expected"), [(["vllm", "vllm"], "expected each engine once, got ['vllm', 'vllm']"),
                                                   (["v llm"], "expected a rollout engine name like vllm, got 'v llm'")])
def test_a_bad_engine_list_names_its_field(engines: list[str], expected: str) -> None:
    job = _job("vllm", site={"containers": {"apptainer": {"engines": engines}}})
    with pytest.raises(ConfigError) as err:
        load_site("frontier-like", job, "eng.toml")
    assert str(err.value).startswith(f"eng.toml: site.containers.apptainer.engines: {expected}"), str(err.value)


def test_spec_lists_the_field_a_job_restates() -> None:
    """``milehpc spec`` lists a job's [site] keys as the site partition's fields, the engine list among them."""
    import json

    res = CliRunner().invoke(cli, ["spec", "site.containers.NAME", "--json"])
    assert res.exit_code == 0, res.output
    (row,) = [r for r in json.loads(res.output) if r["name"] == "site.containers.NAME.engines"]
    assert row["default"] == "[]" and "refused on the login node" in row["help"], row


def test_every_engine_a_shipped_site_declares_is_registered() -> None:
    """A misspelt name in a site file would refuse every job that asks for the engine the image really has."""
    import tomllib

    from milehpc import plugins

    declared = {(site.stem, name) for site in (ROOT / "site-configs").glob("*.toml")
                for part in tomllib.loads(site.read_text())["partitions"].values()
                for platform in part.get("containers", {}).values() for name in platform.get("engines", [])}
    assert ("frontier-like", "vllm") in declared
    assert {name for _site, name in declared} <= set(plugins.registry("engine")), declared

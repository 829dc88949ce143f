"""Plugin parameter schemas and finite numbers (issue 20): every plugin that takes parameters declares them like a
table of the job spec, the login node refuses a bad one in one line wherever a job is accepted, `milehpc plugins
show` prints the schema, and no float field takes NaN or ±inf."""

from __future__ import annotations

import dataclasses
import math
import types
from pathlib import Path
from typing import Union, get_args, get_origin, get_type_hints

import pytest
from click.testing import CliRunner

from milehpc import plugins
from milehpc.cli import cli
from milehpc.config.job import JobSpec
from milehpc.config.load import job_from_dict
from milehpc.config.schema import build, check_params, opt
from milehpc.config.site import Partition, Site
from milehpc.errors import ConfigError
from milehpc.plugin_types import KINDS, Task

VALID_JOB = Path(__file__).parent / "corpus" / "valid-job.toml"
# Kinds whose plugins take parameters from the job spec (sites and containers are configured elsewhere).
PARAM_KINDS = [k for k in KINDS if k not in ("site", "container")]


def test_every_plugin_with_parameters_declares_a_schema() -> None:
    missing = [f"{kind}:{name}" for kind in PARAM_KINDS for name, entry in plugins.registry(kind).items()
               if entry.spec.defaults and entry.spec.schema is None]
    assert not missing, f"declare schema=<dataclass of opt fields> for: {missing}"


def test_defaults_come_from_the_schema() -> None:
    spec = plugins.lookup("task", "sort")
    assert spec.defaults == {"min_len": 4, "max_len": 5, "size": 1_000_000}


ISSUE_EXAMPLES = [("data.params.min_len=\"12\"", "data.params.min_len: expected an integer, got str '12'"),
                  ("data.params.max_len=[1,2]", "data.params.max_len: expected an integer, got list [1, 2]")]


@pytest.mark.parametrize(("override", "expect"), ISSUE_EXAMPLES)
@pytest.mark.parametrize("command", ["plan", "render", "submit", "run"])
def test_every_command_refuses_a_bad_task_parameter(command: str, override: str, expect: str, tmp_path: Path) -> None:
    args = [command, str(VALID_JOB), "--site", "local", "--set", override]
    if command in ("submit", "run"):
        args += ["--run-dir", str(tmp_path / "run")]
    if command == "submit":
        args.append("--dry-run")
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0] and "(with --set)" in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


def test_schema_params_are_converted_and_completed() -> None:
    spec = plugins.lookup("reward", "math_answer")
    out = check_params(spec, {"tolerance": 1}, file="j", prefix="reward.params")
    assert out["tolerance"] == 1.0 and isinstance(out["tolerance"], float) and out["extract"] == "auto"
    combine = check_params(plugins.lookup("reward", "combine"), {"rewards": [{"name": "format"}]}, file="j",
                           prefix="reward.params")
    assert combine == {"rewards": [{"name": "format", "weight": 1.0, "params": {}, "gate": ""}]}  # plain tables for the ranks


def test_a_plugin_without_a_schema_is_checked_by_its_defaults_types() -> None:
    legacy = Task(name="legacy", impl="x:y", defaults={"n": 1, "w": 0.5})
    assert check_params(legacy, {"w": 2}, file="j", prefix="data.params") == {"n": 1, "w": 2.0}
    for bad, text in (({"n": "1"}, "data.params.n: expected an integer"), ({"w": math.nan}, "expected a finite"),
                      ({"m": 1}, "data.params.m: unknown parameter")):
        with pytest.raises(ConfigError, match=text):
            check_params(legacy, bad, file="j", prefix="data.params")


def test_a_schema_must_be_a_dataclass() -> None:
    with pytest.raises(TypeError, match="schema must be a dataclass"):
        Task(name="t", impl="x:y", schema=dict)


def test_plugins_show_prints_the_schema() -> None:
    result = CliRunner().invoke(cli, ["plugins", "show", "sort"])
    assert result.exit_code == 0, result.output
    assert "task sort" in result.stdout
    assert "min_len: an integer = 4; >= 1, <= 64  shortest digit string" in result.stdout
    shown = CliRunner().invoke(cli, ["plugins", "show", "loss:ppo_clip", "--json"])
    (entry,) = __import__("json").loads(shown.stdout)
    assert [r["name"] for r in entry["parameters"]] == ["clip_low", "clip_high", "clip_ratio_c"]
    missing = CliRunner().invoke(cli, ["plugins", "show", "nosuch"])
    assert missing.exit_code == 2 and missing.stderr.strip().splitlines() == [
        "milehpc: error: NAME: no plugin named 'nosuch' (see `milehpc plugins`)"]
    assert CliRunner().invoke(cli, ["plugins"]).exit_code == 0  # the listing is still the bare command


# ---- finite numbers ---------------------------------------------------------------------------------------------

def _float_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Every field typed float (or float | None) in a dataclass tree, with its dotted path."""
    out = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, path = hints[f.name], f"{prefix}{f.name}"
        args = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)
        if float in args:
            out.append((path, f))
        for arg in args:
            if dataclasses.is_dataclass(arg):
                out += _float_fields(arg, f"{path}.")
    return out


def _nest(path: str, value: object) -> dict:
    data: dict = {}
    node = data
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return data


JOB_FLOATS = _float_fields(JobSpec)


def test_the_job_spec_has_float_fields_to_check() -> None:
    names = [p for p, _ in JOB_FLOATS]
    assert {"rollout.temperature", "trainer.lr", "run.target_reward"} <= set(names), names


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(("path", "f"), JOB_FLOATS, ids=[p for p, _ in JOB_FLOATS])
def test_every_job_float_field_refuses_nonfinite(path: str, f: dataclasses.Field, value: float) -> None:
    if f.metadata.get("nonfinite"):
        assert f.metadata.get("help"), f"{path} allows NaN/inf: its help must say what they mean"
        return
    with pytest.raises(ConfigError) as info:
        job_from_dict({"name": "f", **_nest(path, value)}, file="job.toml")
    assert str(info.value) == f"job.toml: {path}: expected a finite number, got {value!r}"


PARTITION_FLOATS = _float_fields(Partition)


def test_the_site_has_float_fields_to_check() -> None:
    assert "devices.memory_gib" in [p for p, _ in PARTITION_FLOATS]
    assert not _float_fields(Site), "a float at the site's top level: check it here too"


@pytest.mark.parametrize(("path", "f"), PARTITION_FLOATS, ids=[p for p, _ in PARTITION_FLOATS])
def test_every_site_float_field_refuses_nan(path: str, f: dataclasses.Field) -> None:
    with pytest.raises(ConfigError) as info:
        build(Partition, _nest(path, math.nan), file="site.toml", prefix="partitions.p")
    assert str(info.value) == f"site.toml: partitions.p.{path}: expected a finite number, got nan"


def test_a_field_that_documents_infinity_may_take_it() -> None:
    @dataclasses.dataclass
    class Limits:
        budget: float = opt(1.0, nonfinite=True, help="inf = no limit")

    assert build(Limits, {"budget": math.inf}).budget == math.inf
    assert math.isnan(build(Limits, {"budget": math.nan}).budget)


def test_nonfinite_inside_free_form_tables_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        job_from_dict({"name": "f", "site": {"x": [1.0, math.inf]}}, file="job.toml")
    assert str(info.value) == "job.toml: site.x[1]: expected a finite number, got inf"

"""The broken-config corpus (tests/corpus/): every broken job spec and site config, run through the real CLI
(`milehpc plan` and `milehpc submit --dry-run`), must fail with exit code 2 and ONE line on stderr that
contains the case's expected text, never a traceback. See tests/corpus/README.md for the file header."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from milehpc import plugins
from milehpc.cli import cli
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import SiteConfig

CORPUS = Path(__file__).parent / "corpus"
VALID_JOB = CORPUS / "valid-job.toml"
JOB_CASES = sorted((CORPUS / "jobs").glob("*.toml"))
SITE_CASES = sorted((CORPUS / "sites").glob("*.toml"))
SHIPPED_SITES = ["local", "local-slurm", "frontier-like", "perlmutter-like", "dgx-h100-like"]


def header(path: Path) -> dict[str, list[str]]:
    """The leading `# key: value` lines of a corpus file."""
    out: dict[str, list[str]] = {}
    # Bytes decoded leniently: the encoding cases (toml-latin1) are not UTF-8 past their ASCII header.
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        match = re.fullmatch(r"#\s*([a-z-]+):\s?(.*)", line)
        if not match:
            break
        out.setdefault(match[1], []).append(match[2])
    return out


def commands(job: Path, site: str, sets: list[str], run_dir: Path) -> list[list[str]]:
    overrides = [arg for s in sets for arg in ("--set", s)]
    return [
        ["plan", str(job), "--site", site, *overrides],
        ["submit", str(job), "--site", site, "--dry-run", "--run-dir", str(run_dir), *overrides],
    ]


def assert_one_line_error(result, expect: str, args: list[str]) -> None:
    where = f"milehpc {' '.join(args)}"
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        f"{where} raised {result.exception!r}")
    assert result.exit_code == 2, f"{where}: exit {result.exit_code}\n{result.output}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"{where}: expected one line on stderr, got:\n{result.stderr}"
    assert expect in lines[0], f"{where}: expected {expect!r} in\n{lines[0]}"
    assert "Traceback" not in result.output


def skip_if_unregistered(head: dict[str, list[str]]) -> None:
    for kind in head.get("skip-unless-registered", []):
        if not plugins.registry(kind):
            pytest.skip(f"no {kind} plugin registered yet")


class CorpusSites:
    """A plugin that registers every corpus site as `corpus-<stem>` (how a centre's plugin would)."""

    @hookimpl
    def milehpc_sites(self):
        for path in SITE_CASES:
            yield SiteConfig(name=f"corpus-{path.stem}", impl=str(path))


@pytest.fixture
def corpus_sites():
    plugins.reset_plugin_manager()
    plugins.register(CorpusSites(), name="corpus-sites")
    yield
    plugins.reset_plugin_manager()


# ---- the corpus is well-formed, and its baseline is valid -----------------------------------------------

@pytest.mark.parametrize("path", JOB_CASES + SITE_CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_case_says_what_it_expects(path: Path) -> None:
    expect = header(path).get("expect", [""])
    assert len(expect) == 1 and expect[0].strip(), f"{path} needs one '# expect: ...' first line"


def test_corpus_is_not_trivially_small() -> None:
    assert len(JOB_CASES) >= 40 and len(SITE_CASES) >= 20


@pytest.mark.parametrize("site", SHIPPED_SITES)
def test_valid_job_passes_on_every_shipped_site(site: str, tmp_path: Path) -> None:
    """The cases break one thing of a job like this; it must pass, so their failures are theirs."""
    for args in commands(VALID_JOB, site, [], tmp_path / "run"):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, f"milehpc {' '.join(args)}\n{result.output}"
    assert not (tmp_path / "run").exists(), "a dry run must not write the run directory"


# ---- broken job specs (and --set overrides) ----------------------------------------------------------

@pytest.mark.parametrize("path", JOB_CASES, ids=lambda p: p.stem)
def test_broken_job(path: Path, tmp_path: Path) -> None:
    head = header(path)
    skip_if_unregistered(head)
    site = head.get("site", ["local"])[0]
    for args in commands(path, site, head.get("set", []), tmp_path / "run"):
        result = CliRunner().invoke(cli, args)
        assert_one_line_error(result, head["expect"][0], args)
        if not any(where in result.stderr for where in (str(path), "--set", "--site", "job [site]")):
            if "known-gap" in head:
                pytest.xfail(head["known-gap"][0])
            pytest.fail(f"the error names neither the job file nor the option it comes from: {result.stderr}")
    assert not (tmp_path / "run").exists()


# ---- broken site configs, registered by a plugin like a centre's own ------------------------------------

@pytest.mark.parametrize("path", SITE_CASES, ids=lambda p: p.stem)
def test_broken_site(path: Path, tmp_path: Path, corpus_sites) -> None:
    head = header(path)
    for args in commands(VALID_JOB, f"corpus-{path.stem}", [], tmp_path / "run"):
        result = CliRunner().invoke(cli, args)
        assert_one_line_error(result, head["expect"][0], args)
        assert str(path) in result.stderr or str(VALID_JOB) in result.stderr


def test_broken_site_is_reported_by_sites_show(corpus_sites) -> None:
    result = CliRunner().invoke(cli, ["sites", "show", "corpus-enum-vendor"])
    assert_one_line_error(result, "devices.vendor: expected one of", ["sites", "show"])


def test_job_site_table_is_validated_as_a_partition(tmp_path: Path) -> None:
    """`[site]` in a job overrides the partition; what it produces is validated like a site file."""
    job = tmp_path / "job.toml"
    job.write_text('name = "c"\n[site]\ncpus_per_task = 3\n[site.env]\nFOO = "bar"\n')
    result = CliRunner().invoke(cli, ["submit", str(job), "--site", "local", "--dry-run", "--run-dir",
                                      str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert "export FOO=bar" in result.stdout
    assert "export OMP_NUM_THREADS=1" in result.stdout, "the site's own env survives a job override"


# ---- the real process: exit status, stderr, no traceback ---------------------------------------------

@pytest.mark.parametrize("stem", ["type-tp-string", "hostile-name-subshell", "layout-tp-larger-than-node",
                                  "set-wrong-type"])
def test_broken_job_in_a_real_process(stem: str, tmp_path: Path) -> None:
    path = CORPUS / "jobs" / f"{stem}.toml"
    head = header(path)
    args = commands(path, head.get("site", ["local"])[0], head.get("set", []), tmp_path / "run")[1]
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "milehpc", *args], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and head["expect"][0] in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr

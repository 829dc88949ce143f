"""The login-node CLI through a real subprocess: help, versions, sites, plugins, plan, dry-run submit, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_JOB = ROOT / "tests" / "golden" / "job.toml"


def milehpc(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "milehpc", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_version_and_help_everywhere():
    from milehpc import __version__
    from milehpc.cli import cli

    assert milehpc("--version").stdout.strip().endswith(__version__)
    names = [[]]
    for name, cmd in cli.commands.items():
        names.append([name])
        for sub in getattr(cmd, "commands", {}):
            names.append([name, sub])
    for words in names:
        proc = milehpc(*words, "--help")
        assert proc.returncode == 0, (words, proc.stderr)
        assert "Usage:" in proc.stdout
        if words:  # every command shows an example
            assert "milehpc" in proc.stdout.split("Usage:")[1], words


def test_sites_list_and_show():
    proc = milehpc("sites", "list", "--json")
    names = {row["name"] for row in json.loads(proc.stdout)}
    assert {"local", "local-slurm", "frontier-like", "perlmutter-like", "dgx-h100-like"} <= names
    shown = json.loads(milehpc("sites", "show", "frontier-like", "--json").stdout)
    batch = shown["partitions"][shown["default_partition"]]
    assert batch["devices"]["count"] == 8 and batch["devices"]["vendor"] == "amd"
    assert shown["docs"], "a shipped site cites its user guide"


def test_plugins_lists_distribution_and_registrations():
    data = json.loads(milehpc("plugins", "--json").stdout)
    sites = data["builtin-sites"]
    assert sites["distribution"].startswith("milehpc ")
    assert "frontier-like" in sites["registers"]["site"]
    assert "milehpc_sites" in sites["hooks"]


def test_plan_json_counts():
    proc = milehpc("plan", str(GOLDEN_JOB), "--site", "local", "--json", "--ranks")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["plan"]["world_size"] == 4
    assert [r["role"] for r in data["ranks"]] == ["trainer", "trainer", "rollout", "rollout"]


def test_dry_run_writes_nothing(tmp_path):
    proc = milehpc("submit", str(GOLDEN_JOB), "--site", "local-slurm", "--dry-run", "--run-dir",
                   str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash")
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_render_never_overwrites(tmp_path):
    out = tmp_path / "job.sbatch"
    out.write_text("mine")
    proc = milehpc("render", str(GOLDEN_JOB), "--site", "local-slurm", "-o", str(out))
    assert proc.returncode == 2 and out.read_text() == "mine"
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, expect", [
    (["--set", "trainer.tp=9"], "trainer.tp"),
    (["--set", "trainer.lr=fast"], "trainer.lr: expected a number, got str 'fast'"),
    (["--set", "trainer.nope=1"], "trainer.nope: unknown key"),
    (["--set", "novalue"], "--set"),
    (["--site", "atlantis"], "unknown site 'atlantis'"),
])
def test_bad_input_is_one_line_exit_2(args, expect):
    proc = milehpc("plan", str(GOLDEN_JOB), *args) if "--site" in args else \
        milehpc("plan", str(GOLDEN_JOB), "--site", "local-slurm", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert expect in lines[0]


def test_missing_and_broken_files(tmp_path):
    proc = milehpc("plan", str(tmp_path / "nope.toml"), "--site", "local")
    assert proc.returncode == 2 and "file not found" in proc.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    proc = milehpc("plan", str(bad), "--site", "local")
    assert proc.returncode == 2 and "invalid TOML" in proc.stderr and str(bad) in proc.stderr


def test_login_commands_stay_light():
    probe = ("import sys\nfrom milehpc.cli import cli\n"
             f"cli.main(['submit', {str(GOLDEN_JOB)!r}, '--site', 'frontier-like', '--dry-run'], standalone_mode=False)\n"
             "heavy = [m for m in ('torch', 'mpi4py', 'sglang', 'megatron', 'transformers', 'h5py') if m in sys.modules]\n"
             "print('HEAVY', heavy)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


def test_completion_script():
    proc = milehpc("completion", "bash")
    assert proc.returncode == 0 and "_MILEHPC_COMPLETE" in proc.stdout

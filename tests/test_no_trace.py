"""The suite leaves no trace in the user's own state (issue 20): the job record `milehpc jobs` reads, the caches and
`runs/` are redirected into the session's temp dir by conftest (tests/no_trace.py) and compared at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import no_trace
from click.testing import CliRunner

from milehpc.cli import cli
from milehpc.scheduler.records import add_record, records_file


def test_a_submission_record_goes_to_the_session_temp_dir_not_the_users() -> None:
    before = no_trace.fingerprint(no_trace.USER["job record"])
    assert records_file().is_relative_to(no_trace.TEMP), records_file()
    add_record("local-0", "no-trace", "local", "/nonexistent/run")  # what `milehpc submit` does after sbatch
    listed = json.loads(CliRunner().invoke(cli, ["jobs", "--json"]).stdout)
    assert any(r["name"] == "no-trace" for r in listed)
    assert no_trace.fingerprint(no_trace.USER["job record"]) == before, "the user's own record changed"


def test_a_subprocess_inherits_the_redirection() -> None:
    """Ranks and CLI subprocesses read the environment, not conftest: they write into the temp dir too."""
    code = "from milehpc.scheduler.records import records_file; print(records_file())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=dict(os.environ))
    assert Path(out.stdout.strip()).is_relative_to(no_trace.TEMP)


def test_caches_go_to_the_session_temp_dir() -> None:
    """The compiled-template cache milehpc keeps per user is written under the temp dir (a render happens here)."""
    result = CliRunner().invoke(cli, ["render", str(Path(__file__).parent / "corpus" / "valid-job.toml"), "--site",
                                      "local"])
    assert result.exit_code == 0, result.output
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "milehpc" / "jinja"
    assert cache.is_relative_to(no_trace.TEMP) and any(cache.iterdir())


def test_the_users_job_record_is_unchanged_so_far() -> None:
    assert no_trace.changed(("job record",)) == []

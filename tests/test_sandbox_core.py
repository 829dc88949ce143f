"""The sandbox interface under bubblewrap (real bwrap), the choice of backend (job over site over default, the
refusal of ``none``), the per-process pool's bound, and the one-line config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from sandbox_battery import require_bwrap

from milehpc.errors import ConfigError
from milehpc.sandbox import choice
from milehpc.sandbox.bubblewrap import Bubblewrap
from milehpc.sandbox.types import Limits, SandboxError
from milehpc.sandbox.unsandboxed import Unsandboxed

REPO = Path(__file__).resolve().parent.parent


def test_a_program_gets_stdin_its_files_a_private_writable_tmp_and_an_unprivileged_uid() -> None:
    require_bwrap()
    prog = ("import os, sys\nopen('/tmp/scratch', 'w').write('ok')\n"
            "print(sys.stdin.read().upper(), open('data.txt').read(), os.getcwd(), os.getuid() != 0,\n"
            "      sorted(os.listdir('/')), os.environ.get('MILEHPC_SECRET_PROBE'))\nsys.exit(3)\n")
    os.environ["MILEHPC_SECRET_PROBE"] = "host-value"
    try:
        result = Bubblewrap().run(["python3", "prog.py"], stdin=b"hello", files={"prog.py": prog, "data.txt": "D"})
    finally:
        del os.environ["MILEHPC_SECRET_PROBE"]
    assert result.exit_code == 3 and result.stopped == "exited" and not result.ok, result.line()
    words = result.stdout.split(" ", 4)
    assert words[:4] == ["HELLO", "D", "/tmp", "True"], result.stdout
    root = eval(words[4].rsplit(" ", 1)[0])  # noqa: S307 - our own program's printed list
    assert "home" not in root and "root" not in root and "work" not in root, root  # the host's files are absent
    assert result.stdout.rstrip().endswith("None")  # the host's environment is not passed in


def test_a_sandbox_that_cannot_start_raises_instead_of_scoring_the_program() -> None:
    require_bwrap()
    with pytest.raises(SandboxError, match="not found"):
        Bubblewrap(bwrap="/nonexistent/bwrap").run(["python3", "-c", "pass"])
    with pytest.raises(SandboxError, match="could not start the program: bwrap: --size"):
        Bubblewrap().run(["python3", "-c", "pass"], limits=Limits(tmp_mb=0))  # bwrap refuses its own setup
    missing = Bubblewrap().run(["/nonexistent/program"])  # the program's own fault: a result, not an error
    assert missing.exit_code == 127 and missing.stopped == "exited", missing.line()


def test_the_job_overrides_the_site_and_the_default_is_bubblewrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert choice.resolve(None, None).backend == "bubblewrap"
    monkeypatch.setenv("SBX_HOME", "/images")
    site = {"backend": "apptainer", "image": "${SBX_HOME}/py.sif"}
    assert choice.resolve({}, site) == choice.Choice("apptainer", "/images/py.sif")
    assert choice.resolve({"backend": "bubblewrap", "workers": 3}, site).backend == "bubblewrap"
    (tmp_path / "job.json").write_text(json.dumps({"sandbox": {"image": "/other.sif", "params": {"flags": []}}}))
    (tmp_path / "site.json").write_text(json.dumps({"partition": {"sandbox": site}}))
    got = choice.from_run_dir(str(tmp_path))
    assert (got.backend, got.image, got.params) == ("apptainer", "/other.sif", {"flags": []})
    assert choice.build(got).image == "/other.sif"  # type: ignore[attr-defined]


def test_none_is_refused_unless_the_job_allows_it_and_params_are_checked() -> None:
    with pytest.raises(ConfigError, match="allow_unsandboxed = true") as err:
        choice.build(choice.Choice("none"))
    assert err.value.field == "sandbox.allow_unsandboxed"
    assert isinstance(choice.build(choice.Choice("none", allow_unsandboxed=True)), Unsandboxed)
    with pytest.raises(ConfigError, match="unknown parameter") as err:
        choice.build(choice.Choice("bubblewrap", params={"network": True}))
    assert err.value.field == "sandbox.params.network"


class _Counting:
    """The real sandbox, with a count of the runs in flight at once."""

    def __init__(self) -> None:
        self.inner, self.now, self.peak, self.lock = Bubblewrap(), 0, 0, threading.Lock()
        self.name, self.python = "counting", "python3"

    def run(self, argv, **kw):  # type: ignore[no-untyped-def]
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            return self.inner.run(argv, **kw)
        finally:
            with self.lock:
                self.now -= 1


def test_the_pool_runs_at_most_its_workers_at_once() -> None:
    require_bwrap()
    import asyncio

    sandbox = _Counting()
    pool = choice.Pool(sandbox, workers=2)  # type: ignore[arg-type]

    async def many() -> list[bool]:
        runs = [pool.arun(["python3", "-c", "import time; time.sleep(0.3)"], limits=Limits(wall_s=20))
                for _ in range(6)]
        return [r.ok for r in await asyncio.gather(*runs)]

    assert asyncio.run(many()) == [True] * 6
    assert sandbox.peak == 2


@pytest.mark.parametrize("text, field", [
    ('[sandbox]\nbackend = "none"\n', "sandbox.allow_unsandboxed"),
    ('[sandbox]\nworkers = -1\n', "sandbox.workers"),
    ('[site.sandbox]\nbackend = "none"\n', "sandbox.backend"),
    ('[sandbox]\nbackend = "firejail"\n', "sandbox.backend"),
    ('[sandbox]\nbackend = "bubblewrap"\nparams = { network = true }\n', "sandbox.params.network"),
    ('[sandbox]\nbackend = "bubblewrap"\nparams = { ro_binds = ["usr"] }\n', "sandbox.params.ro_binds"),
    # no backend: the site's (bubblewrap on `local`) is the one checked, on the login node
    ('[sandbox]\nparams = { uid = 0 }\n', "sandbox.params.uid"),
])
def test_a_bad_sandbox_setting_is_one_line_with_exit_code_2(tmp_path: Path, text: str, field: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text('name = "t"\n' + text)
    out = subprocess.run([sys.executable, "-m", "milehpc", "submit", str(job), "--site", "local", "--dry-run"],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2, out
    assert field in out.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, \
        out.stderr


@pytest.mark.parametrize("name", ["../escaped.txt", "/tmp/escaped.txt", "", ".."])
def test_a_file_name_that_is_not_plain_is_refused_before_anything_is_written(tmp_path: Path, name: str) -> None:
    """Backends that bind a host directory (apptainer, none) write the files there: a path must not leave it."""
    base = tmp_path / "base"
    base.mkdir()
    with pytest.raises(SandboxError, match="plain name"):
        Unsandboxed().run(["true"], files={name: "x"})
    with pytest.raises(SandboxError, match="plain name"):
        from milehpc.sandbox.process import host_dir

        with host_dir({name: "x"}, str(base)):
            pass
    assert list(base.iterdir()) == [] and not (tmp_path / "escaped.txt").exists()


def test_the_jobs_params_image_wins_over_the_sites_image() -> None:
    got = choice.resolve({"params": {"image": "/mine.sif"}}, {"backend": "apptainer", "image": "/site.sif"})
    assert choice.build(got).image == "/mine.sif"  # type: ignore[attr-defined]
    assert choice.build(choice.resolve({}, {"backend": "apptainer", "image": "/site.sif"})).image == "/site.sif"  # type: ignore[attr-defined]

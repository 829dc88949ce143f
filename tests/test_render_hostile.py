"""Hostile values in any string field of a job spec either get a one-line validation error or arrive verbatim in
the job and execute nothing. The launchers are recording shims (srun/mpirun/apptainer/module/scontrol that
write down their argv and environment): the script's own shell semantics are what is under test."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import typing
from pathlib import Path

import pytest

from milehpc.config.job import JobSpec
from milehpc.errors import ConfigError, MilehpcError
from milehpc.render.rundir import prepare

GOLDEN_JOB = Path(__file__).parent / "golden" / "job.toml"

PAYLOADS = [
    "; touch {pwn}",
    "$(touch {pwn})",
    "`touch {pwn}`",
    "'; touch {pwn}; '",
    '"; touch {pwn}; "',
    "x\ntouch {pwn}\n",
    "a b  c {pwn}",
    "$ {pwn} $( ${ `",
]

SHIM = r"""#!/bin/bash
# Recording stand-in for {name}: argv and environment as JSON lines.
python3 - "$@" <<'PY' >> "$SHIM_LOG"
import json, os, sys
print(json.dumps({{"tool": "{name}", "argv": sys.argv[1:], "env": dict(os.environ)}}))
PY
if [ "{name}" = "srun" ] || [ "{name}" = "mpirun" ]; then
    # run a `bash -c milehpc_rank` (container) command so the container wrapper is exercised too
    for i in "$@"; do if [ "$i" = "bash" ]; then shift_to=1; fi; done
    if [ -n "${{shift_to:-}}" ]; then
        while [ "$1" != "bash" ]; do shift; done
        exec "$@"
    fi
fi
# The ranks would report finishing (render.script.DONE_FILE); the stand-in does it for them.
touch "$MILEHPC_RUN_DIR/.milehpc/step-done"
exit 0
"""


def _string_fields(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from _string_fields(tp, path + ".")
        elif tp in (str, str | None):
            yield path


def _set(path: str, value: str) -> str:
    return f"{path}={json.dumps(value)}"


@pytest.fixture()
def shims(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("srun", "mpirun", "apptainer", "module", "scontrol"):
        exe = bindir / name
        exe.write_text(SHIM.format(name=name))
        exe.chmod(0o755)
    return bindir


def _run(script: str, tmp_path: Path, shims: Path) -> list[dict]:
    path = tmp_path / "job.sh"
    path.write_text(script)
    log = tmp_path / "shim.log"
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "SHIM_LOG": str(log),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n1"}
    proc = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


FIELDS = sorted(_string_fields(JobSpec))


def test_string_fields_are_found():
    assert {"name", "description", "container.image", "model.path", "data.source"} <= set(FIELDS)


@pytest.mark.parametrize("site", ["local-slurm", "frontier-like"])
@pytest.mark.parametrize("payload", PAYLOADS)
def test_hostile_values_with_recording_launcher_shims(site, payload, tmp_path, shims):
    pwn = tmp_path / "PWNED"
    value = payload.replace("{pwn}", str(pwn))
    overrides = [_set(f, value) for f in FIELDS if f not in ("name",)]
    # Fields that validate (names, times, enums) reject the value with one line; drop those and keep the rest.
    accepted = []
    for item in overrides:
        try:
            prepare(str(GOLDEN_JOB), site, (item,), run_dir=str(tmp_path / "run"))
        except MilehpcError as err:
            assert "\n" not in str(err)
            continue
        accepted.append(item)
    accepted += [_set("env.HOSTILE", value), _set("container.image", value)]
    script = prepare(str(GOLDEN_JOB), site, tuple(accepted), run_dir=str(tmp_path / "run")).script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    calls = _run(script, tmp_path, shims)
    assert not pwn.exists(), f"payload executed: {value!r}"
    container = [c for c in calls if c["tool"] == "apptainer"]
    assert container, calls
    # The image path and the environment value reach the container verbatim.
    argv = container[0]["argv"]
    assert argv[argv.index("python3") - 1] == value
    assert container[0]["env"]["APPTAINERENV_HOSTILE"] == value


def test_hostile_job_name_is_rejected_in_one_line():
    with pytest.raises(ConfigError) as err:
        prepare(str(GOLDEN_JOB), "local-slurm", ('name="x; rm -rf ~"',))
    assert "name" in str(err.value) and "\n" not in str(err.value)


def test_env_references_expand_but_commands_do_not(tmp_path, shims):
    """``${VAR}``/``$VAR`` in an env value is a reference (site configs use ${USER}); nothing else expands."""
    overrides = (_set("env.REF", "${SLURM_JOB_ID}/x"), _set("env.CMD", "$(echo no)/${SLURM_JOB_ID}"),
                 _set("container.image", "/img.sif"))
    script = prepare(str(GOLDEN_JOB), "local-slurm", overrides, run_dir=str(tmp_path / "run")).script
    env = [c for c in _run(script, tmp_path, shims) if c["tool"] == "apptainer"][0]["env"]
    assert env["APPTAINERENV_REF"] == "4242/x"
    assert env["APPTAINERENV_CMD"] == "$(echo no)/${SLURM_JOB_ID}"

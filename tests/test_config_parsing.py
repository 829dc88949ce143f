"""Pathological TOML on the login node (issue 20): huge, binary, deeply nested, FIFO, directory or non-UTF-8 files
and absurd --set values are one line naming the file (or --set), exit code 2, never a traceback; the corpus has the
small cases (tests/corpus/jobs/toml-*.toml), the ones too big or too odd for a file in the repo are made here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from milehpc.cli import cli
from milehpc.config import load


def _refused(args: list[str], expect: str) -> None:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], result.stderr
    assert "Traceback" not in result.output


def _plan(path: Path, *sets: str) -> list[str]:
    return ["plan", str(path), "--site", "local", *[a for s in sets for a in ("--set", s)]]


@pytest.mark.parametrize(("name", "data", "expect"), [
    ("utf16.toml", 'name = "c"\n'.encode("utf-16"), "expected UTF-8 text, got UTF-16 (byte-order mark)"),
    ("utf32.toml", 'name = "c"\n'.encode("utf-32"), "expected UTF-8 text, got UTF-32 (byte-order mark)"),
    ("huge.toml", b'name = "c"\n' + b"# " + b"x" * (load.MAX_TOML_BYTES + 1) + b"\n",
     f"expected a TOML file of at most 4 MiB, got {load.MAX_TOML_BYTES + 15} bytes"),
    ("inline-deep.toml", b'name = "c"\nsite = ' + b"{a = " * 5000 + b"1" + b"}" * 5000 + b"\n",
     "invalid TOML: arrays or inline tables nested too deeply"),
    ("tables-deep.toml", b'name = "c"\n[' + b".".join([b"site"] * 40) + b"]\nx = 1\n",
     "site.site.site: expected tables and arrays nested at most 32 deep, got 40 levels"),
])
def test_pathological_files_are_one_line(tmp_path: Path, name: str, data: bytes, expect: str) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    _refused(_plan(path), f"{path}: {expect}" if "site.site" not in expect else expect)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.toml"
    path.write_bytes('\ufeffname = "c"\n'.encode())
    assert load.read_toml(path) == {"name": "c"}


def test_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "job.toml"
    os.mkfifo(fifo)  # reading it would block forever
    _refused(_plan(fifo), f"{fifo}: expected a regular file")


def test_absurd_set_values(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('name = "c"\n')
    _refused(_plan(job, "data.params.x=" + "[" * 3000 + "]" * 3000), "--set: expected a value nested at most 32 deep")
    _refused(_plan(job, "data.params.x=" + "[" * 40 + "]" * 40), "--set: expected a value nested at most 32 deep, "
             "got 40 levels")
    _refused(_plan(job, "data." + ".".join(["a"] * 40) + "=1"),
             "(with --set): data.a.a.a: expected tables and arrays nested at most 32 deep, got 40 levels")


def test_deep_nesting_in_a_real_process(tmp_path: Path) -> None:
    """The RecursionError of the issue: in a real interpreter (default recursion limit), one line and exit 2."""
    path = tmp_path / "deep.toml"
    path.write_text('name = "c"\n[data]\nparams = { x = ' + "[" * 100000 + "]" * 100000 + " }\n")
    proc = subprocess.run([sys.executable, "-m", "milehpc", "plan", str(path), "--site", "local"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"milehpc: error: {path}: invalid TOML: arrays or inline tables "
                                                "nested too deeply (at most 32)"]

"""Issue 32 item 7: sites without packaging (``--site FILE.toml``, the site search path), the README's site-plugin
recipe built and installed as written, and ``doctor`` for a job whose ranks run in a container."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MILEHPC = str(Path(sys.executable).with_name("milehpc"))
JOB = str(ROOT / "examples" / "cpu-demo.toml")


def _site_file(path: Path, name: str, description: str) -> Path:
    """A copy of the shipped local site under another name."""
    text = (ROOT / "site-configs" / "local.toml").read_text()
    text = re.sub(r'(?m)^name = "local"$', f'name = "{name}"', text)
    text = re.sub(r"(?m)^description = .*$", f'description = "{description}"', text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _milehpc(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([MILEHPC, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_site_file_and_search_path_and_user_config_dir(tmp_path: Path) -> None:
    direct = _site_file(tmp_path / "elsewhere" / "mine.toml", "mine", "a file named directly")
    got = _milehpc("plan", JOB, "--site", str(direct), "--json")
    assert got.returncode == 0, got.stderr
    assert '"site": "mine"' in got.stdout
    missing = _milehpc("plan", JOB, "--site", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"milehpc: error: --site: expected a site name or an existing site TOML file, got '{tmp_path / 'nope.toml'}'"]

    first, second, config = tmp_path / "first", tmp_path / "second", tmp_path / "xdg"
    _site_file(first / "centre.toml", "centre", "from the first directory")
    _site_file(second / "centre.toml", "centre-2", "shadowed by the first")
    _site_file(second / "other.toml", "other", "only in the second")
    _site_file(config / "milehpc" / "sites" / "mine.toml", "mine", "from the user config dir")
    _site_file(config / "milehpc" / "sites" / "local.toml", "local", "the user's own local")
    env = {"MILEHPC_SITE_PATH": f"{first}{os.pathsep}{second}", "XDG_CONFIG_HOME": str(config)}
    listed = _milehpc("sites", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()}
    assert f"from the first directory ({first})" in rows["centre"]
    assert f"only in the second ({second})" in rows["other"]
    assert "from the user config dir" in rows["mine"]
    assert "the user's own local" in rows["local"]  # a user file replaces the shipped site of that name
    planned = _milehpc("plan", JOB, "--site", "centre", "--json", env=env)
    assert planned.returncode == 0 and '"site": "centre"' in planned.stdout, planned.stderr
    unknown = _milehpc("plan", JOB, "--site", "centre-2", env=env)  # shadowed: its file is never read
    assert unknown.returncode == 2 and "unknown site 'centre-2'" in unknown.stderr


def _readme_snippet(first_line: str) -> str:
    """The README's fenced block that starts with ``first_line``."""
    readme = (ROOT / "README.md").read_text()
    for block in re.findall(r"```[a-z]*\n(.*?)```", readme, re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"no README block starting with {first_line!r}")


def test_the_readme_site_plugin_recipe_installs_and_works(tmp_path: Path) -> None:
    """The README's two snippets as they are, plus a site TOML beside the module; pip builds and installs it into a
    target directory (no index, no build isolation); the installed plugin lists, plans and detects the site."""
    src = tmp_path / "milehpc-site-mycentre"
    pkg = src / "milehpc_site_mycentre"
    pkg.mkdir(parents=True)
    (src / "pyproject.toml").write_text(_readme_snippet("# pyproject.toml of your plugin"))
    (pkg / "__init__.py").write_text(_readme_snippet("# milehpc_site_mycentre/__init__.py"))
    _site_file(pkg / "mycentre.toml", "mycentre", "ignored: the plugin's description is listed")
    target = tmp_path / "site-packages"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "--quiet", "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    assert (target / "milehpc_site_mycentre" / "mycentre.toml").is_file(), "the site TOML was left out"
    env = {"PYTHONPATH": str(target)}
    listed = _milehpc("sites", "list", env=env)
    assert re.search(r"(?m)^mycentre\s+My Centre's GPU cluster\s+\[milehpc-site-mycentre 0\.1\.0\]$",
                     listed.stdout), listed.stdout + listed.stderr
    planned = _milehpc("plan", JOB, "--site", "mycentre", "--json", env=env)
    assert planned.returncode == 0 and '"site": "mycentre"' in planned.stdout, planned.stderr
    detect = subprocess.run(
        [sys.executable, "-c", "from milehpc import plugins; print(plugins.detect_site('login3.mycentre.org', {}))"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert detect.stdout.strip() == "mycentre", detect.stderr


# ---- doctor: the ranks' MPI is the container's -----------------------------------------------------------------

def _doctor_job(tmp_path: Path, image: bool) -> str:
    job = tmp_path / "job.toml"
    (tmp_path / "image.sif").write_text("")
    job.write_text('name = "d"\n' + (f'[container]\nimage = "{tmp_path}/image.sif"\n' if image else ""))
    return str(job)


def test_doctor_does_not_fail_the_login_nodes_mpi4py_when_the_ranks_run_in_a_container(tmp_path: Path) -> None:
    from milehpc.doctor import FAIL, Doctor

    broken = tmp_path / "python"  # a login node whose Python has no working mpi4py
    broken.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named mpi4py' >&2\nexit 1\n")
    broken.chmod(0o755)
    plain = Doctor("local-slurm", _doctor_job(tmp_path, image=False), python=str(broken)).run()
    assert [f.check for f in plain if f.level == FAIL and f.check == "mpi4py"] == ["mpi4py"]  # the check still bites
    contained = Doctor("local-slurm", _doctor_job(tmp_path, image=True), python=str(broken)).run()
    lines = {f.check: f for f in contained}
    assert not [f for f in contained if f.level == FAIL and f.check in ("mpi4py", "launcher")], contained
    assert "run in the container" in lines["mpi4py"].message
    assert f"{tmp_path}/image.sif" in lines["mpi4py"].message
    assert lines["container-binds"].level == "ok"
    job = Path(_doctor_job(tmp_path, image=True))  # the same job on a site whose containers bind only /lustre
    job.write_text(job.read_text() + '[site.containers.apptainer]\nbind_roots = ["/lustre"]\n')
    found = {f.check: f for f in Doctor("local-slurm", str(job), python=str(broken)).run()}
    assert found["container-binds"].level == FAIL
    assert "lets a container bind (under /lustre)" in found["container-binds"].message
    inside = Doctor("local-slurm", _doctor_job(tmp_path, image=True), python=str(broken),
                    env={**os.environ, "APPTAINER_CONTAINER": f"{tmp_path}/image.sif"}).run()
    assert [f.check for f in inside if f.level == FAIL and f.check == "mpi4py"] == ["mpi4py"]  # the image's own

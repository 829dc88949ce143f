"""The sites milehpc finds without a plugin: site TOML files on the site search path, then the shipped ones.

The search path, first match wins: each directory of ``MILEHPC_SITE_PATH`` (``:``-separated), then the user's
``$XDG_CONFIG_HOME/milehpc/sites`` (``~/.config/milehpc/sites``), then ``site-configs/`` shipped with milehpc. A site
file there is named ``NAME.toml``; ``--site path/to/file.toml`` names one file directly
(:func:`milehpc.config.load.site_data`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

from milehpc.errors import ConfigError
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import SiteConfig
from milehpc.resources import data_dir

_DESCRIPTIONS = {
    "local": "this machine, no scheduler: mpirun, CPU/gloo",
    "local-slurm": "the single-host test Slurm cluster (tests/cluster/slurm.sh): srun --mpi=pmix",
    "frontier-like": "OLCF Frontier: 8 MI250X GCDs per node, RCCL over Slingshot",
    "perlmutter-like": "NERSC Perlmutter GPU nodes: 4 A100 per node, NCCL over Slingshot",
    "dgx-h100-like": "a DGX H100 cluster: 8 H100 per node, NCCL over InfiniBand",
}
SITE_PATH_VAR = "MILEHPC_SITE_PATH"


def site_search_path(environ: dict[str, str] | None = None) -> list[Path]:
    """The user's site directories, in search order (the shipped ones come after them)."""
    env = os.environ if environ is None else environ
    dirs = [Path(d).expanduser() for d in env.get(SITE_PATH_VAR, "").split(os.pathsep) if d]
    config = Path(env.get("XDG_CONFIG_HOME") or Path(env.get("HOME") or Path.home()) / ".config")
    return [*dirs, config / "milehpc" / "sites"]


def _description(path: Path) -> str:
    """The site file's own ``description`` (a broken file still lists: loading it reports the error)."""
    from milehpc.config.load import read_toml

    try:
        value = read_toml(path).get("description", "")
    except ConfigError:
        return ""
    return value if isinstance(value, str) else ""


def _site_files() -> Iterator[tuple[str, Path, str]]:
    seen: set[str] = set()
    for directory in site_search_path():
        for path in sorted(directory.glob("*.toml")) if directory.is_dir() else ():
            if path.stem not in seen:
                seen.add(path.stem)
                yield path.stem, path, f"{_description(path)} ({directory})".lstrip()
    for path in sorted(data_dir("site-configs").glob("*.toml")):
        if path.stem not in seen:  # a user's file of the same name replaces the shipped one
            seen.add(path.stem)
            yield path.stem, path, _DESCRIPTIONS.get(path.stem) or _description(path)


@hookimpl
def milehpc_sites():
    for name, path, description in _site_files():
        yield SiteConfig(name=name, impl=str(path), description=description)


@hookimpl
def milehpc_detect_site(hostname: str, environ: dict[str, str]):
    # Inside a job on the test cluster, or on this very host with no scheduler.
    if environ.get("SLURM_CLUSTER_NAME") == "milehpc-test":
        return "local-slurm"
    if hostname == socket.gethostname() and "SLURM_JOB_ID" not in environ:
        return "local"
    return None

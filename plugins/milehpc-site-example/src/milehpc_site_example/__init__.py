"""An example site plugin: registers the site ``example-cluster`` (a TOML file shipped in this package) and
recognises its login nodes, so that ``milehpc submit job.toml`` picks the site without ``--site``."""

from __future__ import annotations

import re
from pathlib import Path

from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import SiteConfig

SITE_NAME = "example-cluster"
SITE_FILE = Path(__file__).with_name(f"{SITE_NAME}.toml")
# The centre's login nodes are called excl-login01, excl-login02, ...
LOGIN_HOST = re.compile(r"excl-login\d+(\..*)?")


@hookimpl
def milehpc_sites():
    yield SiteConfig(name=SITE_NAME, impl=str(SITE_FILE),
                     description="Example Centre's cluster: 4 A100 per GPU node, InfiniBand (plugin example)")


@hookimpl
def milehpc_detect_site(hostname: str, environ: dict[str, str]) -> str | None:
    # Login nodes by name, compute nodes by the Slurm cluster name of a running job.
    if LOGIN_HOST.fullmatch(hostname) or environ.get("SLURM_CLUSTER_NAME") == "excl":
        return SITE_NAME
    return None

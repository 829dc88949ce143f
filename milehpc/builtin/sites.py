"""The shipped sites: one TOML per site in site-configs/."""

from __future__ import annotations

import socket

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


@hookimpl
def milehpc_sites():
    for path in sorted(data_dir("site-configs").glob("*.toml")):
        yield SiteConfig(name=path.stem, impl=str(path), description=_DESCRIPTIONS.get(path.stem, ""))


@hookimpl
def milehpc_detect_site(hostname: str, environ: dict[str, str]):
    # Inside a job on the test cluster, or on this very host with no scheduler.
    if environ.get("SLURM_CLUSTER_NAME") == "milehpc-test":
        return "local-slurm"
    if hostname == socket.gethostname() and "SLURM_JOB_ID" not in environ:
        return "local"
    return None

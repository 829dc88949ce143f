"""Every shipped Slurm site proven against a real slurmctld shaped like the site: for each site the test starts a
cluster (tests/cluster/slurm.sh, own state directory and ports) whose node has the real machine's cores, threads,
GPUs, features and partition names, renders the golden job for every partition of the site (plain and Apptainer,
and a job filling one node) and asserts that ``sbatch --test-only`` accepts it -- and refuses the same job asking
for more GPUs than the node has, so the shape is really checked. The local-slurm site's jobs run for real in
test_slurm_lifecycle.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
import harness  # noqa: E402

from milehpc.config.load import load_site  # noqa: E402
from milehpc.render.rundir import prepare  # noqa: E402

pytestmark = pytest.mark.slurm

HERE = Path(__file__).parent
GOLDEN_JOB = HERE / "golden" / "job.toml"
SITES = sorted(p.stem for p in (HERE.parent / "site-configs").glob("*.toml"))

# Node shapes of the machines the sites model, from the sites' public user guides (see
# /work/shared/notes/site-facts.md and the citations in each site TOML), not from the TOMLs themselves:
#   Frontier: 1x 64-core EPYC (2 threads/core), 8 MI250X GCDs, core specialisation -S 8 by default, -C nvme.
#   Perlmutter GPU node: 1x 64-core Milan (2 threads/core), 4 A100, selected by -C gpu (hbm80g on the 80 GB ones).
#   DGX H100: 2x 56-core Xeon (2 threads/core), 8 H100.
SHAPES: dict[str, dict[str, str]] = {
    "frontier-like": {"PARTITIONS": "batch,extended", "SOCKETS": "1", "CORES": "64", "THREADS": "2", "GPUS": "8",
                      "FEATURES": "nvme", "CORE_SPEC": "8"},
    "perlmutter-like": {"PARTITIONS": "regular", "SOCKETS": "1", "CORES": "64", "THREADS": "2", "GPUS": "4",
                        "FEATURES": "gpu,hbm80g"},
    "dgx-h100-like": {"PARTITIONS": "batch", "SOCKETS": "2", "CORES": "56", "THREADS": "2", "GPUS": "8",
                      "FEATURES": "gpu"},
    # The test cluster itself: the default shape of tests/cluster/slurm.sh.
    "local-slurm": {"PARTITIONS": "debug", "SOCKETS": "2", "CORES": "32", "THREADS": "1", "GPUS": "8",
                    "FEATURES": "gpu,nvme"},
}


def _derived_shape(site_name: str) -> dict[str, str]:
    """A site without a known machine (a new TOML or a plugin): shape the node from its own config."""
    site, _ = load_site(site_name)
    parts = {p.access.partition or name for name, p in site.partitions.items()}
    feats: set[str] = set()
    for p in site.partitions.values():
        for text in [p.access.constraint or "", *(o for opts in p.resources.values() for o in opts
                                                  if o.startswith("--constraint="))]:
            feats |= {f for f in re.split(r"[&|,\[\]*=]", text.removeprefix("--constraint=")) if f}
    part = site.partitions[site.default_partition]
    cores = max(p.cpus_per_node + (p.access.core_spec or 0) for p in site.partitions.values())
    return {"PARTITIONS": ",".join(sorted(parts)), "SOCKETS": "1", "CORES": str(cores), "THREADS": "1",
            "GPUS": str(max(p.devices.count for p in site.partitions.values())), "FEATURES": ",".join(sorted(feats))
            or "none", "CORE_SPEC": str(part.access.core_spec or 0)}


def _slurm_sites() -> list[str]:
    # local-multinode is its own 4-node cluster, not a one-node shape: tests/test_multinode_cluster.py checks it there.
    return [s for s in SITES if s != "local-multinode"
            and any(p.scheduler == "slurm" for p in load_site(s)[0].partitions.values())]


@pytest.fixture(scope="module")
def cluster_env(request):
    harness.ensure_cluster()  # skips with the reason when this machine cannot run Slurm at all
    started: list[dict[str, str]] = []

    def start(site: str, index: int) -> dict[str, str]:
        shape = SHAPES.get(site) or _derived_shape(site)
        env = {**os.environ, "MILEHPC_CLUSTER_DIR": f"/tmp/milehpc-shape-{site}",
               "MILEHPC_CLUSTER_NAME": f"shape-{site}"[:40], "MILEHPC_CLUSTER_PORT": str(7100 + 10 * index),
               "MILEHPC_CLUSTER_ETC_LINK": "0", **{f"MILEHPC_CLUSTER_{k}": v for k, v in shape.items()}}
        proc = subprocess.run(["bash", str(harness.SLURM_SH), "start"], env=env, capture_output=True, text=True,
                              timeout=300)
        sys.stderr.write(proc.stderr)
        assert proc.returncode == 0, f"cluster shaped like {site} did not start:\n{proc.stderr}"
        started.append(env)
        return {**env, "SLURM_CONF": f"{env['MILEHPC_CLUSTER_DIR']}/etc/slurm.conf"}

    yield start
    # Stop them side by side (slurmctld takes a few seconds to shut down).
    stops = [subprocess.Popen(["bash", str(harness.SLURM_SH), "stop"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for env in started]
    for proc in stops:
        sys.stderr.write(proc.communicate(timeout=120)[1])


def _test_only(script: str, path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    path.write_text(script)
    return subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("site", _slurm_sites())
def test_rendered_scripts_are_accepted_by_a_cluster_shaped_like_the_site(site, cluster_env, tmp_path):
    env = cluster_env(site, _slurm_sites().index(site))
    site_obj, _ = load_site(site)
    checked = 0
    for pname, part in site_obj.partitions.items():
        if part.scheduler != "slurm":
            continue
        per_node = part.slots_per_node
        variants = {
            "golden": (),
            "apptainer": ('container.image="/images/milehpc.sif"',),
            # One full node: half the ranks train, half serve (engines of one GPU/rank).
            "full-node": (f"trainer.dp={max(1, per_node // 2)}", f"rollout.engines={max(1, per_node - per_node // 2)}"),
        }
        for variant, extra in variants.items():
            prep = prepare(str(GOLDEN_JOB), site, (f"resources.partition={pname}", *extra),
                           run_dir=str(tmp_path / f"{pname}-{variant}"))
            proc = _test_only(prep.script, tmp_path / f"{pname}-{variant}.sbatch", env)
            assert proc.returncode == 0 and "to start at" in proc.stderr, \
                f"{site}/{pname}/{variant} refused by its cluster: {proc.stderr.strip()}\n{prep.script}"
            if part.access.partition:
                assert f"in partition {part.access.partition}" in proc.stderr, proc.stderr
            checked += 1
        if part.devices.count:
            # Control: the same job asking for more GPUs per node than the machine has must be refused.
            gpus = int((SHAPES.get(site) or _derived_shape(site))["GPUS"])
            # (one core a rank: the login node refuses more cores than a node has before Slurm could)
            over = prepare(str(GOLDEN_JOB), site, (f"resources.partition={pname}", f"site.devices.count={gpus * 2}",
                                                   "site.cpus_per_task=1"), run_dir=str(tmp_path / f"{pname}-over"))
            assert f"--gpus-per-node={gpus * 2}" in over.script
            proc = _test_only(over.script, tmp_path / f"{pname}-over.sbatch", env)
            assert proc.returncode != 0, f"{site}/{pname}: {gpus * 2} GPUs per node accepted?\n{proc.stderr}"
    assert checked >= 3


def test_every_shipped_slurm_site_is_checked():
    assert {"frontier-like", "perlmutter-like", "dgx-h100-like", "local-slurm"} <= set(_slurm_sites())

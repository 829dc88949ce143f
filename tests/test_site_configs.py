"""The shipped sites carry the values their user guides give (see the citations in site-configs/*.toml), and
the example site plugin package works once installed."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner

from milehpc.cli import cli
from milehpc.config.load import job_from_dict, load_site

REPO = Path(__file__).resolve().parent.parent
SITES = sorted(p.stem for p in (REPO / "site-configs").glob("*.toml"))
VALID_JOB = REPO / "tests" / "corpus" / "valid-job.toml"


def partitions(name: str):
    site, _ = load_site(name)
    for part_name in site.partitions:
        yield part_name, load_site(name, job_from_dict({"name": "t", "resources": {"partition": part_name}}))[1]


@pytest.mark.parametrize("name", SITES)
def test_no_site_sets_device_masks_or_memhooks(name: str) -> None:
    """Slurm sets the GPU masks per task; a second mask leaves ranks without GPUs. memhooks deadlocks."""
    for part_name, part in partitions(name):
        tables = [part.env, part.env_single_node, part.env_multi_node,
                  *(c.env for c in part.containers.values())]
        for env in tables:
            for var in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
                assert var not in env, f"{name}/{part_name} sets {var}"
            assert env.get("FI_MR_CACHE_MONITOR") != "memhooks", f"{name}/{part_name}"


def test_frontier_values_from_the_olcf_guides() -> None:
    for part_name, part in partitions("frontier-like"):
        where = f"frontier-like/{part_name}"
        assert (part.devices.vendor, part.devices.arch, part.devices.count) == ("amd", "gfx90a", 8), where
        assert part.cpus_per_task == 7 and part.cpus_per_node == 56 and part.access.core_spec == 8, where
        assert part.slots_per_node == 8, f"{where}: one task per GCD"
        assert {"--gpus-per-task=1", "--gpu-bind=closest"} <= set(part.launcher.flags), where
        assert part.launcher.kind == "srun", f"{where}: never torchrun inside srun"
        assert {"PrgEnv-gnu", "rocm", "rccl-net-plugin", "craype-accel-amd-gfx90a"} <= set(part.modules), where
        assert part.env["NCCL_SOCKET_IFNAME"] == "hsn0,hsn1,hsn2,hsn3"
        assert part.env["FI_MR_CACHE_MONITOR"] in ("kdreg2", "userfaultfd")
        assert part.env["HSA_FORCE_FINE_GRAIN_PCIE"] == "1" and part.env["NCCL_CROSS_NIC"] == "1"
        assert part.env["FI_CXI_RDZV_PROTO"] == "alt_read"
        assert "--network=disable_rdzv_get" in part.access.options, "pairs with FI_CXI_RDZV_PROTO=alt_read"
        assert part.env["MIOPEN_USER_DB_PATH"].startswith("/tmp/") and "${SLURM_JOB_ID}" in part.env[
            "MIOPEN_USER_DB_PATH"], "MIOpen cache on node-local storage, per job"
        assert part.env["MIOPEN_CUSTOM_CACHE_DIR"] == part.env["MIOPEN_USER_DB_PATH"]
        assert part.env_single_node == {"NCCL_NET": "Socket"} and part.env_multi_node == {"NCCL_NET": "OFI"}
        assert part.master_addr == "hostname -i"
        app = part.containers["apptainer"]
        assert "--rocm" in app.flags
        assert {"/usr/share/libdrm", "/var/spool/slurmd", "/opt/cray"} <= set(app.binds)
        assert "/opt/rocm/lib" in app.env["APPTAINERENV_LD_LIBRARY_PATH"]
        assert "cray-mpich-abi" in app.modules
        assert part.resources["nvme"] == ["--constraint=nvme"]
    site, _ = load_site("frontier-like")
    assert site.partitions["batch"].time_limit == "12:00:00"
    assert (site.partitions["extended"].max_nodes, site.partitions["extended"].time_limit) == (64, "24:00:00")


def test_perlmutter_values() -> None:
    for part_name, part in partitions("perlmutter-like"):
        assert (part.devices.vendor, part.devices.count) == ("nvidia", 4), part_name
        assert part.access.constraint == "gpu" and part.access.qos == part_name
        assert part.env["FI_MR_CACHE_MONITOR"] == "userfaultfd"
        assert part.env_multi_node["NCCL_NET"] == "AWS Libfabric"
        assert part.cpus_per_task * part.slots_per_node == part.cpus_per_node == 128


def test_dgx_values() -> None:
    (_, part), = partitions("dgx-h100-like")
    assert (part.devices.vendor, part.devices.arch, part.devices.count) == ("nvidia", "sm_90", 8)
    assert part.env["NCCL_IB_HCA"].startswith("mlx5")
    assert "--nv" in part.containers["apptainer"].flags


def test_local_sites_fit_the_cpu_demo() -> None:
    """3-4 CPU ranks fit one node of `local` and of `local-slurm`'s default partition."""
    for name in ("local", "local-slurm"):
        _, part = load_site(name)
        assert part.devices.vendor == "none" and part.slots_per_node >= 4, name
    _, local = load_site("local")
    assert local.scheduler == "local" and local.launcher.kind == "mpirun" and local.master_addr == "127.0.0.1"
    assert "--oversubscribe" in local.launcher.flags
    _, slurm = load_site("local-slurm")
    assert slurm.launcher.kind == "srun" and slurm.launcher.mpi == "pmix"


@pytest.mark.parametrize("name", SITES)
def test_every_site_renders_plain_and_in_a_container(name: str, tmp_path: Path) -> None:
    for extra in ([], ["--set", "container.image=/images/milehpc.sif"]):
        result = CliRunner().invoke(cli, ["submit", str(VALID_JOB), "--site", name, "--dry-run",
                                          "--run-dir", str(tmp_path / "run"), *extra])
        assert result.exit_code == 0, result.output
        assert "milehpc launch" in result.stdout


# ---- the example plugin package (plugins/milehpc-site-example) -------------------------------------------

def _example_installed() -> bool:
    try:
        metadata.distribution("milehpc-site-example")
    except metadata.PackageNotFoundError:
        return False
    return True


needs_example = pytest.mark.skipif(not _example_installed(),
                                   reason="pip install -e plugins/milehpc-site-example first")


@needs_example
def test_example_plugin_site_is_listed_with_its_distribution() -> None:
    result = CliRunner().invoke(cli, ["sites", "list"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.startswith("example-cluster"))
    assert "milehpc-site-example" in line


@needs_example
def test_example_plugin_site_renders(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["submit", str(VALID_JOB), "--site", "example-cluster", "--dry-run",
                                      "--run-dir", str(tmp_path / "run"), "--set", "resources.partition=gpu-debug"])
    assert result.exit_code == 0, result.output
    assert "#SBATCH --partition=gpu-debug" in result.stdout and "--gpus-per-task=1" in result.stdout


@needs_example
def test_example_plugin_detects_its_login_nodes() -> None:
    from milehpc import plugins

    assert plugins.detect_site("excl-login03", {}) == "example-cluster"
    assert plugins.detect_site("excl-login03.example.org", {}) == "example-cluster"
    assert plugins.detect_site("some-other-host", {}) != "example-cluster"

"""Container wrapping of each rank's command (Apptainer), registered as the built-in ``apptainer`` runtime."""

from __future__ import annotations

from milehpc.config.job import ContainerSpec
from milehpc.config.site import Partition
from milehpc.plan import Plan

# Variables each task needs inside a --cleanenv container: Slurm's rank/step facts, PMI(x) for MPI wire-up,
# the device masks Slurm set, and milehpc's own. Static site/job variables are added by name.
FORWARD_PREFIXES = ("SLURM_", "PMIX_", "PMI_", "OMPI_", "MILEHPC_", "MASTER_")
# Secrets (tokens, keys) are never written into job files: they come from the submitting environment and are
# passed on by name only (milehpc.hygiene masks them in what milehpc prints).
FORWARD_PATTERNS = ("*TOKEN*", "*KEY*", "*SECRET*", "*PASSWORD*")
FORWARD_NAMES = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "PYTHONUNBUFFERED")


def apptainer_argv(plan: Plan, partition: Partition, container: ContainerSpec, run_dir: str) -> list[str]:
    """``apptainer exec`` with the GPU flag for the site's vendor, a clean environment, and the binds: the run
    directory (the ranks read the plan there), the site's, and ``container.binds``, which by then also holds a bind
    for every other path the job reads or writes (milehpc.render.binds, added by milehpc.render.rundir)."""
    argv = ["apptainer", "exec", "--cleanenv"]
    platform = partition.containers.get("apptainer")
    site_flags = platform.flags if platform else []
    gpu_flag = {"nvidia": "--nv", "amd": "--rocm"}.get(plan.device_vendor)
    if gpu_flag and gpu_flag not in site_flags:
        argv.append(gpu_flag)
    argv += [f for f in site_flags if f != "--cleanenv"]
    binds = [run_dir, *(platform.binds if platform else []), *container.binds]
    if binds:
        argv += ["--bind", ",".join(binds)]
    argv += container.flags
    argv.append(container.image or "")
    return argv

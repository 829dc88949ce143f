"""The site model (after ReFrame): a site has partitions; each partition says how to get nodes (access),
how to start ranks (launcher), what devices a node has, what to load (modules), what environment the
collectives need, and how to run containers. Values come from the site's public user guide."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from milehpc.config.job import ENV_NAME, NAME
from milehpc.config.schema import deep_merge, opt
from milehpc.config.slurm_time import TIME, TIME_EXPECT
from milehpc.config.slurm_time import coerce as slurm_time
from milehpc.errors import ConfigError

# Slurm/launcher options are validated to a conservative grammar so that they can be rendered unquoted-safe.
SLURM_OPT = r"-{1,2}[A-Za-z][A-Za-z0-9_-]*(=[A-Za-z0-9_.,:/@%+=-]+)?|[A-Za-z0-9_.,:/@%+=-]+"
MODULE = r"[A-Za-z0-9][A-Za-z0-9_./+-]*"


@dataclass
class Access:
    account: str | None = opt(None, pattern=r"[A-Za-z0-9_.-]+", expect="an account name")
    partition: str | None = opt(None, pattern=r"[A-Za-z0-9_.-]+", expect="a Slurm partition name")
    qos: str | None = opt(None, pattern=r"[A-Za-z0-9_.-]+", expect="a QOS name")
    constraint: str | None = opt(None, pattern=r"[A-Za-z0-9_.&|\[\]*,-]+", expect="a Slurm constraint")
    reservation: str | None = opt(None, pattern=r"[A-Za-z0-9_.-]+", expect="a reservation name")
    core_spec: int | None = opt(None, min=0, help="-S: cores reserved for the system (Frontier: 8 by default)")
    options: list[str] = opt([], pattern=SLURM_OPT, expect="an sbatch option like --exclusive or --mem=0")
    account_required: bool = opt(False, help="the site refuses jobs without --account: a job must set [site.access] "
                                             "account (the login node refuses it otherwise)")

    def validate(self, *, file: str | None, prefix: str) -> None:
        # --exclusive gives the whole node's cores but only the default memory per CPU: --mem=0 asks for all of it.
        if "--exclusive" in self.options and not any(o.startswith("--mem") for o in self.options):
            raise ConfigError("expected --mem=0 with --exclusive (an exclusive node otherwise gets the default memory "
                              f"per CPU only), got {self.options!r}", file=file, field=f"{prefix}.options")


@dataclass
class Launcher:
    kind: Literal["srun", "mpirun"] = opt("srun")
    mpi: str | None = opt("pmix", pattern=r"[a-z0-9_]+", expect="a Slurm MPI plugin (pmix, pmi2, cray_shasta)")
    flags: list[str] = opt([], pattern=SLURM_OPT, expect="a launcher option like --gpu-bind=closest")
    gpu_binding: Literal["per-task", "per-node", "none"] = opt(
        "per-task", help="per-task: Slurm gives each task its GPU(s); per-node: each task sees the node's GPUs"
    )


@dataclass
class Devices:
    vendor: Literal["nvidia", "amd", "none"] = opt("none")
    arch: str = opt("cpu", pattern=r"[A-Za-z0-9_.-]+", expect="a device architecture like gfx90a or sm_90")
    count: int = opt(0, min=0, help="GPUs (or GCDs) per node as Slurm counts them")
    model: str = opt("")
    memory_gib: float | None = opt(None, min=0.5, help="memory of one device (GPU or GCD) in GiB, as nvidia-smi / "
                                   "rocm-smi report it; unset = unknown (plan shows the estimate, nothing is refused)")


@dataclass
class Interconnect:
    """The figures the weight-sync estimate needs (milehpc.weights.cost); from the vendor's or centre's
    documentation, decimal GB/s in one direction. Unset = unknown (plan shows bytes and buckets, no seconds)."""

    node_gb_s: float | None = opt(None, min=0.001, help="one node's injection bandwidth into the inter-node fabric "
                                  "(all its NICs together), GB/s in one direction")
    gpu_link_gb_s: float | None = opt(None, min=0.001, help="the slowest direct GPU-to-GPU link inside a node, GB/s "
                                      "in one direction")
    latency_us: float = opt(2.0, min=0.0, help="per message and hop (a bucket's broadcast pays it once per member)")


def _check_env_names(env: dict[str, str], *, file: str | None, field: str) -> None:
    for key in env:
        if not re.fullmatch(ENV_NAME, key):
            raise ConfigError(f"expected an environment variable name, got {key!r}", file=file, field=field)


@dataclass
class ContainerPlatform:
    flags: list[str] = opt([], pattern=SLURM_OPT, expect="a container runtime option like --rocm")
    binds: list[str] = opt([], pattern=r"[A-Za-z0-9_.,:/@%+-]+", expect="a bind spec src[:dst[:opts]] (no variables)")
    bind_roots: list[str] = opt([], pattern=r"/[A-Za-z0-9_.,/@%+-]*", expect="an absolute host path",
                                help="host paths a container may bind (the file systems compute nodes mount); "
                                     "a job path outside them is refused; empty = any")
    env: dict[str, str] = opt({}, help="host variables read by the runtime (APPTAINERENV_X sets X inside)")
    modules: list[str] = opt([], pattern=MODULE, expect="a module name")
    # Declared here, not on the partition: a rank runs the engine that the image holds, and the image a site documents
    # for its container runtime (containers/*.def) is what fixes it. Without a container the engines are whatever
    # the user installed in their own environment, which the site cannot speak for.
    engines: list[str] = opt([], pattern=NAME, expect="a rollout engine name like vllm",
                             help="rollout engines the site's image for this runtime has (built from containers/*.def); "
                                  "a containerised job with another rollout.engine is refused on the login node (a "
                                  "job with its own image restates the list in [site.containers.RUNTIME]); empty = "
                                  "not declared, unchecked")

    def validate(self, *, file: str | None, prefix: str) -> None:
        _check_env_names(self.env, file=file, field=f"{prefix}.env")
        if len(set(self.engines)) != len(self.engines):
            raise ConfigError(f"expected each engine once, got {self.engines!r}", file=file, field=f"{prefix}.engines")


@dataclass
class SiteSandbox:
    backend: str = opt("bubblewrap", pattern=NAME, expect="a sandbox name",
                       help="sandbox for model-written programs on this partition's nodes (bubblewrap, apptainer)")
    image: str | None = opt(None, pattern=r"[A-Za-z0-9_.,:/@%+${}-]+", expect="an image path (may use ${USER})",
                            help="the apptainer sandbox's image")

    def validate(self, *, file: str | None, prefix: str) -> None:
        if self.backend == "none":
            raise ConfigError("expected a sandbox (a job may opt out with [sandbox] allow_unsandboxed), got 'none'",
                              file=file, field=f"{prefix}.backend")


@dataclass
class Partition:
    description: str = opt("")
    extends: str | None = opt(None, pattern=NAME, expect="a partition name of this site",
                              help="start from that partition's values; keys here override, tables merge")
    scheduler: Literal["slurm", "local"] = opt("slurm")
    access: Access = opt(Access)
    launcher: Launcher = opt(Launcher)
    devices: Devices = opt(Devices)
    cpus_per_node: int = opt(2, min=1)
    cpus_per_task: int = opt(1, min=1)
    mem_per_node_gib: float | None = opt(None, min=0.5, help="host memory of one node in GiB (what free -g or the "
                                         "user guide says); CPU partitions check their ranks against it. Unset = "
                                         "unchecked (a local partition reads this machine's MemTotal)")
    ranks_per_node: int | None = opt(None, min=1, help="unset = one rank per GPU (CPU: cpus_per_node/cpus_per_task)")
    max_nodes: int = opt(1, min=1)
    time_limit: str = opt("24:00:00", pattern=TIME, expect=TIME_EXPECT, coerce=slurm_time,
                          help="the partition's (or QOS's) longest job; a job's resources.time above it is refused")
    modules: list[str] = opt([], pattern=MODULE, expect="a module name")
    module_purge: bool = opt(False)
    env: dict[str, str] = opt({}, help="environment for every rank (values may use ${VAR})")
    env_single_node: dict[str, str] = opt({}, help="added when the job has one node")
    env_multi_node: dict[str, str] = opt({}, help="added when the job has more than one node")
    master_addr: Literal["hostname", "hostname -i", "127.0.0.1"] = opt("hostname")
    network: bool = opt(False, help="compute nodes reach the internet (W&B logs online with mode = 'auto')")
    node_local_dir: str = opt("/tmp", pattern=r"[A-Za-z0-9_./${}-]+", expect="a path (may use ${USER})")
    containers: dict[str, ContainerPlatform] = opt({})
    sandbox: SiteSandbox = opt(SiteSandbox)
    resources: dict[str, list[str]] = opt({}, help="named extra sbatch options, e.g. nvme = ['--constraint=nvme']")
    compute_only_paths: list[str] = opt([], pattern=r"/[A-Za-z0-9_./${}-]*", expect="an absolute path (may use ${USER})",
                                        help="folders that exist on the compute nodes only (node-local NVMe): a job "
                                             "input under one is not looked for on the login node when the job lists "
                                             "its field in resources.compute_only_inputs")
    fs_write_gib_s: float | None = opt(None, min=0.001, help="GiB/s one job writes to the shared file system "
                                       "(checkpoints); checkpoint.signal_lead_s must cover writing one. Unset = unchecked")
    interconnect: Interconnect = opt(Interconnect, help="the GPU fabric's figures (weight-sync estimate)")

    def _check_placement(self, *, file: str | None, prefix: str) -> None:
        """A GPU node's ranks each get cpus_per_task cores of their own (its cores per GPU), bound to them: several
        ranks on a node without binding, or more cores than the node has, share cores and NUMA domains."""
        if self.devices.count == 0 or self.scheduler != "slurm":
            return  # CPU ranks on a test host oversubscribe by design (local, local-slurm debug)
        if self.cpus_per_task * self.slots_per_node > self.cpus_per_node:
            raise ConfigError(f"expected cpus_per_task * ranks per node ({self.cpus_per_task} x {self.slots_per_node})"
                              f" to fit the node's {self.cpus_per_node} cores, got {self.cpus_per_task * self.slots_per_node}",
                              file=file, field=f"{prefix}.cpus_per_task")
        if self.slots_per_node > 1 and "--cpu-bind=none" in self.launcher.flags:
            raise ConfigError(f"expected --cpu-bind=cores (or a map) with {self.slots_per_node} ranks per node: "
                              "'none' leaves them free to share cores and cross NUMA domains, got --cpu-bind=none",
                              file=file, field=f"{prefix}.launcher.flags")

    @property
    def slots_per_node(self) -> int:
        if self.ranks_per_node:
            return self.ranks_per_node
        if self.devices.count:
            return self.devices.count
        return max(1, self.cpus_per_node // self.cpus_per_task)

    def validate(self, *, file: str | None, prefix: str) -> None:
        self._check_placement(file=file, prefix=prefix)
        for table in ("env", "env_single_node", "env_multi_node"):
            _check_env_names(getattr(self, table), file=file, field=f"{prefix}.{table}")
        for key, opts in self.resources.items():
            for value in opts:
                if not re.fullmatch(SLURM_OPT, value):
                    raise ConfigError(f"expected an sbatch option, got {value!r}", file=file,
                                      field=f"{prefix}.resources.{key}")
        if self.devices.vendor != "none" and self.devices.count == 0:
            raise ConfigError("expected a GPU count > 0 for a GPU vendor", file=file, field=f"{prefix}.devices.count")


def expand_partitions(raw: Any, *, file: str | None = None) -> Any:
    """Resolve ``extends = "other"`` between the partitions of a raw site dict (before validation), so that a
    site with several similar partitions (Frontier's batch and extended) states the shared values once."""
    parts = raw.get("partitions") if isinstance(raw, dict) else None
    if not isinstance(parts, dict):
        return raw  # build() reports the wrong type
    done: dict[str, Any] = {}

    def resolve(name: str, chain: list[str]) -> Any:
        if name in done:
            return done[name]
        part = parts[name]
        base = part.get("extends") if isinstance(part, dict) else None
        if base is not None:
            if not isinstance(base, str) or base not in parts:
                raise ConfigError(f"expected one of the partitions ({', '.join(sorted(parts))}), got {base!r}",
                                  file=file, field=f"partitions.{name}.extends")
            if base in chain:
                raise ConfigError(f"expected no cycle of extends, got {' -> '.join([*chain, base])}",
                                  file=file, field=f"partitions.{name}.extends")
            part = deep_merge(resolve(base, [*chain, base]), part)
        done[name] = part
        return part

    return {**raw, "partitions": {name: resolve(name, [name]) for name in parts}}


@dataclass
class Site:
    name: str = opt(pattern=NAME, expect="a site name")
    default_partition: str = opt(pattern=NAME, expect="a partition name")
    description: str = opt("")
    docs: list[str] = opt([], help="the public user guide(s) the values come from")
    partitions: dict[str, Partition] = opt({})

    def validate(self, *, file: str | None, prefix: str) -> None:
        if not self.partitions:
            raise ConfigError("expected at least one [partitions.NAME] table", file=file, field="partitions")
        if self.default_partition not in self.partitions:
            raise ConfigError(
                f"expected one of the partitions ({', '.join(sorted(self.partitions))}), got {self.default_partition!r}",
                file=file, field="default_partition",
            )

    def partition(self, name: str | None, *, file: str | None = None) -> Partition:
        name = name or self.default_partition
        if name not in self.partitions:
            raise ConfigError(
                f"site '{self.name}' has no partition {name!r} (expected one of: {', '.join(sorted(self.partitions))})",
                file=file, field="resources.partition",
            )
        return self.partitions[name]

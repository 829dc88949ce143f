"""The site model (after ReFrame): a site has partitions; each partition says how to get nodes (access),
how to start ranks (launcher), what devices a node has, what to load (modules), what environment the
collectives need, and how to run containers. Values come from the site's public user guide."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from milehpc.config.job import ENV_NAME, NAME, TIME
from milehpc.config.schema import deep_merge, opt
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


def _check_env_names(env: dict[str, str], *, file: str | None, field: str) -> None:
    for key in env:
        if not re.fullmatch(ENV_NAME, key):
            raise ConfigError(f"expected an environment variable name, got {key!r}", file=file, field=field)


@dataclass
class ContainerPlatform:
    flags: list[str] = opt([], pattern=SLURM_OPT, expect="a container runtime option like --rocm")
    binds: list[str] = opt([], pattern=r"[A-Za-z0-9_.,:/@%+-]+", expect="a bind spec src[:dst[:opts]] (no variables)")
    env: dict[str, str] = opt({}, help="host variables read by the runtime (APPTAINERENV_X sets X inside)")
    modules: list[str] = opt([], pattern=MODULE, expect="a module name")

    def validate(self, *, file: str | None, prefix: str) -> None:
        _check_env_names(self.env, file=file, field=f"{prefix}.env")


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
    ranks_per_node: int | None = opt(None, min=1, help="unset = one rank per GPU (CPU: cpus_per_node/cpus_per_task)")
    max_nodes: int = opt(1, min=1)
    time_limit: str = opt("24:00:00", pattern=TIME, expect="a Slurm time [D-]HH:MM:SS")
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

    @property
    def slots_per_node(self) -> int:
        if self.ranks_per_node:
            return self.ranks_per_node
        if self.devices.count:
            return self.devices.count
        return max(1, self.cpus_per_node // self.cpus_per_task)

    def validate(self, *, file: str | None, prefix: str) -> None:
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

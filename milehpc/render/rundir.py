"""From a job file and a site to a prepared run: validated spec, plan, script, and the run directory."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from milehpc.config.inputs import absolute_inputs, check_inputs
from milehpc.config.job import JobSpec, wandb_mode
from milehpc.config.load import job_label, load_job, load_site
from milehpc.config.rules import check_job_rules, check_site_rules
from milehpc.config.schema import to_dict
from milehpc.config.shape import model_shape
from milehpc.config.site import Partition, Site
from milehpc.errors import ConfigError
from milehpc.plan import Plan, make_plan
from milehpc.render.requeue import check_signal_lead
from milehpc.render.script import ScriptInputs, render_script
from milehpc.sandbox.choice import check as check_sandbox
from milehpc.sandbox.choice import resolve as resolve_sandbox


@dataclass
class Prepared:
    job: JobSpec
    job_file: str
    site: Site
    partition: Partition
    plan: Plan
    run_dir: Path
    script: str


def default_run_dir(job: JobSpec) -> Path:
    if job.run.run_dir:
        return Path(job.run.run_dir).expanduser().absolute()
    return Path("runs", f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}").absolute()


def container_argv(job: JobSpec, plan: Plan, partition: Partition, run_dir: Path, file: str) -> list[str]:
    """The argv prefix that wraps each rank in the job's container, or [] without one."""
    if not job.container.image:
        return []
    from milehpc import plugins
    from milehpc.render.binds import auto_binds, check_binds, job_paths

    wrap = plugins.load("container", job.container.runtime, file=file, field="container.runtime")
    # The container sees only what is bound: every path the ranks read or write gets a bind (or the job is refused
    # here, in one line, rather than failing on every rank after the queue).
    container = job.container
    platform = partition.containers.get(container.runtime)
    paths = job_paths(job, str(run_dir), {**partition.env, **job.env})
    binds = [str(run_dir), *(platform.binds if platform else []), *container.binds]
    if container.auto_binds:
        container = replace(container, binds=[*container.binds, *auto_binds(paths, binds)])
    check_binds(paths, [str(run_dir), *(platform.binds if platform else []), *container.binds],
                allowed=platform.bind_roots if platform else [], site=plan.site, file=file)
    return list(wrap(plan, partition, container, str(run_dir)))


def prepare(job_file: str, site_name: str, overrides: tuple[str, ...] = (), *, run_dir: str | None = None,
            python: str | None = None, mpirun: str | None = None, job: JobSpec | None = None) -> Prepared:
    """Validate everything and render the script, writing nothing."""
    job = job or load_job(job_file, overrides)
    site, partition = load_site(site_name, job, job_file)
    part_name = job.resources.partition or site.default_partition
    label = job_label(job_file, overrides)
    # Inputs first (a missing model folder would make the shape below the [model] table's), then ONE model shape
    # for the layout: a checkpoint folder's config.json (milehpc.config.shape).
    check_inputs(job, partition, file=label)
    plan = make_plan(job, partition, site=site.name, partition_name=part_name, file=job_file,
                     shape=model_shape(job, file=label))
    _check_plugins(job, job_file)
    # The rules that span several tables (milehpc.config.rules): here, so submit, render, plan, run, --resume and
    # --sweep all refuse a job that can only fail before it queues.
    check_job_rules(job, file=job_label(job_file, overrides))
    check_site_rules(job, partition, file=job_label(job_file, overrides))  # what the partition's GPUs cannot run
    check_signal_lead(job, partition, file=label)
    if "wandb" in job.logging.loggers:  # online W&B needs a site whose compute nodes have network
        wandb_mode(str(job.logging.params.get("wandb", {}).get("mode", "auto")), partition.network, file=job_file)
    # The sandbox the ranks will use: the job's [sandbox] over the site partition's (the job alone cannot say).
    check_sandbox(resolve_sandbox(to_dict(job.sandbox), to_dict(partition.sandbox)),
                  file=job_label(job_file, overrides))
    rdir = Path(run_dir).expanduser().absolute() if run_dir else default_run_dir(job)
    # Checked (and named in any refusal) as written; the ranks run in the run directory, where a relative input
    # would name something else: they get the paths looked at here.
    job = absolute_inputs(job)
    inputs = ScriptInputs(job=job, plan=plan, partition=partition, run_dir=str(rdir),
                          container_argv=container_argv(job, plan, partition, rdir, job_file), job_file=job_file,
                          mpirun=mpirun)
    if python:
        inputs.python = python
    return Prepared(job, job_file, site, partition, plan, rdir, render_script(inputs))


def _check_plugins(job: JobSpec, file: str) -> None:
    """Every plugin the job names must exist (its optional packages are checked where it runs)."""
    from milehpc import plugins

    plugins.lookup("engine", job.rollout.engine, file=file, field="rollout.engine")
    plugins.lookup("trainer", job.trainer.backend, file=file, field="trainer.backend")
    if plugins.registry("advantage"):
        plugins.lookup("advantage", job.algorithm.advantage, file=file, field="algorithm.advantage")
        plugins.lookup("loss", job.algorithm.loss, file=file, field="algorithm.loss")
    if job.reward.name and ":" not in job.reward.name:
        plugins.lookup("reward", job.reward.name, file=file, field="reward.name")
    if job.data.source.startswith("task:"):
        plugins.lookup("task", job.data.source.removeprefix("task:"), file=file, field="data.source")


def check_paths(job: JobSpec, file: str) -> None:
    """The container image must exist before a real submission (a dry run may be rendered elsewhere); every other
    input is checked by :func:`prepare` (milehpc.config.inputs)."""
    image = job.container.image
    if image and not Path(image).expanduser().exists():
        raise ConfigError(f"expected an existing path, got {image!r}", file=file, field="container.image")


def write_run_dir(prep: Prepared, *, resume: bool = False) -> Path:
    """Create the run directory (mode from run.dir_mode) and write the spec, plan and script into it.

    An existing non-empty run directory is never overwritten unless this is a resume of it."""
    rdir = prep.run_dir
    if rdir.exists() and any(rdir.iterdir()) and not resume:
        raise ConfigError(f"run directory {rdir} already exists and is not empty "
                          "(resume it with --resume, or choose another run.run_dir)", field="run.run_dir")
    mode = int(prep.job.run.dir_mode, 8)
    if prep.job.container.image and prep.job.container.auto_binds:
        from milehpc.render.binds import create_writable, job_paths

        # The checkpoint dir and caches outside the run dir are bound as they are: they must exist before the job.
        create_writable(job_paths(prep.job, str(rdir), {**prep.partition.env, **prep.job.env})[1:])
    try:
        rdir.mkdir(parents=True, exist_ok=True, mode=mode)
        os.chmod(rdir, mode)
        (rdir / "logs").mkdir(exist_ok=True, mode=mode)
        _write(rdir / "job.json", json.dumps(to_dict(prep.job), indent=2) + "\n")
        _write(rdir / "plan.json", json.dumps(prep.plan.to_dict(), indent=2) + "\n")
        _write(rdir / "site.json", json.dumps({"site": to_dict(prep.site), "partition": to_dict(prep.partition)},
                                              indent=2) + "\n")
        script = rdir / "job.sbatch"
        _write(script, prep.script)
        script.chmod(0o700)
        if prep.job_file and Path(prep.job_file).is_file():
            shutil.copyfile(prep.job_file, rdir / "job.toml")
    except OSError as err:
        raise ConfigError(f"cannot write the run directory: {err.strerror}", file=str(err.filename or rdir)) from None
    return rdir


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

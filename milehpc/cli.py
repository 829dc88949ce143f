"""The milehpc command line. Commands parse, call and print; they import nothing heavy (no torch, mpi4py,
sglang or megatron on a login node): the work happens in lazily imported modules."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

from milehpc import __version__
from milehpc.errors import MilehpcError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


class Group(click.Group):
    """Turns every MilehpcError into one line on stderr and its exit code (2 for user errors)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MilehpcError as err:
            click.echo(f"milehpc: error: {err}", err=True)
            sys.exit(err.exit_code)


def _emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


site_option = click.option("--site", "-s", "site", metavar="NAME|FILE.toml",
                           help="site to run on: a name (see `milehpc sites list`; MILEHPC_SITE_PATH and "
                           "~/.config/milehpc/sites are searched) or a site TOML file; "
                           "default: the site a plugin detects, else 'local'")
set_option = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                          help="override a job-spec value (TOML syntax, validated like the file); repeatable")
run_dir_option = click.option("--run-dir", metavar="DIR", help="run directory (default: run.run_dir or runs/NAME-TIME)")
json_option = click.option("--json", "as_json", is_flag=True, help="machine-readable output")
# --force overrides every memory check (each one it overrides is named); --force-only trainer-memory (rollout-,
# reward-, colocated-, node-) that one only, so forcing past one refusal does not silently switch off the others. Two options,
# not an optional value: `--force job.toml` must not read the job file as a check name.
FORCE_CHECKS = ("trainer-memory", "rollout-memory", "reward-memory", "colocated-memory", "node-memory")


def force_option(f: Callable) -> Callable:
    """``--force`` / ``--force-only CHECK``, handed to the command as one ``force`` value ("memory", a check, None)."""

    def merge(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
        return "memory" if ctx.params.pop("force_all", False) else value

    f = click.option("--force-only", "force", metavar="CHECK", type=click.Choice(FORCE_CHECKS), callback=merge,
                     help="override this memory check only")(f)
    return click.option("--force", "force_all", is_flag=True, is_eager=True,
                        help="accept a layout the memory estimate says cannot fit its devices (see `milehpc plan`); "
                             "names every check it overrides")(f)


def _site(name: str | None) -> str:
    if name:
        return name
    import os
    import socket

    from milehpc import plugins

    return plugins.detect_site(socket.gethostname(), dict(os.environ)) or "local"


def recorded_site(run_dir: str) -> str | None:
    """The name of the site RUN_DIR's job was rendered for (its site.json), or None."""
    from pathlib import Path

    try:
        name = json.loads((Path(run_dir) / "site.json").read_text())["site"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


@click.group(cls=Group, context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="milehpc")
def cli() -> None:
    """milehpc: RL post-training of LLMs on HPC clusters, with Slurm + MPI as the control plane (no Ray).

    \b
    Examples:
      milehpc run examples/cpu-demo.toml --site local        # the CPU demo, here and now
      milehpc submit job.toml --site frontier-like --dry-run # print the sbatch script
      milehpc plan job.toml --site dgx-h100-like             # the rank layout
      milehpc sites list
    """


@cli.command(context_settings=CONTEXT)
@click.argument("job_file", metavar="[JOB.toml]", required=False, type=click.Path(dir_okay=False))
@site_option
@set_option
@run_dir_option
@click.option("--dry-run", is_flag=True, help="validate and print the script; write and submit nothing")
@click.option("--resume", "resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint")
@click.option("--after", metavar="JOBID", help="start after job JOBID ends (a Slurm dependency afterany)")
@click.option("--sweep", metavar="KEY=V1,V2,...", help="one run per value, as a Slurm job array")
@force_option
@json_option
def submit(job_file: str, site: str | None, overrides: tuple[str, ...], run_dir: str | None, dry_run: bool,
           resume: str | None, after: str | None, sweep: str | None, force: str | None, as_json: bool) -> None:
    """Validate JOB.toml for a site, write the run directory, and submit it (sbatch, or locally in the background).

    \b
    Examples:
      milehpc submit examples/frontier-grpo.toml --site frontier-like --dry-run
      milehpc submit job.toml --site local-slurm --set trainer.lr=3e-5 --json
      milehpc submit job.toml --site local-slurm --sweep trainer.lr=1e-5,3e-5,1e-4
      milehpc submit --resume runs/demo-20261129-101500 --site local-slurm --set run.steps=2000
    """
    from milehpc.scheduler import submit as submitting

    if not job_file and not resume:
        raise MilehpcError("expected a JOB.toml (or --resume RUN_DIR)", field="submit")

    # A resumed run goes back to the site it ran on (the job scripts print `submit --resume RUN_DIR` alone).
    site = site or (resume and recorded_site(resume))
    result = submitting.submit(job_file, _site(site), overrides, run_dir=run_dir, dry_run=dry_run, resume=resume,
                               after=after, sweep=sweep, force=force)
    if dry_run and not as_json:
        click.echo(result["script"], nl=False)
        return
    if as_json:
        _emit(result)
    else:
        click.echo(f"submitted job {result['job_id']} ({result['site']}); run directory {result['run_dir']}")
        if result.get("resume_from"):
            found = result["resume_from"]
            click.echo(f"resuming from {found['checkpoint'] or 'the start (no complete checkpoint yet)'}"
                       + (f" at step {found['step']}" if found["step"] is not None else "")
                       + (" (at another trainer layout: resharded)" if found.get("resharded") else ""))


@cli.command(context_settings=CONTEXT)
@click.argument("job_file", metavar="JOB.toml", type=click.Path(dir_okay=False))
@site_option
@set_option
@run_dir_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), help="write the script here")
def render(job_file: str, site: str | None, overrides: tuple[str, ...], run_dir: str | None,
           output: str | None) -> None:
    """Render the job script for a site (to stdout, or -o FILE) without writing a run directory.

    \b
    Examples:
      milehpc render job.toml --site perlmutter-like
      milehpc render job.toml --site frontier-like --set container.image=/ccs/proj/x/milehpc.sif -o job.sbatch
    """
    from pathlib import Path

    from milehpc.render.rundir import prepare

    prep = prepare(job_file, _site(site), overrides, run_dir=run_dir)
    if output:
        out = Path(output)
        if out.exists():
            raise MilehpcError(f"{out} exists; not overwriting it (remove it or choose another -o)", field="--output")
        out.write_text(prep.script)
        click.echo(f"wrote {out}", err=True)
    else:
        click.echo(prep.script, nl=False)


@cli.command(context_settings=CONTEXT)
@click.argument("job_file", metavar="JOB.toml", type=click.Path(dir_okay=False))
@site_option
@set_option
@click.option("--ranks", is_flag=True, help="also list every rank (small jobs)")
@force_option
@json_option
def plan(job_file: str, site: str | None, overrides: tuple[str, ...], ranks: bool, force: str | None, as_json: bool) -> None:
    """Show the rank layout (roles, nodes, GPUs, TP/PP/DP, engines, weight-sync groups) and the memory each rank
    needs against its device; exit code 2 when a rank cannot fit (after printing the table), unless --force.

    \b
    Examples:
      milehpc plan examples/cpu-demo.toml --site local --ranks
      milehpc plan job.toml --site frontier-like --set trainer.tp=4 --json
    """
    from dataclasses import asdict

    from milehpc import memory
    from milehpc.config.load import job_label
    from milehpc.render.rundir import prepare

    prep = prepare(job_file, _site(site), overrides, run_dir="/nonexistent/plan-only")
    layout = prep.plan
    est = memory.job_estimate(prep.job, layout, prep.partition)
    from milehpc.weights import cost

    sync = cost.for_job(prep.job, layout, prep.partition)  # the weight sync's bytes, buckets and seconds on paper
    if as_json:
        data: dict[str, Any] = {"plan": layout.to_dict(), "summary": layout.summary(),
                                "memory": _memory_json(est), "weight_sync": sync.to_json() if sync else None,
                                "weight_sync_groups": [{**g, "ranks": f"{g['ranks'][0]},{g['ranks'][1]}-{g['ranks'][-1]}"}
                                                       for g in layout.weight_sync_groups()]}
        if ranks:
            data["ranks"] = [asdict(layout.info(r)) for r in range(layout.world_size)]
        _emit(data)
    else:
        _print_plan(layout, est, ranks)
        click.echo(f"weight sync per step: {cost.summary_line(sync)}")
        for note in sync.notes if sync else ():
            click.echo(f"note: {note}")
    # After the table: the one line says what to change (--force: which checks it overrides).
    memory.for_job(prep.job, layout, prep.partition, file=job_label(job_file, overrides), force=force or False)


def _memory_json(est: Any) -> list[dict[str, Any]]:
    """The estimate's rows with sizes in bytes (numbers); each rank's total row also has its budget in bytes."""
    from milehpc.memory import table_rows

    verdicts = iter(row[3] for row in table_rows(est) if row[1] == "total")
    rows: list[dict[str, Any]] = []
    for rank in est.ranks:
        rows += [{"rank": rank.role, "item": i.name, "bytes": i.bytes, "note": i.note, "counted": True}
                 for i in rank.items]
        rows += [{"rank": rank.role, "item": i.name, "bytes": i.bytes, "note": i.note, "counted": False}
                 for i in rank.extra]
        rows.append({"rank": rank.role, "item": "total", "bytes": rank.total, "budget_bytes": rank.budget,
                     "note": next(verdicts)})
    return rows


def _print_plan(layout: Any, est: Any, ranks: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from milehpc.memory import table_rows

    console = Console()
    summary = Table(title=f"{layout.job_name} on {layout.site}/{layout.partition}", show_header=False)
    for key, value in layout.summary().items():
        summary.add_row(key, str(value))
    console.print(summary)
    if ranks:
        table = Table("rank", "role", "node", "local", "gpus", "tp", "pp", "dp", "engine")
        for r in range(min(layout.world_size, 4096)):
            i = layout.info(r)
            table.add_row(*(str(v) if v is not None else "-" for v in
                            (i.rank, i.role, i.node, i.local_rank, ",".join(map(str, i.gpus)) or "-", i.tp, i.pp,
                             i.dp, i.engine)))
        console.print(table)
    mem = Table("rank", "item", "size", "how", title="memory per rank (milehpc.memory)")
    for row in table_rows(est):
        mem.add_row(*row)
    console.print(mem)
    for note in est.notes:
        console.print(f"note: {note}", highlight=False, markup=False)


@cli.group(context_settings=CONTEXT)
def sites() -> None:
    """The sites milehpc knows (shipped in site-configs/ and from plugins)."""


@sites.command("list", context_settings=CONTEXT)
@json_option
def sites_list(as_json: bool) -> None:
    """List the sites and where they come from.

    \b
    Example:
      milehpc sites list --json
    """
    from milehpc import plugins

    entries = plugins.registry("site")
    rows = [{"name": n, "description": e.spec.description, "plugin": e.plugin, "distribution": e.distribution,
             "source": str(e.spec.impl) if isinstance(e.spec.impl, str) else "callable"}
            for n, e in sorted(entries.items())]
    if as_json:
        _emit(rows)
        return
    width = max((len(r["name"]) for r in rows), default=4)
    for row in rows:
        click.echo(f"{row['name']:<{width}}  {row['description']}  [{row['distribution']}]")


@sites.command("show", context_settings=CONTEXT)
@click.argument("name")
@json_option
def sites_show(name: str, as_json: bool) -> None:
    """Show one site's validated configuration.

    \b
    Example:
      milehpc sites show frontier-like
    """
    from milehpc.config.load import load_site
    from milehpc.config.schema import to_dict

    site, _ = load_site(name)
    data = to_dict(site)
    if as_json:
        _emit(data)
        return
    click.echo(f"{site.name}: {site.description}")
    for doc in site.docs:
        click.echo(f"  source: {doc}")
    for pname, part in site.partitions.items():
        default = " (default)" if pname == site.default_partition else ""
        dev = part.devices
        click.echo(f"  partition {pname}{default}: {part.scheduler}, {part.launcher.kind}, "
                   f"{dev.count} x {dev.vendor} {dev.arch}"
                   + (f" ({dev.memory_gib:g} GiB)" if dev.memory_gib else "")
                   + f" per node, {part.slots_per_node} ranks/node, "
                   f"max {part.max_nodes} nodes, time limit {part.time_limit}")


@cli.group(context_settings=CONTEXT, invoke_without_command=True)
@json_option
@click.pass_context
def plugins(ctx: click.Context, as_json: bool) -> None:
    """List every loaded plugin: what it registers, from which distribution and version.

    \b
    Examples:
      milehpc plugins --json
      milehpc plugins show sort          # the parameters a plugin takes
    """
    if ctx.invoked_subcommand is not None:
        return
    from milehpc import plugins as registry
    from milehpc.plugin_types import KINDS

    pm = registry.get_plugin_manager()
    dists = registry.distributions()
    out: dict[str, dict[str, Any]] = {}
    for plugin_name, plugin in pm.list_name_plugin():
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        out[plugin_name] = {"distribution": dists.get(plugin_name, "-"), "hooks": hooks, "registers": {}}
    for kind in KINDS:
        for name, entry in registry.registry(kind).items():
            out.setdefault(entry.plugin, {"distribution": entry.distribution, "hooks": [], "registers": {}})
            out[entry.plugin]["registers"].setdefault(kind, []).append(name)
    if as_json:
        _emit(out)
        return
    for plugin_name, info in sorted(out.items()):
        click.echo(f"{plugin_name}  [{info['distribution']}]")
        for kind, names in sorted(info["registers"].items()):
            click.echo(f"    {kind}: {', '.join(sorted(names))}")


@plugins.command("show", context_settings=CONTEXT)
@click.argument("name", metavar="[KIND:]NAME")
@json_option
def plugins_show(name: str, as_json: bool) -> None:
    """Show the parameters a plugin takes: type, default, range, help (its declared schema).

    \b
    Examples:
      milehpc plugins show sort
      milehpc plugins show reward:math_answer --json
    """
    from milehpc.config.schema import schema_rows
    from milehpc.plugins import find_named

    found = find_named(name)
    if as_json:
        _emit([{"kind": kind, "name": entry.spec.name, "description": entry.spec.description,
                "parameters": schema_rows(entry.spec)} for kind, entry in found])
        return
    for kind, entry in found:
        click.echo(f"{kind} {entry.spec.name}  [{entry.distribution}]  {entry.spec.description}")
        rows = schema_rows(entry.spec)
        if not rows:
            click.echo("    (no parameters)")
        for row in rows:
            limits = f"; {row['range']}" if row["range"] else ""
            click.echo(f"    {row['name']}: {row['type']} = {row['default']}{limits}"
                       + (f"  {row['help']}" if row["help"] else ""))


@cli.command(context_settings=CONTEXT)
@click.argument("section", required=False, metavar="[SECTION]")
@json_option
def spec(section: str | None, as_json: bool) -> None:
    """List the job-spec fields: type, default, range, help (every table, or one: model, trainer.lora, ...).

    \b
    Examples:
      milehpc spec
      milehpc spec trainer --json
    """
    from milehpc.config.spec_fields import spec_rows

    rows = spec_rows(section)
    if as_json:
        _emit(rows)
        return
    for row in rows:
        limits = f"; {row['range']}" if row["range"] else ""
        click.echo(f"{row['name']}: {row['type']} = {row['default']}{limits}" + (f"  {row['help']}" if row["help"]
                                                                               else ""))


@cli.command(context_settings=CONTEXT)
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell-completion script.

    \b
    Example:
      eval "$(milehpc completion bash)"
    """
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None
    click.echo(cls(cli, {}, "milehpc", "_MILEHPC_COMPLETE").source())


def main() -> None:
    from milehpc.hygiene import install_log_masking

    install_log_masking()  # secrets in the environment never reach what milehpc logs
    cli(prog_name="milehpc")


# Commands of later areas (launch, run, status, logs, ...) are added below.


@cli.command(context_settings=CONTEXT)
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--entry", metavar="MODULE:FUNCTION", help="call this with the RunContext instead of the RL loop")
@click.option("--elastic", type=click.Choice(["trainer", "engine"]), default=None,
              help="elastic rollout: the trainer ranks' step, or a rollout node's engines (the job script says which)")
@click.option("--engine-base", type=int, default=0, help="elastic engines: the first engine id of this step")
def launch(run_dir: str, entry: str | None, elastic: str | None, engine_base: int) -> None:
    """Run one rank of a job (every rank runs this under srun or mpirun; `submit` writes the call).

    \b
    Example:
      mpirun -np 4 milehpc launch runs/demo-20260101-120000
    """
    from milehpc.runtime.launch import launch as run_rank

    run_rank(run_dir, entry, elastic=elastic, engine_base=engine_base)


# ---- the job lifecycle (issue 3): status, logs, cancel, jobs, doctor ------------------------------------------

def _job_id(target: str) -> str:
    """A job id as given, or the newest recorded job of a run directory (as `stop` takes them)."""
    from pathlib import Path

    from milehpc.scheduler.stop import check_run_dir, job_of

    if not Path(target).expanduser().is_dir():
        return target
    run_dir = check_run_dir(Path(target).expanduser())
    job_id = job_of(run_dir)
    if job_id is None:
        raise MilehpcError(f"no milehpc job record for {run_dir} (submitted from another machine or user?)",
                           field="JOBID|RUN_DIR")
    return job_id


@cli.command(context_settings=CONTEXT)
@click.argument("job_ids", metavar="[JOBID|RUN_DIR]...", nargs=-1)
@json_option
def status(job_ids: tuple[str, ...], as_json: bool) -> None:
    """State of jobs (squeue, then sacct, then scontrol); no JOBID = this user's recent milehpc jobs.

    \b
    Examples:
      milehpc status 1234 1235_2
      milehpc status runs/demo-20250101-1200
      milehpc status --json
    """
    from milehpc.scheduler import lifecycle

    job_ids = tuple(_job_id(t) for t in job_ids)
    ids = list(job_ids) or [r["job_id"] for r in lifecycle.jobs(limit=20, with_status=False)]
    if not ids:  # nothing submitted yet is no error (as `jobs`)
        if as_json:
            _emit([])
        else:
            click.echo("no milehpc jobs recorded yet")
        return
    rows = lifecycle.status(ids)
    if as_json:
        _emit([r.to_dict() for r in rows])
    else:
        for r in rows:
            detail = ", ".join(x for x in (r.reason, f"exit {r.exit_code}" if r.exit_code else "",
                                           f"restarts {r.restarts}" if r.restarts else "",
                                           f"elapsed {r.elapsed}" if r.elapsed else "") if x)
            click.echo(f"{r.job_id:<12} {r.state:<11} {r.name:<20} {detail}"
                       + (f"  [{r.extra['run_dir']}]" if r.extra.get("run_dir") else ""))
    if any(r.state == "UNKNOWN" for r in rows) and job_ids:
        unknown = [r.job_id for r in rows if r.state == "UNKNOWN"]
        raise MilehpcError(f"unknown job id(s): {', '.join(unknown)} (not in squeue, sacct or scontrol)",
                           field="JOBID")


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", metavar="JOBID|RUN_DIR")
@click.option("-f", "--follow", is_flag=True, help="keep printing new output until the job ends")
@click.option("--rank", type=click.IntRange(min=0), metavar="N", help="only rank N (its own log file, if written)")
@click.option("--path", "path_only", is_flag=True, help="print the log file's path instead of its content")
def logs(job_id: str, follow: bool, rank: int | None, path_only: bool) -> None:
    """Print a job's output: the batch log, or one rank's log with --rank.

    \b
    Examples:
      milehpc logs 1234 -f
      milehpc logs 1234 --rank 3
      milehpc logs 1234_2          # element 2 of a sweep
      milehpc logs runs/demo-20250101-1200
    """
    from milehpc.scheduler import lifecycle

    job_id = _job_id(job_id)
    if path_only:
        click.echo(str(lifecycle.log_path(job_id, rank)))
        return
    lifecycle.print_log(job_id, rank=rank, follow=follow)


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", metavar="JOBID")
def cancel(job_id: str) -> None:
    """Cancel a job (scancel; a local job gets SIGTERM).

    \b
    Example:
      milehpc cancel 1234
    """
    from milehpc.scheduler import lifecycle

    click.echo(lifecycle.cancel(job_id))


@cli.command(context_settings=CONTEXT)
@click.argument("target", metavar="JOBID|RUN_DIR")
def stop(target: str) -> None:
    """Checkpoint and end a running job without a requeue (a pending job is cancelled); resume it later.

    \b
    Examples:
      milehpc stop 1234
      milehpc stop runs/demo-20250101-1200
      milehpc submit --resume runs/demo-20250101-1200     # later: continue from that checkpoint
    """
    from milehpc.scheduler.stop import stop as stop_job

    for line in stop_job(target):
        click.echo(line)


@cli.command(context_settings=CONTEXT)
@click.option("-n", "--last", "limit", type=click.IntRange(min=0), default=20, show_default=True,
              help="how many of the newest jobs (0 = all)")
@json_option
def jobs(limit: int, as_json: bool) -> None:
    """This user's milehpc jobs (from the local record of submissions), with state and run directory.

    \b
    Example:
      milehpc jobs --last 5
    """
    from milehpc.scheduler import lifecycle

    rows = lifecycle.jobs(limit=limit or None)
    if as_json:
        _emit(rows)
        return
    if not rows:
        click.echo("no milehpc jobs recorded yet")
        return
    for r in rows:
        sweep = f" sweep {r['sweep']['key']}={','.join(r['sweep']['values'])}" if r.get("sweep") else ""
        click.echo(f"{r['job_id']:<12} {r['state']:<11} {r['name']:<20} {r['site']:<16} {r['submitted']}  "
                   f"{r['run_dir']}{sweep}")


@cli.command(context_settings=CONTEXT)
@site_option
@click.argument("job_file", metavar="[JOB.toml]", required=False, type=click.Path(dir_okay=False))
@json_option
def doctor(site: str | None, job_file: str | None, as_json: bool) -> None:
    """Check what a run on a site needs, here (login node) or inside a job; one line per finding.

    Checks Slurm (sbatch/srun, slurmctld, the partition), mpi4py's MPI library against the launcher's PMI,
    GPUs against the site, the collective-network variables, modules, the container runtime and image.
    Exit code 1 when something FAILs.

    \b
    Examples:
      milehpc doctor --site frontier-like
      milehpc doctor --site local-slurm job.toml --json
    """
    from milehpc.doctor import FAIL, run_doctor

    findings = run_doctor(_site(site), job_file)
    if as_json:
        _emit([f.__dict__ for f in findings])
    else:
        for f in findings:
            click.echo(f.line())
    if any(f.level == FAIL for f in findings):
        sys.exit(1)


# ---- the RL loop (issue 6): run, rollouts, plot -------------------------------------------------------------

@cli.command("run", context_settings=CONTEXT)
@click.argument("job_file", metavar="JOB.toml", type=click.Path(dir_okay=False))
@site_option
@set_option
@run_dir_option
@force_option
def run_cmd(job_file: str, site: str | None, overrides: tuple[str, ...], run_dir: str | None,
            force: str | None) -> None:
    """Write the run directory like `submit`, then run the job here in the foreground (mpirun on the local site).

    \b
    Examples:
      milehpc run examples/cpu-demo.toml --site local
      milehpc run examples/cpu-demo.toml --set run.steps=50 --set run.loop=sync
    """
    from milehpc.runtime.foreground import run_job, summary

    code, rdir = run_job(job_file, _site(site), overrides, run_dir=run_dir, force=force)
    line = summary(rdir)
    if line:
        click.echo(f"milehpc: {line}")
    if code:
        click.echo(f"milehpc: error: the job exited with code {code} (logs in {rdir})", err=True)
        sys.exit(code)


@cli.command(context_settings=CONTEXT)
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--step", type=click.IntRange(min=0), required=True, help="the step whose rollouts to show")
@click.option("-n", "--limit", type=click.IntRange(min=0), default=20, show_default=True, help="samples (0 = all)")
@json_option
def rollouts(run_dir: str, step: int, limit: int, as_json: bool) -> None:
    """Show the rollouts dumped at one step (RUN_DIR/rollouts/step_NNNNNN.h5): prompt, response, reward.

    \b
    Example:
      milehpc rollouts runs/cpu-demo-20261129-120000 --step 10 -n 5
    """
    from milehpc.runtime.foreground import format_rollouts

    rows, attrs = format_rollouts(run_dir, step, limit=limit)
    if as_json:
        _emit({"attrs": attrs, "samples": rows})
        return
    click.echo(f"step {step}: {attrs['samples']} samples, mean reward {attrs['reward_mean']:.3f}")
    for r in rows:
        click.echo(f"[{r['group']}:{r['index']}] v{r['version']} {r['status']:<9} reward {r['reward']:.3f}  "
                   f"{r['prompt']!r} -> {r['response']!r} (label {r['label']!r}, {len(r['response_ids'])} tokens)")


# ---- eval (issue 16 item 3) ------------------------------------------------------------------------------------

@cli.command("eval", context_settings=CONTEXT)
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--data", required=True, metavar="FILE", help="the prompts: .jsonl / .parquet / datasets folder, or "
              "task:NAME (read like data.val_source)")
@click.option("--step", type=click.IntRange(min=0), metavar="N", help="the checkpoint of step N (default: newest)")
@click.option("--n", "n_samples", type=click.IntRange(min=0), metavar="K", help="sampled answers per prompt "
              "(eval.n_samples)")
@click.option("--k", "pass_k", type=click.IntRange(min=1), multiple=True, help="a pass@k to report; repeatable "
              "(eval.pass_k)")
@click.option("--greedy/--no-greedy", default=None, help="one greedy answer per prompt (eval.greedy)")
@click.option("--temperature", type=float, help="of the sampled answers (eval.temperature)")
@click.option("--max-prompts", type=click.IntRange(min=0), help="the first this many prompts (eval.max_prompts)")
@click.option("--adapter", help="a multi-LoRA run: the adapter to evaluate (its policy and its reward)")
@click.option("--force", is_flag=True, help="replace an earlier RUN_DIR/eval/step_N.json")
@json_option
def eval_cmd(run_dir: str, data: str, step: int | None, n_samples: int | None, pass_k: tuple[int, ...],
             greedy: bool | None, temperature: float | None, max_prompts: int | None, adapter: str | None,
             force: bool, as_json: bool) -> None:
    """Evaluate a run's checkpoint on a prompt file with the job's engine, rewards and [eval] settings: accuracy,
    pass@k and mean reward per data source; writes RUN_DIR/eval/step_N.json (step_N.ADAPTER.json). Megatron
    checkpoints are read like `milehpc export` reads them.

    \b
    Examples:
      milehpc eval runs/demo-20260101-120000 --data data/val.jsonl
      milehpc eval runs/demo-20260101-120000 --step 40 --data data/val.jsonl --n 8 --k 1 --k 4
      milehpc eval runs/multi-lora-20260101-120000 --adapter rev --data task:reverse --max-prompts 64
    """
    from milehpc.runtime.evaluate_checkpoint import evaluate_checkpoint, metrics_table

    given = {"n_samples": n_samples, "pass_k": list(pass_k) or None, "greedy": greedy, "temperature": temperature,
             "max_prompts": max_prompts}
    report = evaluate_checkpoint(run_dir, data, step=step, force=force, adapter=adapter,
                                 overrides={k: v for k, v in given.items() if v is not None})
    if as_json:
        _emit({"step": report.step, "file": str(report.path), "metrics": report.metrics, "notes": report.notes})
        return
    for note in report.notes:
        click.echo(f"milehpc: note: {note}")
    click.echo(f"checkpoint step {report.step} (metrics step {report.step - 1}) on {data}:")
    click.echo(f"{'source':<20} {'prompts':>7} {'acc':>6}  {'reward':>6}  pass@k")
    for name, prompts, acc, passes, reward in metrics_table(report.metrics, report.sources):
        click.echo(f"{name:<20} {prompts:>7} {acc:>6}  {reward:>6}  {passes}")
    click.echo(f"milehpc: wrote {report.path}")


@cli.command(context_settings=CONTEXT)
@click.argument("run_dirs", metavar="RUN_DIR...", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="PNG path (default RUN_DIR/reward.png; one "
              "RUN_DIR only)")
@click.option("--metric", default="rollout/reward_mean", show_default=True, help="the metric to plot")
def plot(run_dirs: tuple[str, ...], output: str | None, metric: str) -> None:
    """Write a PNG of the reward curve of each run (needs matplotlib: pip install 'milehpc[plot]').

    \b
    Examples:
      milehpc plot runs/cpu-demo-20261129-120000
      milehpc plot runs/cpu-demo-*/                 # one RUN_DIR/reward.png each
    """
    if output and len(run_dirs) > 1:
        raise MilehpcError(f"expected one RUN_DIR with -o, got {len(run_dirs)} (each run gets RUN_DIR/reward.png "
                           "without -o)", field="--output")
    from milehpc.errors import missing_dependency

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise missing_dependency("milehpc plot", "matplotlib", extra="plot") from None
    from milehpc.runtime.metrics import plot_rewards

    for run_dir in run_dirs:
        click.echo(str(plot_rewards(run_dir, output, metric)))


# ---- export (issues 16 and 19) ---------------------------------------------------------------------------------

@cli.command(context_settings=CONTEXT)
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("-o", "--output", "out", required=True, type=click.Path(), metavar="DIR", help="the folder to write")
@click.option("--step", type=click.IntRange(min=0), metavar="N", help="the checkpoint of step N (default: newest)")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), help="weights' dtype (default: as trained)")
@click.option("--adapter", is_flag=True, help="LoRA run: the peft adapter folder alone (multi-LoRA: DIR/NAME/ for "
                                              "each adapter)")
@click.option("--merged", is_flag=True, help="LoRA run: the base with the adapter merged (the default for LoRA; "
                                             "multi-LoRA: one merged folder DIR/NAME/ per adapter)")
@click.option("--force", is_flag=True, help="replace a non-empty DIR")
def export(run_dir: str, out: str, step: int | None, dtype: str | None, adapter: bool, merged: bool,
           force: bool) -> None:
    """Write a run's checkpoint as a Hugging Face folder (safetensors, config, generation config, tokenizer,
    milehpc_export.json) that transformers loads and SGLang serves; torch or Megatron checkpoints at any layout.

    \b
    Examples:
      milehpc export runs/demo-20260101-120000 -o hf/demo --dtype bf16
      milehpc export runs/lora-20260101-120000 -o hf/adapter --adapter --step 40
      huggingface-cli upload me/demo hf/demo          # afterwards, where there is a network
    """
    from milehpc.export import export_run

    done = export_run(run_dir, out, step=step, dtype=dtype, adapter=adapter, merged=merged, force=force)
    for note in done.notes:
        click.echo(f"milehpc: note: {note}")
    click.echo(f"milehpc: wrote {done.out} ({done.kind}, step {done.step}, weight version {done.weight_version}, "
               f"{done.dtype}): {', '.join(done.files)}")

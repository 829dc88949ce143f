"""The milehpc command line. Commands parse, call and print; they import nothing heavy (no torch, mpi4py,
sglang or megatron on a login node): the work happens in lazily imported modules."""

from __future__ import annotations

import json
import sys
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


site_option = click.option("--site", "-s", "site", metavar="NAME", help="site to run on (see `milehpc sites list`); "
                           "default: the site a plugin detects, else 'local'")
set_option = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                          help="override a job-spec value (TOML syntax, validated like the file); repeatable")
run_dir_option = click.option("--run-dir", metavar="DIR", help="run directory (default: run.run_dir or runs/NAME-TIME)")
json_option = click.option("--json", "as_json", is_flag=True, help="machine-readable output")


def _site(name: str | None) -> str:
    if name:
        return name
    import os
    import socket

    from milehpc import plugins

    return plugins.detect_site(socket.gethostname(), dict(os.environ)) or "local"


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
@click.argument("job_file", metavar="JOB.toml", type=click.Path(dir_okay=False))
@site_option
@set_option
@run_dir_option
@click.option("--dry-run", is_flag=True, help="validate and print the script; write and submit nothing")
@click.option("--resume", "resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint")
@click.option("--after", metavar="JOBID", help="start after job JOBID ends (a Slurm dependency afterany)")
@click.option("--sweep", metavar="KEY=V1,V2,...", help="one run per value, as a Slurm job array")
@json_option
def submit(job_file: str, site: str | None, overrides: tuple[str, ...], run_dir: str | None, dry_run: bool,
           resume: str | None, after: str | None, sweep: str | None, as_json: bool) -> None:
    """Validate JOB.toml for a site, write the run directory, and submit it (sbatch, or locally in the background).

    \b
    Examples:
      milehpc submit examples/frontier-grpo.toml --site frontier-like --dry-run
      milehpc submit job.toml --site local-slurm --set trainer.lr=3e-5 --json
      milehpc submit job.toml --site local-slurm --sweep trainer.lr=1e-5,3e-5,1e-4
      milehpc submit --resume runs/demo-20261129-101500 job.toml --site local-slurm
    """
    from milehpc.scheduler import submit as submitting

    result = submitting.submit(job_file, _site(site), overrides, run_dir=run_dir, dry_run=dry_run, resume=resume,
                               after=after, sweep=sweep)
    if dry_run and not as_json:
        click.echo(result["script"], nl=False)
        return
    if as_json:
        _emit(result)
    else:
        click.echo(f"submitted job {result['job_id']} ({result['site']}); run directory {result['run_dir']}")


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
@json_option
def plan(job_file: str, site: str | None, overrides: tuple[str, ...], ranks: bool, as_json: bool) -> None:
    """Show the rank layout: roles, nodes, GPUs, TP/PP/DP, engines, weight-sync groups.

    \b
    Examples:
      milehpc plan examples/cpu-demo.toml --site local --ranks
      milehpc plan job.toml --site frontier-like --set trainer.tp=4 --json
    """
    from dataclasses import asdict

    from milehpc.render.rundir import prepare

    prep = prepare(job_file, _site(site), overrides, run_dir="/nonexistent/plan-only")
    layout = prep.plan
    if as_json:
        data: dict[str, Any] = {"plan": layout.to_dict(), "summary": layout.summary(),
                                "weight_sync_groups": [{**g, "ranks": f"{g['ranks'][0]},{g['ranks'][1]}-{g['ranks'][-1]}"}
                                                       for g in layout.weight_sync_groups()]}
        if ranks:
            data["ranks"] = [asdict(layout.info(r)) for r in range(layout.world_size)]
        _emit(data)
        return
    from rich.console import Console
    from rich.table import Table

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
                   f"{dev.count} x {dev.vendor} {dev.arch} per node, {part.slots_per_node} ranks/node, "
                   f"max {part.max_nodes} nodes, time limit {part.time_limit}")


@cli.command(context_settings=CONTEXT)
@json_option
def plugins(as_json: bool) -> None:
    """List every loaded plugin: what it registers, from which distribution and version.

    \b
    Example:
      milehpc plugins --json
    """
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
    cli(prog_name="milehpc")


# Commands of later areas (launch, run, status, logs, ...) are added below.

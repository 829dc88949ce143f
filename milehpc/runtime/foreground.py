"""``milehpc run``: prepare a run directory exactly as ``submit`` does, then run the job here, in the foreground
(through the site's launcher: mpirun on ``local``; on a Slurm site, inside an allocation, its srun line).

Login-node safe: imports nothing heavy."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def run_job(job_file: str, site: str, overrides: tuple[str, ...] = (), *, run_dir: str | None = None,
            force: bool | str | None = None) -> tuple[int, Path]:
    """Returns (exit code of the job script, run directory)."""
    import os
    import sys

    from milehpc.config.load import job_label
    from milehpc.memory import for_job
    from milehpc.render.rundir import check_paths, prepare, write_run_dir
    from milehpc.scheduler.local import run_foreground

    prep = prepare(job_file, site, overrides, run_dir=run_dir)
    # As submit: ranks that cannot fit their devices (or, on a CPU site, this machine) are refused here.
    for_job(prep.job, prep.plan, prep.partition, file=job_label(job_file, overrides), force=force or False)
    check_paths(prep.job, job_file)
    # The job runs here: sglang / torch_memory_saver / transformer-engine must be here too (one line, exit 2).
    from milehpc.config.requirements import check_requirements

    check_requirements(prep.job)
    rdir = write_run_dir(prep)
    print(f"milehpc: run directory {rdir} ({prep.plan.world_size} ranks on {prep.site.name})", flush=True)
    # The ranks' stdout is a pty under mpirun whatever ours is: tell them whether a live bar makes sense.
    os.environ.setdefault("MILEHPC_PROGRESS", "rich" if sys.stdout.isatty() else "plain")
    return run_foreground(rdir / "job.sbatch", rdir), rdir


def summary(run_dir: Path) -> str:
    """One line: mean reward of the first and of the last 10 steps, steps, wall time (from metrics.jsonl)."""
    from milehpc.runtime.metrics import read_metrics

    try:
        records = [r for r in read_metrics(run_dir) if "rollout/reward_mean" in r]
    except Exception:  # noqa: BLE001 - a failed run may have no metrics; the job's own error was shown
        return ""
    if not records:
        return ""
    rewards = [r["rollout/reward_mean"] for r in records]
    k = min(10, len(rewards))
    last = records[-1]
    return (f"mean reward {sum(rewards[:k]) / k:.3f} (first {k} steps) -> {sum(rewards[-k:]) / k:.3f} (last {k}), "
            f"best step {max(rewards):.3f}; {len(records)} steps in {last.get('time/elapsed', last['time']):.0f}s; "
            f"metrics {run_dir / 'metrics.jsonl'}, TensorBoard {run_dir / 'tensorboard'}")


def format_rollouts(run_dir: str, step: int, *, limit: int = 20) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows for ``milehpc rollouts``: one per sample (prompt, response, reward, status, version, tokens)."""
    from milehpc.samples.dumps import read_rollouts

    samples, attrs = read_rollouts(run_dir, step)
    rows = [{"index": s.index, "group": s.group, "prompt": s.prompt_text, "response": s.response_text,
             "label": s.label, "reward": s.scalar_reward, "status": s.status.value, "version": s.weight_version,
             "response_ids": s.response_ids,
             "logprobs": [round(x, 4) for x in s.rollout_logprobs], "loss_mask": s.loss_mask}
            for s in samples[: limit or None]]
    attrs = {**attrs, "samples": len(samples),
             "reward_mean": sum(s.scalar_reward for s in samples) / max(len(samples), 1)}
    return rows, attrs

"""One-step-off async vs the sync loop, side by side in one run, through `milehpc run --site local`
(1 rollout rank + 1 trainer rank under mpirun, real weight sync over gloo).

Generation and training are made comparable in cost (random policy: every response runs to max_new_tokens).
The step period is measured from the trainer leader's metrics.jsonl timestamps over the steady-state steps;
gen and train are the per-step medians each side reports.

The yardstick is uncontended: the sync loop of the same run, where the two ranks take turns (the waiting one
sleeps), gives generation and training times without the other side competing for the cores, memory bandwidth
and caches. The one-step-off goal: period <= 1.1 x max(gen, train) of those sync-loop phases. The async run's own
gen and train are printed too: their excess over the sync ones is what running the two sides at once costs
(contention), which dividing by them would hide. ``--profile`` prints each rank's per-phase medians of both loops.
Last line: one JSON object.

    .venv/bin/python bench/async_loop.py [--steps 30] [--max-new-tokens 12] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = """
name = "bench-async-{loop}"
[model]
hidden_size = 128
num_layers = 2
num_heads = 4
num_kv_heads = 2
intermediate_size = 256
max_position_embeddings = 64
[data]
source = "task:sort"
[rollout]
prompts_per_step = {prompts}
n_samples = 8
max_new_tokens = {tokens}
[trainer]
micro_batch_size = 128
lr = 1e-5
[run]
steps = {steps}
loop = "{loop}"
dump_rollouts = false
"""


def run(loop: str, args: argparse.Namespace, work: Path) -> dict[str, float]:
    job = work / f"{loop}.toml"
    job.write_text(JOB.format(loop=loop, steps=args.steps, tokens=args.max_new_tokens, prompts=args.prompts))
    rdir = work / f"run-{loop}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILEHPC_PROGRESS": "plain"}
    milehpc = Path(sys.executable).with_name("milehpc")
    proc = subprocess.run([str(milehpc), "run", str(job), "--site", "local", "--run-dir", str(rdir)],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{loop} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    recs = [json.loads(line) for line in (rdir / "metrics.jsonl").read_text().splitlines()]
    steady = recs[args.skip:]
    period = (steady[-1]["time"] - steady[0]["time"]) / (len(steady) - 1)
    # Medians: one step that a neighbouring process slowed does not move them.
    phases = {k: statistics.median(r.get(k, 0.0) for r in steady)
              for k in sorted({k for r in steady for k in r if k.startswith("time/") and k != "time/elapsed"})}
    return {"period_s": period, "gen_s": phases.get("time/gen", 0.0), "train_s": phases.get("time/train", 0.0),
            "sync_s": phases.get("time/sync", 0.0),
            "staleness": statistics.mean(r.get("async/staleness_max", 0.0) for r in steady), "phases": phases}


# --profile: each rank's phases of one step, in the order they happen ("rest" = the step less the named phases:
# the loop's own bookkeeping, pickling and MPI messages).
ROLLOUT_PHASES = ("time/wait_weights", "time/load_weights", "time/gen", "time/reward")
TRAINER_PHASES = ("time/wait_batch", "time/train_prepare", "time/train_fwd_bwd", "time/train_optim", "time/train",
                  "time/sync_export", "time/sync", "time/step")


def profile(runs: dict[str, dict]) -> None:
    """The per-phase medians of both loops, per rank, in ms."""
    print(f"\n{'rank: phase (median ms)':<34}" + "".join(f"{name:>14}" for name in runs))
    for rank, keys in (("rollout", ROLLOUT_PHASES), ("trainer", TRAINER_PHASES)):
        for k in keys:
            print(f"{rank + ': ' + k.removeprefix('time/'):<34}"
                  + "".join(f"{r['phases'][k] * 1e3:>14.1f}" if k in r["phases"] else f"{'-':>14}"
                            for r in runs.values()))
    for name, r in runs.items():
        p = r["phases"]
        train_rest = p.get("time/train", 0.0) - sum(p.get(k, 0.0) for k in TRAINER_PHASES[1:4])
        step_rest = p.get("time/step", 0.0) - sum(p.get(k, 0.0) for k in ("time/wait_batch", "time/train",
                                                                             "time/sync"))
        print(f"{name}: trainer step less its phases {step_rest * 1e3:.1f} ms (loop bookkeeping, MPI), train less "
              f"prepare/fwd-bwd/optim {train_rest * 1e3:.1f} ms (metrics, all-reduces)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the averages")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--profile", action="store_true", help="print each rank's per-phase medians of both loops")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="milehpc-bench-") as tmp:
        sync = run("sync", args, Path(tmp))
        off = run("one_step_off", args, Path(tmp))
    bound = max(sync["gen_s"], sync["train_s"])  # uncontended: the sync loop's phases
    own = max(off["gen_s"], off["train_s"])  # the async run's own, contended phases
    print(f"{'loop':<14}{'step period':>12}{'gen':>9}{'train':>9}{'sync':>9}{'staleness':>11}")
    for name, r in (("sync", sync), ("one_step_off", off)):
        print(f"{name:<14}{r['period_s']:>11.3f}s{r['gen_s']:>8.3f}s{r['train_s']:>8.3f}s{r['sync_s']:>8.3f}s"
              f"{r['staleness']:>11.2f}")
    result = {
        "one_step_off_period_s": round(off["period_s"], 4), "sync_period_s": round(sync["period_s"], 4),
        "gen_s": round(sync["gen_s"], 4), "train_s": round(sync["train_s"], 4),
        "ratio_vs_max_gen_train": round(off["period_s"] / bound, 3),
        "ratio_vs_sync": round(off["period_s"] / sync["period_s"], 3),
        "sync_ratio_vs_gen_plus_train": round(sync["period_s"] / (sync["gen_s"] + sync["train_s"]), 3),
        # What overlapping costs: the async run's gen and train over the sync loop's, and its period over its own.
        "contention_gen": round(off["gen_s"] / sync["gen_s"], 3),
        "contention_train": round(off["train_s"] / sync["train_s"], 3),
        "ratio_vs_own_max_gen_train": round(off["period_s"] / own, 3),
        "goal_met": off["period_s"] <= 1.1 * bound, "steps": args.steps,
    }
    print(f"one-step-off period / max(gen, train) of the sync loop = {result['ratio_vs_max_gen_train']} (goal <= 1.1);"
          f" one-step-off / sync = {result['ratio_vs_sync']}; overlapped, gen takes {result['contention_gen']}x and "
          f"train {result['contention_train']}x their sync-loop times")
    if args.profile:
        profile({"sync": sync, "one_step_off": off})
    print(json.dumps(result))


if __name__ == "__main__":
    main()

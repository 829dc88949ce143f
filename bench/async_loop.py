"""One-step-off async vs the sync loop, side by side in one run, through `milehpc run --site local`
(1 rollout rank + 1 trainer rank under mpirun, real weight sync over gloo).

Generation and training are made comparable in cost (random policy: every response runs to max_new_tokens).
The step period is measured from the trainer leader's metrics.jsonl timestamps over the steady-state steps;
gen and train are the per-step means each side reports. The one-step-off goal: period <= 1.1 x max(gen, train).
Last line: one JSON object.

    .venv/bin/python bench/async_loop.py [--steps 30] [--max-new-tokens 12]
"""

from __future__ import annotations

import argparse
import json
import os
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

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in steady) / len(steady)

    return {"period_s": period, "gen_s": mean("time/gen"), "train_s": mean("time/train"),
            "sync_s": mean("time/sync"), "staleness": mean("async/staleness_max")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the averages")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="milehpc-bench-") as tmp:
        sync = run("sync", args, Path(tmp))
        off = run("one_step_off", args, Path(tmp))
    bound = max(off["gen_s"], off["train_s"])
    print(f"{'loop':<14}{'step period':>12}{'gen':>9}{'train':>9}{'sync':>9}{'staleness':>11}")
    for name, r in (("sync", sync), ("one_step_off", off)):
        print(f"{name:<14}{r['period_s']:>11.3f}s{r['gen_s']:>8.3f}s{r['train_s']:>8.3f}s{r['sync_s']:>8.3f}s"
              f"{r['staleness']:>11.2f}")
    result = {
        "one_step_off_period_s": round(off["period_s"], 4), "sync_period_s": round(sync["period_s"], 4),
        "gen_s": round(off["gen_s"], 4), "train_s": round(off["train_s"], 4),
        "ratio_vs_max_gen_train": round(off["period_s"] / bound, 3),
        "ratio_vs_sync": round(off["period_s"] / sync["period_s"], 3),
        "sync_ratio_vs_gen_plus_train": round(sync["period_s"] / (sync["gen_s"] + sync["train_s"]), 3),
        "goal_met": off["period_s"] <= 1.1 * bound, "steps": args.steps,
    }
    print(f"one-step-off period / max(gen, train) = {result['ratio_vs_max_gen_train']} (goal <= 1.1); "
          f"one-step-off / sync = {result['ratio_vs_sync']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

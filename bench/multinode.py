"""Reaction to a node's death on the multi-node test cluster (tests/cluster/multinode.sh, started if needed, as root).

For each scenario a small RL job (tests/ckpt_helpers.py's, one rank per node, checkpoint every 2 steps, a fixed delay
per step so that the node dies mid-run) is submitted with `milehpc submit --site local-multinode`; once a checkpoint
exists the node goes, and the benchmark measures:

- reaction_s: from the kill (or the cut) to the job leaving RUNNING (milehpc requeued it, or Slurm ended it);
- rank_error_s: from the kill (or the cut) to a rank's one-line error in the batch log (None: the ranks were killed
  by the step's abort before any spoke);
- steps_lost: steps finished before the death that the requeued run repeats (after its last checkpoint);
- named: the batch log names the dead node; requeued_without: Slurm's ExcNodeList after milehpc's requeue.

Scenarios: rollout node killed (2-node job), trainer node killed (3-node job, the second trainer rank's node: the first
holds the batch shell, whose own death Slurm handles after SlurmdTimeout), rollout node cut off the network.

``elastic``: the same job with ``resources.elastic_rollout`` (trainer on one node, an engine on each of two, one spare
node; the reward sleeps a fixed time per prompt, so a step's time follows the engines that serve it); engine 0's node
is killed after a few steps. Measured: reaction_s (the kill to the trainer's line naming the lost engine: it goes
on), spare_join_s (the kill to the spare node's engine joining), steps lost (none: every step's metrics, in order)
and the throughput (samples per second of step time) before the shrink, while shrunk (one engine) and after the
spare's engine joined.
Last line: one JSON object.

    .venv/bin/python bench/multinode.py [--scenarios rollout-kill,trainer-kill,partition,elastic]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "cluster")]

import multinode_harness as mn  # noqa: E402
from ckpt_helpers import job_toml  # noqa: E402

SCENARIOS = {  # name -> (trainer dp, rank whose node goes, action); "elastic": run_elastic
    "rollout-kill": (1, 1, "kill"),
    "trainer-kill": (2, 1, "kill"),
    "partition": (1, 1, "cut"),
}
STEPS, DELAY = 16, 1.0


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def run(name: str, cli: mn.Cli) -> dict:
    from milehpc.scheduler.slurm import query

    dp, rank, action = SCENARIOS[name]
    base = mn.workdir(f"bench-{name}")
    add = {"resources": 'collective_timeout_s = 10\ntime = "00:10:00"'}
    if dp > 1:
        add["trainer"] = f"dp = {dp}"
    job = base / "job.toml"
    job.write_text(job_toml(STEPS, extra="[checkpoint]\ninterval_steps = 2\nkeep = 2\n",
                            env={"MILEHPC_TEST_REWARD_DELAY": str(DELAY)}, add=add))
    run_dir = base / "run"
    job_id = cli.submit(job, run_dir)
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints").is_dir() or not any((run_dir / "checkpoints").glob("step-*")):
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: no checkpoint in 180 s")
        time.sleep(0.2)
    time.sleep(DELAY * 1.5)  # a step or so past the checkpoint: what a death mid-interval loses
    hosts = json.loads((run_dir / ".milehpc" / "hosts.json").read_text())[-1]["hosts"]
    node = int(hosts[rank][len(mn.PREFIX):])
    done = _steps_done(run_dir)
    killed_at = time.monotonic()
    mn.node(action, node)
    log_path = run_dir / "logs" / f"slurm-{job_id}.out"
    ranks_spoke = None
    try:
        while True:
            [st] = query([job_id])[job_id]
            if ranks_spoke is None and "milehpc: error" in log_path.read_text(errors="replace"):
                ranks_spoke = time.monotonic() - killed_at
            if st.state != "RUNNING" or time.monotonic() - killed_at > 200:
                break
            time.sleep(0.2)
        reaction = time.monotonic() - killed_at
        time.sleep(3)  # the batch shell's last lines
        ck = max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))
        info = mn.show_job(job_id)
        log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text(errors="replace")
    finally:
        cli.cleanup()
        mn.node("revive", node)
    mn.wait_nodes_idle()
    return {"scenario": name, "node": mn.host(node), "reaction_s": round(reaction, 1), "state_after": st.state,
            "rank_error_s": None if ranks_spoke is None else round(ranks_spoke, 1),
            "steps_done_at_death": done, "last_checkpoint_step": ck, "steps_lost": max(0, done - ck),
            "named": f"node(s) {mn.host(node)} of job" in log,
            "requeued_without": info.get("ExcNodeList"), "restarts": int(info.get("Restarts", "0"))}


ELASTIC_STEPS, ELASTIC_DELAY = 24, 0.5


def run_elastic(cli: mn.Cli) -> dict:
    import re

    base = mn.workdir("bench-elastic")
    job = base / "job.toml"
    job.write_text(job_toml(ELASTIC_STEPS, env={"MILEHPC_TEST_REWARD_DELAY": str(ELASTIC_DELAY)}, add={
        "rollout": "engines = 2\npartial_rollout = false",
        "resources": 'collective_timeout_s = 10\ntime = "00:10:00"\nelastic_rollout = true\nspare_nodes = 1'}))
    run_dir = base / "run"
    job_id = cli.submit(job, run_dir)
    log_path = run_dir / "logs" / f"slurm-{job_id}.out"

    def log() -> str:
        return log_path.read_text(errors="replace") if log_path.exists() else ""

    deadline = time.monotonic() + 240
    while _steps_done(run_dir) < 5:
        if time.monotonic() > deadline:
            raise SystemExit("elastic: fewer than 5 steps in 240 s")
        time.sleep(0.2)
    node = int(re.search(r"engine 0 \(on (\w+)\) joined", log()).group(1)[len(mn.PREFIX):])
    done = _steps_done(run_dir)
    killed_at = time.monotonic()
    mn.node("kill", node)
    reaction = joined = None
    try:
        while time.monotonic() - killed_at < 300:
            text = log()
            if reaction is None and "elastic rollout: lost engine 0" in text:
                reaction = time.monotonic() - killed_at
            if joined is None and re.search(r"engine 2 \(on \w+\) joined", text):
                joined = time.monotonic() - killed_at
            if _steps_done(run_dir) == ELASTIC_STEPS:
                break
            time.sleep(0.2)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    finally:
        cli.cleanup()
        mn.node("revive", node)
    mn.wait_nodes_idle()
    engines = [int(r["rollout/engines"]) for r in records]
    shrunk = engines.index(1) if 1 in engines else len(engines)
    back = next((i for i in range(shrunk, len(engines)) if engines[i] == 2), len(engines))

    def rate(lo: int, hi: int) -> float | None:
        rows = records[lo:hi]
        secs = sum(r["time/step"] for r in rows)
        return round(sum(r["rollout/samples"] for r in rows) / secs, 2) if rows and secs else None

    before, during, after = rate(1, shrunk - 1), rate(shrunk, back), rate(back, len(records))
    return {"scenario": "elastic", "node": mn.host(node), "reaction_s": None if reaction is None else round(reaction, 1),
            "spare_join_s": None if joined is None else round(joined, 1), "steps_done_at_death": done,
            "steps_lost": ELASTIC_STEPS - len(records) + sum(1 for a, b in zip(records, records[1:], strict=False)
                                                             if b["step"] != a["step"] + 1),
            "engines_per_step": engines, "samples_per_s_before": before, "samples_per_s_shrunk": during,
            "samples_per_s_after_spare": after,
            "shrunk_over_before": round(during / before, 3) if before and during else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join([*SCENARIOS, "elastic"]))
    args = parser.parse_args()
    mn.ensure_cluster()
    os.environ["SLURM_CONF"] = mn.SLURM_CONF
    cli = mn.Cli(mn.workdir("bench-cli"))
    results = []
    elastic = None
    for name in args.scenarios.split(","):
        if name == "elastic":
            elastic = run_elastic(cli)
            print(f"elastic       node {elastic['node']}: the trainer went on {elastic['reaction_s']} s after the "
                  f"kill, the spare's engine joined after {elastic['spare_join_s']} s, steps lost "
                  f"{elastic['steps_lost']}; samples/s {elastic['samples_per_s_before']} (2 engines) -> "
                  f"{elastic['samples_per_s_shrunk']} (1) -> {elastic['samples_per_s_after_spare']} (spare)", flush=True)
            continue
        res = run(name, cli)
        print(f"{name:13s} node {res['node']}: reaction {res['reaction_s']:5.1f} s -> {res['state_after']}, "
              f"rank error {res['rank_error_s']} s, steps lost {res['steps_lost']} (done {res['steps_done_at_death']}, checkpoint "
              f"{res['last_checkpoint_step']}), named {res['named']}, excluded {res['requeued_without']}", flush=True)
        results.append(res)
    print(json.dumps({"scenarios": results, "elastic_shrink": elastic}))


if __name__ == "__main__":
    main()

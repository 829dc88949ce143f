"""Elastic rollout on the multi-node test cluster (tests/cluster/multinode.sh): a rollout node killed mid-run costs
its engine, not the job.

One job (trainer on the first node, an engine on each of the next two, one spare node) and, beside it, the same job
run locally without any kill (the local site starts the same trainer and engine processes). The rollout node of
engine 0 is killed after a few steps: the trainer names it in one line and deals its unfinished prompts to the other
engine (``rollout/engines`` drops to 1), the job script starts an engine on the spare node, which joins at a step
boundary with the current weights (``rollout/engines`` back to 2), and the job completes every step, also after Slurm
declared the node down (which would revoke a job's whole allocation but for ``--no-kill``). Each prompt's
group is sampled from the prompt's own seed, so the killed run's final parameters and optimizer state equal the
uninterrupted run's bit for bit: no prompt lost, none trained twice.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from ckpt_helpers import differences, final_state, job_toml, prepare_local, start_script

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
import harness  # noqa: E402
import multinode_harness as mn  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow(minutes=2)]

STEPS = 24


@pytest.fixture(scope="module")
def mcli():
    import os

    mn.ensure_cluster()
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = mn.SLURM_CONF
    client = mn.Cli(mn.workdir("elastic-cli"))
    yield client
    client.cleanup()
    if saved is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = saved


def _job(spare: int, slow_while: Path | None = None) -> str:
    """ckpt_helpers' job without what elastic rollout refuses (partial rollouts), two engines. With ``slow_while``
    the reward sleeps a second per prompt while that file exists: the node dies mid-run and the spare's engine joins
    with steps left to serve, however long its start-up takes on a loaded machine; then the test removes the file."""
    env = {"MILEHPC_TEST_REWARD_DELAY": "1.0" if slow_while else "0"}
    if slow_while:
        env["MILEHPC_TEST_REWARD_DELAY_WHILE"] = str(slow_while)
    return job_toml(STEPS, env=env, time_limit="00:10:00",
                    add={"rollout": "engines = 2\npartial_rollout = false",
                         "resources": f"collective_timeout_s = 10\nelastic_rollout = true\nspare_nodes = {spare}"})


def _log(run_dir: Path, job_id: str) -> str:
    path = run_dir / "logs" / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_rollout_node_dies_the_elastic_job_goes_on_a_spare_rejoins_and_nothing_is_lost(mcli, tmp_path: Path) -> None:
    mn.wait_nodes_idle()
    base = mn.workdir("elastic")
    job = base / "job.toml"
    slow = base / "slow"
    slow.touch()
    job.write_text(_job(1, slow_while=slow))
    run_dir = base / "run"
    job_id = mcli.submit(job, run_dir)
    ref_dir = prepare_local(tmp_path, "uninterrupted", _job(0))
    ref = start_script(ref_dir)
    killed = None
    try:
        deadline = time.monotonic() + 300
        while len(_records(run_dir)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        joined = re.search(r"engine 0 \(on (\w+)\) joined", _log(run_dir, job_id))
        assert joined and len(_records(run_dir)) >= 3, _log(run_dir, job_id)[-3000:]
        killed = int(joined.group(1)[len(mn.PREFIX):])
        mn.node("kill", killed)
        deadline = time.monotonic() + 120  # the spare's engine joins (~20 s on the loaded 2-core CI)
        while not re.search(r"engine 2 \(on \w+\) joined", _log(run_dir, job_id)) and time.monotonic() < deadline:
            time.sleep(0.2)
        # Slurm declares the dead node DOWN after SlurmdTimeout (60-95 s here) and then revokes a job's whole
        # allocation (NODE_FAIL) unless it has --no-kill: the job must outlive that too. Set DOWN now, as slurmctld
        # would later (the same path: "Removing failed node ... from JobId" with --no-kill, else a requeue).
        mn.set_down(killed)
        time.sleep(3)  # slurmctld acts on it
        assert mn.show_job(job_id).get("JobState") == "RUNNING", _log(run_dir, job_id)[-3000:]
        slow.unlink()  # the spare's engine is in and the node is down: the rest at full speed
        [st] = harness.wait_for(job_id, timeout=300)
        assert ref.wait(timeout=300) == 0, (ref_dir / "logs" / "job.out").read_text()[-3000:]
    finally:
        if killed is not None:
            mn.node("revive", killed)
        if ref.poll() is None:
            ref.kill()
    log = _log(run_dir, job_id)
    assert st.state == "COMPLETED", log[-4000:]
    dead = mn.host(killed)
    lost = [line for line in log.splitlines() if "elastic rollout: lost" in line]
    assert len(lost) == 1 and lost[0].startswith(f"milehpc: elastic rollout: lost engine 0 (on {dead}): "), lost
    assert re.search(rf"the rollout step on {dead} .*; starting 1 engine\(s\) on spare node (\w+)", log), log[-3000:]
    assert re.search(r"engine 2 \(on \w+\) joined \(2 engine\(s\) live\)", log), log[-3000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(STEPS))  # the job went on to its end
    engines = [int(r["rollout/engines"]) for r in records]
    shrunk = engines.index(1)  # the engine count drops, then the spare's engine brings it back
    assert engines[:shrunk] == [2] * shrunk and shrunk >= 2 and 2 in engines[shrunk:], engines
    assert sum(r["rollout/engines_lost"] for r in records) == 1
    assert all(r["rollout/groups"] == 4 for r in records)  # every prompt of every step, once
    different = differences(final_state(ref_dir, STEPS), final_state(run_dir, STEPS))
    assert not different, different[:5]
    mn.wait_nodes_idle()

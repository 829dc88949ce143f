"""On the multi-node test cluster (tests/cluster/multinode.sh: 4 nodes, each its own network + UTS + mount namespace
with its own host name, address and slurmd): jobs that span nodes, checked from inside the ranks, and nodes that die
mid-run.

- a GRPO job, trainer ranks on two nodes and rollout ranks on the other two, the reference engine, weights broadcast
  across hosts every step (engine and trainer logprobs agree after every sync on changing weights), learning (its
  reward rises well beyond the noise in 20 steps);
- every rank's host name (``RUN_DIR/.milehpc/hosts.json``) equals ``milehpc plan --ranks``' node for several layouts;
- a site's socket interface that a node lacks fails the job with one line naming the variable;
- a rollout node killed mid-run: the job ends (no hang), names the node, is requeued without it and resumes from
  its last checkpoint, bitwise equal to an uninterrupted run; a trainer node killed: the same, promptly; a rollout
  node cut off the network: its ranks end by the collective (heartbeat) timeout with one line, none left running,
  and the batch shell, no longer waiting for srun, names the node and requeues the job;
- a second cluster starts beside the first and stops without leftovers.

One file, so that its jobs take turns on the 4 nodes; the failure jobs are the smallest that show each case.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpt_helpers import differences, final_state, job_toml, prepare_local, start_script

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
import harness  # noqa: E402
import multinode_harness as mn  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow(minutes=3)]

FP32_EPS = 1.1920929e-07


@pytest.fixture(scope="module")
def mcli():
    mn.ensure_cluster()
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = mn.SLURM_CONF  # milehpc.scheduler.slurm's queries in this process
    client = mn.Cli(mn.workdir("cli"))
    yield client
    client.cleanup()
    if saved is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = saved


def _log(run_dir: Path, job_id: str) -> str:
    path = run_dir / "logs" / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _hosts(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / ".milehpc" / "hosts.json").read_text())


def _expected_hosts(ranks: list[dict], nodelist: str) -> list[str]:
    names = mn.hostnames(nodelist)
    return [names[r["node"]] for r in ranks]


# ---- jobs that span nodes ----------------------------------------------------------------------------------------

GRPO = """
name = "mn-grpo"
[model]
hidden_size = 32
num_layers = 1
num_heads = 2
num_kv_heads = 1
intermediate_size = 64
max_position_embeddings = 32
[data]
source = "task:sort"
params = { min_len = 3, max_len = 3 }
[reward]
name = "payload:digit_share"
[rollout]
engine = "reference"
engines = 2
prompts_per_step = 4
n_samples = 4
max_new_tokens = 4
[trainer]
dp = 2
micro_batch_size = 16
lr = 1e-2
[run]
steps = 20
loop = "sync"
seed = 3
check_logprobs = true
[resources]
collective_timeout_s = 60
time = "00:05:00"
[env]
PYTHONPATH = "CLUSTER"
"""

# name -> (tables, [resources] lines): TP groups and 2-rank engines inside a node (the site's two-rank partition);
# colocated ranks, each both trainer and engine, one per node.
LAYOUTS = {
    "tp-in-node": ("[trainer]\ntp = 2\n[rollout]\ngpus_per_engine = 2\n", 'partition = "pair"\n'),
    "colocated": ("[trainer]\ndp = 2\n[rollout]\nengines = 2\n", "colocate = true\n"),
}


def _write(path: Path, text: str) -> Path:
    here = Path(__file__).parent
    path.write_text(text.replace('"TESTS"', f'"{here}"').replace('"CLUSTER"', f'"{here / "cluster"}"'))
    return path


def _payload_job(base: Path, name: str, tables: str, resources: str = "") -> Path:
    """A job whose ranks run tests/cluster/payload.py's hello (no model is built): start-up, MPI and the
    torch.distributed groups only, the placement being what is checked."""
    return _write(base / f"{name}.toml", (
        f'name = "mn-{name}"\n[model]\nhidden_size = 32\nnum_layers = 2\nnum_heads = 2\nnum_kv_heads = 2\n'
        f'intermediate_size = 64\n{tables}[resources]\ntime = "00:05:00"\ncollective_timeout_s = 60\n{resources}'
        f'[env]\nMILEHPC_ENTRY = "payload:hello"\nPYTHONPATH = "CLUSTER"\n'))


def test_the_nodes_are_hosts_of_their_own(mcli) -> None:
    """Each node has its own host name, address on its hsn0 and /tmp: what a job on real nodes would see."""
    for i in (1, 2):
        out = mn.node_exec(i, "bash", "-c", "hostname; ip -br -4 addr show hsn0")
        name, addr = out.splitlines()  # hsn0@ifN  UP  10.231.7.1N/24
        assert name == mn.host(i) and addr.split()[1:3] == ["UP", f"10.231.7.{10 + i}/24"], out
    assert mn.node_exec(1, "bash", "-c", "echo x > /tmp/mn-probe; ls /tmp") != mn.node_exec(2, "ls", "/tmp")


def test_the_site_scripts_are_accepted_by_its_cluster(mcli) -> None:
    """The shipped site's scripts (tests/test_slurm_sites.py's variants: the golden job, Apptainer, a full node) on
    every partition pass `sbatch --test-only` on the cluster they describe; a node count above it is refused."""
    from milehpc.render.rundir import prepare

    base = mn.workdir("site-scripts")
    golden = Path(__file__).parent / "golden" / "job.toml"
    for pname in ("batch", "pair"):
        for variant, extra in {"golden": (), "apptainer": ('container.image="/images/milehpc.sif"',),
                               "full-node": ("trainer.dp=1", "rollout.engines=1")}.items():
            prep = prepare(str(golden), mn.SITE, (f"resources.partition={pname}", *extra),
                           run_dir=str(base / f"{pname}-{variant}"))
            path = base / f"{pname}-{variant}.sbatch"
            path.write_text(prep.script)
            proc = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, timeout=60,
                                  env=mcli.env)
            assert proc.returncode == 0 and "to start at" in proc.stderr and "in partition batch" in proc.stderr, \
                (pname, variant, proc.stderr)
    over = base / "over.sbatch"
    over.write_text("#!/bin/bash\n#SBATCH --nodes=5\ntrue\n")
    assert subprocess.run(["sbatch", "--test-only", str(over)], capture_output=True, timeout=60,
                          env=mcli.env).returncode != 0


def test_grpo_job_spans_four_nodes_ranks_where_the_plan_says(mcli) -> None:
    base = mn.workdir("grpo")
    job = _write(base / "grpo.toml", GRPO)
    ranks = mcli.plan_ranks(job)
    assert [(r["role"], r["node"]) for r in ranks] == [("trainer", 0), ("trainer", 1), ("rollout", 2), ("rollout", 3)]
    run_dir = base / "run"
    job_id = mcli.submit(job, run_dir)
    # The payload layouts run beside it once it is done (the GRPO job takes all 4 nodes).
    [st] = harness.wait_for(job_id, timeout=240)
    log = _log(run_dir, job_id)
    assert st.state == "COMPLETED", log[-3000:]
    [run] = _hosts(run_dir)
    assert len(mn.hostnames(run["nodelist"])) == 4, run
    assert run["hosts"] == _expected_hosts(ranks, run["nodelist"]), run
    assert len(set(run["hosts"])) == 4  # four hosts: every collective and broadcast crossed the network
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(20))
    # It learns (0.14 -> ~0.95 in 20 steps with this seed). Rewards lie in [0, 1], so the mean of 4 steps' 16 groups
    # has a standard deviation of at most 0.5 / sqrt(16) even when a group's samples are fully correlated: the last 4
    # steps' mean exceeds the first 4 steps' by more than 3 standard deviations of the difference (3 * 0.177).
    rewards = [r["rollout/reward_mean"] for r in records]
    rise = sum(rewards[-4:]) / 4 - sum(rewards[:4]) / 4
    assert rise > 3 * 0.5 / 4 * 2 ** 0.5, [round(r, 2) for r in rewards]
    # The weights change every step (rewards differ within groups) and reach both engines on their own hosts before
    # the next generation: the trainer recomputes the engines' logprobs to within fp32 rounding (the reduction over
    # the hidden size and the vocabulary, logprobs of magnitude up to ~log V ~ 3-4). Stale weights after a step at
    # lr 1e-2 differ by orders of magnitude more.
    tol = FP32_EPS * 256 * 4
    assert all(r["train/grad_norm"] > 0 for r in records), [r["train/grad_norm"] for r in records]
    assert all(r["train/logprob_diff_max"] < tol for r in records), [r["train/logprob_diff_max"] for r in records]


def test_other_layouts_put_every_rank_where_the_plan_says(mcli) -> None:
    base = mn.workdir("layouts")
    jobs = {}
    for name, (tables, resources) in LAYOUTS.items():
        job = _payload_job(base, name, tables, resources)
        ranks = mcli.plan_ranks(job)
        jobs[name] = (ranks, base / name, mcli.submit(job, base / name))
    tp = jobs["tp-in-node"][0]
    assert [r["node"] for r in tp] == [0, 0, 1, 1] and [r["role"] for r in tp] == ["trainer"] * 2 + ["rollout"] * 2
    for name, (ranks, run_dir, job_id) in jobs.items():
        [st] = harness.wait_for(job_id, timeout=180)
        assert st.state == "COMPLETED", (name, _log(run_dir, job_id)[-3000:])
        [run] = _hosts(run_dir)
        assert run["hosts"] == _expected_hosts(ranks, run["nodelist"]), (name, run)
        assert len(set(run["hosts"])) == len({r["node"] for r in ranks}) == 2, (name, run)
    hosts = _hosts(jobs["tp-in-node"][1])[0]["hosts"]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]  # the TP group and the 2-rank engine each inside a node


def test_a_socket_interface_the_nodes_lack_fails_in_one_line(mcli) -> None:
    base = mn.workdir("ifname")
    job = _payload_job(base, "ifname", "[trainer]\ndp = 1\n")
    run_dir = base / "run"
    job_id = mcli.submit(job, run_dir, "--set", 'site.env.GLOO_SOCKET_IFNAME="ib7"')
    [st] = harness.wait_for(job_id, timeout=120)
    log = _log(run_dir, job_id)
    assert st.state == "FAILED", log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("milehpc: error")]
    assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert re.search(r"site\.json: env\.GLOO_SOCKET_IFNAME: expected GLOO_SOCKET_IFNAME to name interfaces of this "
                     r"node \(mn\d: hsn0, lo\), got 'ib7' \(ib7 not found\)", errors[0]), errors[0]


# ---- nodes that die ------------------------------------------------------------------------------------------------

STEPS = 12
FAILING = {"resources": "collective_timeout_s = 10\ntime = \"00:10:00\""}
CKPT = "[checkpoint]\ninterval_steps = 2\nkeep = 2\nmax_restarts = 2\n"


def _failure_job(base: Path, *, trainer_dp: int = 1, delay: float = 0.5) -> Path:
    """ckpt_helpers' job (every piece of state matters) on one rank per node; the first run sleeps ``delay`` s a step
    in the reward so that the node dies mid-run, the requeued run does not sleep. Every node in service first (a test
    that failed before its own wait may have left one coming back)."""
    mn.wait_nodes_idle()
    add = dict(FAILING)
    if trainer_dp > 1:
        add["trainer"] = f"dp = {trainer_dp}"
    text = job_toml(STEPS, extra=CKPT, env={"MILEHPC_TEST_REWARD_DELAY": str(delay)}, add=add)
    return _write(base / "job.toml", text)


def _wait_for_checkpoint(run_dir: Path, job_id: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ck = run_dir / "checkpoints"
        if ck.is_dir() and any(p.name.startswith("step-") for p in ck.iterdir()):
            return
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint in {timeout} s: {_log(run_dir, job_id)[-3000:]}")


def _wait_not_running(job_id: str, timeout: float) -> float:
    """Seconds until the job leaves RUNNING (milehpc requeued it, or it ended); fails after ``timeout``."""
    from milehpc.scheduler.slurm import query

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        [st] = query([job_id])[job_id]
        if st.state != "RUNNING":
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still running {timeout} s after its node went")


def _node_of_rank(run_dir: Path, rank: int) -> int:
    name = _hosts(run_dir)[-1]["hosts"][rank]
    return int(name[len(mn.PREFIX):])


def _requeued_without(job_id: str, run_dir: Path, dead: str) -> str:
    """The batch shell named the dead node and requeued the job without it (it says so after the requeue, which is
    what took the job out of RUNNING: wait for its line)."""
    want = f"milehpc: requeued without {dead} (restart 1 of 2)"
    deadline = time.monotonic() + 20
    while want not in (log := _log(run_dir, job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f"milehpc: node(s) {dead} of job {job_id} died" in log, log[-3000:]
    assert want in log, log[-3000:]
    assert mn.show_job(job_id).get("ExcNodeList") == dead
    return log


def test_a_rollout_node_dies_the_job_requeues_without_it_and_resumes_exactly(mcli, tmp_path: Path) -> None:
    base = mn.workdir("rollout-dies")
    job = _failure_job(base)
    run_dir = base / "run"
    job_id = mcli.submit(job, run_dir)
    # The uninterrupted run beside it, locally (mpirun), without the sleeps.
    ref_dir = prepare_local(tmp_path, "uninterrupted", job.read_text().replace(
        'MILEHPC_TEST_REWARD_DELAY = "0.5"', 'MILEHPC_TEST_REWARD_DELAY = "0"'))
    ref = start_script(ref_dir)
    killed = None
    try:
        _wait_for_checkpoint(run_dir, job_id)
        killed = _node_of_rank(run_dir, 1)  # the rollout rank
        mn.node("kill", killed)
        took = _wait_not_running(job_id, timeout=90)
        dead = mn.host(killed)
        _requeued_without(job_id, run_dir, dead)
        mn.node("revive", killed)  # repaired: back in service, still excluded from this job
        killed = None
        [st] = harness.wait_for(job_id, timeout=300, release_holds=True)
        assert ref.wait(timeout=300) == 0, (ref_dir / "logs" / "job.out").read_text()[-3000:]
    finally:
        if killed is not None:
            mn.node("revive", killed)
        if ref.poll() is None:
            ref.kill()
    log = _log(run_dir, job_id)
    assert st.state == "COMPLETED", log[-4000:]
    first, second = _hosts(run_dir)
    assert dead in first["hosts"] and dead not in second["hosts"] and second["restart"] == 1, (first, second)
    assert log.count("milehpc: resumed from ") == 1, log[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(STEPS)), steps  # nothing lost, nothing counted twice
    different = differences(final_state(ref_dir, STEPS), final_state(run_dir, STEPS))
    assert not different, different[:5]
    print(f"rollout node death: the job left RUNNING {took:.1f} s after the kill")
    mn.wait_nodes_idle()


def test_a_trainer_node_dies_the_job_ends_promptly_and_requeues_without_it(mcli) -> None:
    base = mn.workdir("trainer-dies")
    job = _failure_job(base, trainer_dp=2, delay=1.0)
    run_dir = base / "run"
    job_id = mcli.submit(job, run_dir)
    killed = None
    try:
        _wait_for_checkpoint(run_dir, job_id)
        killed = _node_of_rank(run_dir, 1)  # the second trainer rank, on its own node (rank 0 holds the batch shell)
        mn.node("kill", killed)
        took = _wait_not_running(job_id, timeout=90)
        _requeued_without(job_id, run_dir, mn.host(killed))
        # No step of the old run is left holding the nodes that live.
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    finally:
        if killed is not None:
            mn.node("revive", killed)
    print(f"trainer node death: the job left RUNNING {took:.1f} s after the kill")
    mn.wait_nodes_idle()


def test_a_partition_ends_the_ranks_by_the_collective_timeout_in_one_line_and_names_the_node(mcli) -> None:
    """The rollout node's link goes down: its processes live on, nothing resets a connection. The ranks on both sides
    end by their own timeouts (collective_timeout_s = 10; the heartbeat's is the same), rank 0 saying it in one line
    that names rank 1, and no rank of the job is left on the nodes that can still be reached. srun cannot reach the
    cut node's step and would wait for it until Slurm declares the node down (SlurmdTimeout = 60 s): the batch shell
    stops waiting once rank 0 has reported (render.script.FAILED_GRACE_S later), its probe names the node and it
    requeues the job, which leaves RUNNING before Slurm would have noticed anything."""
    base = mn.workdir("partition")
    job = _failure_job(base, delay=1.0)
    run_dir = base / "run"
    job_id = mcli.submit(job, run_dir)
    cut = None
    try:
        _wait_for_checkpoint(run_dir, job_id)
        cut = _node_of_rank(run_dir, 1)
        trainer_node = _node_of_rank(run_dir, 0)
        mn.node("cut", cut)
        t_cut = time.monotonic()
        deadline = t_cut + 60
        while "milehpc: error" not in (log := _log(run_dir, job_id)) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # the other ranks' exits
        # The ranks, not srun: it waits for the cut node's step (until the batch shell ends it).
        left = [c for c in mn.node_processes(trainer_node, f"milehpc launch {run_dir}") if not c.startswith("srun ")]
        named = f"milehpc: node(s) {mn.host(cut)} of job {job_id} died"
        # Slurm would end the job itself only after SlurmdTimeout (60 s, then NODE_FAIL, and without this line).
        while named not in (log := _log(run_dir, job_id)) and time.monotonic() < t_cut + 55:
            time.sleep(0.2)
        _wait_not_running(job_id, timeout=max(1.0, t_cut + 58 - time.monotonic()))
        took = time.monotonic() - t_cut
        log = _log(run_dir, job_id)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        if cut is not None:
            mn.node("revive", cut)
    errors = [line for line in log.splitlines() if line.startswith("milehpc: error")]
    assert len(errors) == 1, log[-3000:]
    # Whichever wait ran out first speaks, naming rank 1: the step's control message, the weight broadcast (a cut
    # during the sync) or the heartbeat.
    assert re.fullmatch(r"milehpc: error: rank 0: (.*: rank 0 heard nothing from rank 1 within 10 s|"
                        r"weight sync .*: not complete after 10 s \(group of rank 1\)|rank 1 "
                        rf"\(on {mn.host(cut)}\) stopped responding: no heartbeat for \d+ s \(dead, hung, or its node "
                        r"is gone\))", errors[0]), errors[0]
    assert left == [], f"ranks left running on {mn.host(trainer_node)}: {left}"
    assert "s ago and srun still runs (waiting for a node it cannot reach, or for KillWait): ending the step" in log, log[-3000:]
    assert named in log, log[-3000:]
    print(f"partition: the node named and the job out of RUNNING {took:.1f} s after the cut")
    mn.wait_nodes_idle()


# ---- the cluster script itself -----------------------------------------------------------------------------------

def test_a_second_cluster_starts_beside_and_stops_without_leftovers(mcli) -> None:
    """One node of another cluster (own directory, host names, subnet, bridge, ports) starts beside the running
    one and runs a job; ``stop`` leaves no namespace, link, daemon or process of it (the running cluster stays)."""
    second = mn.MN_DIR.parent / f"{mn.MN_DIR.name}-second"  # outside /tmp, as every cluster directory
    env = {**os.environ, "MILEHPC_MN_DIR": str(second), "MILEHPC_MN_NODES": "1",
           "MILEHPC_MN_PREFIX": "sec", "MILEHPC_MN_SUBNET": "10.231.99", "MILEHPC_MN_PORT": "6857"}

    def script(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(mn.MN_SH), *args], env=env, capture_output=True, text=True, timeout=120)

    def leftovers() -> list[str]:
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        procs = [p for p in Path("/proc").glob("[0-9]*/cmdline") if str(second) in _read(p)]
        return ([w for w in ("mhbr-sec", "mhv-sec1") if w in links] + [w for w in ("milehpc-sec1",) if w in spaces]
                + [str(p) for p in procs])

    try:
        started = script("start")
        assert started.returncode == 0, started.stderr
        conf = second / "etc" / "slurm.conf"
        out = subprocess.run(["srun", "-N1", "hostname"], env={**env, "SLURM_CONF": str(conf)}, capture_output=True,
                             text=True, timeout=60)
        assert out.stdout.strip() == "sec1", out
        assert leftovers()  # the check sees them while they run
    finally:
        stopped = script("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert leftovers() == []
    assert subprocess.run(["bash", str(mn.MN_SH), "status"], capture_output=True).returncode == 0  # the first lives
    shutil.rmtree(second, ignore_errors=True)


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace")
    except OSError:  # the process ended meanwhile
        return ""

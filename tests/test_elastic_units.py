"""Elastic rollout's pieces that need no cluster (the cluster run is tests/test_multinode_elastic.py): the
authenticated channel between trainer rank 0 and the engines, the hub that notices an engine gone, the job rules, the
rendered job script's reaction to a lost rollout step (a spare node's engines), and sampling that depends on the
prompt's own seed, not on the engine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from milehpc.comm.channel import accept, connect
from milehpc.comm.net import listen_on
from milehpc.errors import ConfigError, RuntimeFailure
from milehpc.render.rundir import prepare

SECRET = "s3cret-of-the-job"


def _server(secret: str) -> tuple[socket.socket, int, list]:
    """A listening socket and a thread accepting one connection into ``got`` (a Connection or the error)."""
    sock = socket.socket(fileno=listen_on("127.0.0.1", 0))
    port = sock.getsockname()[1]
    got: list = []

    def serve() -> None:
        conn, _ = sock.accept()
        try:
            got.append(accept(conn, secret))
        except Exception as err:  # noqa: BLE001
            got.append(err)

    threading.Thread(target=serve, daemon=True).start()
    return sock, port, got


def _wait(got: list) -> object:
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    return got[0]


def test_the_channel_carries_objects_between_holders_of_the_secret() -> None:
    sock, port, got = _server(SECRET)
    client = connect("127.0.0.1", port, SECRET, timeout=5)
    server = _wait(got)
    client.send(("result", 3, 12, [1, 2], {"x": 1.0}))
    assert server.recv() == ("result", 3, 12, [1, 2], {"x": 1.0})
    server.send(("work", 4, list(range(1000))))
    assert client.recv() == ("work", 4, list(range(1000)))
    client.close()
    with pytest.raises(ConnectionError):
        server.recv()
    sock.close()


def test_a_peer_without_the_secret_is_refused_both_ways() -> None:
    sock, port, got = _server(SECRET)
    with pytest.raises(RuntimeFailure, match="handshake with the trainer at 127.0.0.1:"):
        connect("127.0.0.1", port, "a guess", timeout=5)
    err = _wait(got)
    assert isinstance(err, PermissionError) and "does not hold the job's secret" in str(err)
    sock.close()
    # ... and an engine talks only to a trainer that holds it: a server that takes any answer and cannot prove itself
    sock = socket.socket(fileno=listen_on("127.0.0.1", 0))

    def rogue() -> None:
        conn, _ = sock.accept()
        conn.sendall(os.urandom(32))
        conn.recv(64)
        conn.sendall(os.urandom(32))
        time.sleep(1)
        conn.close()

    threading.Thread(target=rogue, daemon=True).start()
    with pytest.raises(RuntimeFailure, match="the server does not hold the job's secret"):
        connect("127.0.0.1", sock.getsockname()[1], SECRET, timeout=5)
    sock.close()


def test_the_hub_reports_an_engine_whose_connection_ends_and_one_that_goes_silent() -> None:
    from milehpc.runtime.elastic.hub import Hub

    fd = listen_on("127.0.0.1", 0)
    port = socket.socket(fileno=os.dup(fd)).getsockname()[1]
    hub = Hub(fd, SECRET, timeout=0.5)
    engines = []
    for e in range(2):
        conn = connect("127.0.0.1", port, SECRET, timeout=5)
        conn.send(("hello", e, f"node{e}"))
        engines.append(conn)
    joined = [hub.next_event(5) for _ in range(2)]
    assert sorted((ev[0], ev[1].engine, ev[1].host) for ev in joined) == [("join", 0, "node0"), ("join", 1, "node1")]
    for ev in joined:
        hub.add(ev[1])
    engines[0].send(("result", 0, 0, [], {}))
    ev = hub.next_event(5)
    assert ev[0] == "msg" and ev[1].engine == 0 and ev[2][0] == "result"
    engines[0].close()  # engine 0's node dies: its connection ends
    ev = hub.next_event(5)
    assert ev[0] == "lost" and ev[1].engine == 0 and "connection ended" in ev[2]
    hub.drop(ev[1])
    time.sleep(0.6)  # engine 1 sends nothing, not even a heartbeat (a cut link)
    ev = hub.next_event(0.01)
    assert ev[0] == "lost" and ev[1].engine == 1 and "no heartbeat" in ev[2]
    hub.close()


def _job(tmp_path: Path, rollout: str = "", rest: str = "") -> Path:
    job = tmp_path / "job.toml"
    job.write_text(f'name = "el"\n[rollout]\nengines = 2\n{rollout}[resources]\nelastic_rollout = true\n{rest}')
    return job


@pytest.mark.parametrize(("rollout", "rest", "field"), [
    ("", '[run]\nloop = "one_step_off"\n', "run.loop"),
    ("partial_rollout = true\n", "", "rollout.partial_rollout"),
    ("dynamic_filter = true\n", "", "rollout.dynamic_filter"),
    ("", "[run]\neval_every = 2\n", "run.eval_every"),
    ('engine = "reference_process"\n', "", "rollout.engine"),
    ('engine = "vllm"\n', "", "rollout.engine"),  # not run elastic yet
])
def test_what_elastic_rollout_cannot_do_is_one_line(tmp_path: Path, rollout: str, rest: str, field: str) -> None:
    job = _job(tmp_path, rollout, rest)
    with pytest.raises(ConfigError) as info:
        prepare(str(job), "local-multinode", (), run_dir=str(tmp_path / "run"))
    msg = str(info.value)
    assert msg.startswith(f"{job}: {field}: expected ") and "with resources.elastic_rollout = true, got" in msg, msg


@pytest.mark.parametrize("engine", ["reference", "sglang"])
def test_elastic_rollout_takes_the_engines_with_their_own_weight_path(tmp_path: Path, engine: str) -> None:
    """SGLang engines join over the channel too (their schedulers take the buckets themselves:
    tests/test_elastic_engines.py runs one)."""
    from milehpc.config.load import job_from_dict, read_toml
    from milehpc.config.rules import elastic_rollout_fits_the_loop

    job = job_from_dict(read_toml(_job(tmp_path, f'engine = "{engine}"\n')))
    elastic_rollout_fits_the_loop(job, "job.toml")  # no ConfigError


def test_weight_buckets_are_copies_that_unflatten_to_the_tensors(tmp_path: Path) -> None:
    """The trainer keeps the last weights for engines that join later: buckets of copies (the optimizer changes
    the parameters in place), in SGLang's flattened layout, cut back into the same tensors on the engine's side."""
    import torch

    from milehpc.runtime.elastic import weights as ew

    named = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.arange(4)),
             ("d", torch.randn(40))]
    buckets = ew.pack(iter(named), bucket_bytes=110)  # a, b, c (106 bytes) in one bucket; d (160) alone
    assert [m["names"] for m, _ in buckets] == [["c", "a", "b"], ["d"]]  # widest dtype first within a bucket
    want = {n: t.clone() for n, t in named}
    for _, t in named:
        t.zero_()  # an optimizer step after the push
    got = {n: t for meta, flat in buckets for n, t in ew.unflatten(meta, flat)}
    assert [ew.bucket_bytes(m) for m, _ in buckets] == [flat.numel() for _, flat in buckets]
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) and got[n].dtype == want[n].dtype
                                             for n in want)


def test_elastic_rollout_has_no_reward_model_group(tmp_path: Path) -> None:
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_labels": 1}))
    job = _job(tmp_path, rest=f'[reward]\nname = "reward_model"\nparams = {{path = "{rm}"}}\n'
                              f'[reward_model]\npath = "{rm}"\n')
    with pytest.raises(ConfigError, match="reward_model.path: expected unset .*with resources.elastic_rollout = true"):
        prepare(str(job), "local-multinode", (), run_dir=str(tmp_path / "run"))


def test_elastic_rollout_on_slurm_needs_srun_steps(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="resources.elastic_rollout: expected launcher.kind = 'srun' for "
                                          "resources.elastic_rollout .*, got 'mpirun'"):
        prepare(str(_job(tmp_path)), "local-multinode", ('site.launcher.kind="mpirun"',),
                run_dir=str(tmp_path / "run"))


def test_spare_nodes_need_elastic_rollout(tmp_path: Path) -> None:
    spare = tmp_path / "spare.toml"
    spare.write_text('name = "sp"\n[resources]\nspare_nodes = 1\n')
    with pytest.raises(ConfigError, match="resources.spare_nodes: expected resources.spare_nodes = 0 without "
                                          "elastic_rollout"):
        prepare(str(spare), "local-multinode", (), run_dir=str(tmp_path / "run"))


def test_the_job_script_starts_the_lost_nodes_engines_on_a_spare(tmp_path: Path) -> None:
    """The rendered script with stand-ins for srun and scontrol: one step for the trainer on the first node, one per
    rollout node; when the trainer reports an engine of mn2 lost, the script ends mn2's step and starts its engines on
    the spare mn4; the trainer's end ends the job with its status."""
    job = _job(tmp_path, rest="spare_nodes = 1\n")
    prep = prepare(str(job), "local-multinode", (), run_dir=str(tmp_path / "run"))
    script = prep.script
    assert "#SBATCH --nodes=4\n" in script and "#SBATCH --ntasks=4\n" in script
    start = script.index("# Elastic rollout (resources.elastic_rollout)")
    block = script[start:script.index("# The trainer told its engines to stop")]
    run = tmp_path / "run"
    (run / ".milehpc").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    # srun: record the node and the role; the trainer reports mn2's engine lost, then ends with 0
    (bin_dir / "srun").write_text(f"""#!/bin/bash
node=$(printf '%s\\n' "$@" | sed -n 's/^--nodelist=//p')
role=$(printf '%s\\n' "$@" | grep -A1 -x -- --elastic | tail -n 1)
echo "$node $role $*" >> {calls}
if [ "$role" = trainer ]; then
    sleep 0.3; echo mn2 >> "$MILEHPC_RUN_DIR/.milehpc/elastic-lost"; sleep 1.2; exit 0
fi
exec sleep 30
""")
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'mn1\\nmn2\\nmn3\\nmn4\\n'\n")
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    body = f"set -eo pipefail\n{block}\necho rc=$rc\nfor p in \"${{!milehpc_engine_step[@]}}\"; do kill $p; done\n"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "MILEHPC_RUN_DIR": str(run), "SLURM_JOB_NODELIST": "mn[1-4]"}
    proc = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "rc=0" in proc.stdout, proc.stderr
    started = [line.split()[:2] for line in calls.read_text().splitlines()]
    assert sorted(started) == [["mn1", "trainer"], ["mn2", "engine"], ["mn3", "engine"], ["mn4", "engine"]], started
    assert started[-1] == ["mn4", "engine"] and "--engine-base 2" in calls.read_text().splitlines()[-1]
    assert "milehpc: the rollout step on mn2 lost its engines (the trainer's report); starting 1 engine(s) on spare " \
           "node mn4" in proc.stderr, proc.stderr


def test_a_prompts_samples_depend_on_its_seed_not_on_the_engine(tmp_path: Path) -> None:
    """Two engines of different ids (their own random streams) give one prompt the same group from its seed, whatever
    they generated before: the elastic run's groups do not depend on which engine served which prompt."""
    from milehpc.config.load import job_from_dict, read_toml
    from milehpc.rollout.reference import build_engine
    from milehpc.runtime.elastic import prompt_seed
    from milehpc.runtime.loop.rollout_side import RolloutSide

    (tmp_path / "s.toml").write_text('name = "s"\n[model]\nhidden_size = 16\nnum_layers = 1\nnum_heads = 2\nnum_kv_heads = 1\n'
                        'intermediate_size = 32\n[rollout]\nn_samples = 3\nmax_new_tokens = 5\n[data]\nsource = '
                        '"task:sort"\n[reward]\nname = "toy_match"\n')
    job = job_from_dict(read_toml(tmp_path / "s.toml"))
    a = RolloutSide(job, build_engine(job, rank=0), engine_index=1, num_engines=2)
    b = RolloutSide(job, build_engine(job, rank=5), engine_index=1, num_engines=2)
    b.generate_one(b.source.peek(3), prompt_seed(0, 3))  # b's history differs
    ga, _ = a.generate_one(a.source.peek(7), prompt_seed(0, 7))
    gb, _ = b.generate_one(b.source.peek(7), prompt_seed(0, 7))
    assert [s.response_ids for s in ga] == [s.response_ids for s in gb]
    assert [s.rollout_logprobs for s in ga] == [s.rollout_logprobs for s in gb]
    other, _ = a.generate_one(a.source.peek(7), prompt_seed(0, 8))  # the seed does decide
    assert [s.response_ids for s in other] != [s.response_ids for s in ga]

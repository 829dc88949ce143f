"""Login-side and rank-side pieces of the multi-node support that need no cluster: the socket-interface check every
rank runs before gloo/NCCL, the refusal of a request whose extra nodes would sit idle, and the resume command the
job script prints when a node died and it cannot requeue."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from milehpc.cli import cli
from milehpc.comm.net import check_socket_ifnames
from milehpc.config.load import apply_overrides
from milehpc.errors import ConfigError
from milehpc.render.rundir import prepare

HAVE = ["hsn0", "hsn1", "lo"]
GOLDEN_JOB = Path(__file__).parent / "golden" / "job.toml"


@pytest.mark.parametrize("env", [
    {}, {"GLOO_SOCKET_IFNAME": "hsn0"}, {"GLOO_SOCKET_IFNAME": "hsn0,hsn1"}, {"NCCL_SOCKET_IFNAME": "hsn"},
    {"NCCL_SOCKET_IFNAME": "^docker,lo"}, {"NCCL_SOCKET_IFNAME": "=hsn1"}, {"GLOO_SOCKET_IFNAME": ""},
])
def test_interfaces_the_node_has_pass(env: dict[str, str]) -> None:
    check_socket_ifnames(env, HAVE)


@pytest.mark.parametrize(("env", "missing"), [
    ({"GLOO_SOCKET_IFNAME": "hsn"}, "hsn"),  # gloo takes whole names: a prefix is not one
    ({"GLOO_SOCKET_IFNAME": "hsn0,ib0"}, "ib0"),
    ({"NCCL_SOCKET_IFNAME": "ib"}, "ib"),
    ({"NCCL_SOCKET_IFNAME": "=hsn"}, "hsn"),  # '=': exact names only
])
def test_an_interface_the_node_lacks_is_one_line_naming_the_variable(env: dict[str, str], missing: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_socket_ifnames(env, HAVE, file="RUN/site.json")
    (var, value), = env.items()
    msg = str(info.value)
    assert msg.startswith(f"RUN/site.json: env.{var}: expected {var} to name interfaces of this node (")
    assert msg.endswith(f": hsn0, hsn1, lo), got {value!r} ({missing} not found)") and "\n" not in msg


def test_this_process_sees_its_own_interfaces() -> None:
    check_socket_ifnames({"GLOO_SOCKET_IFNAME": "lo"})  # the loopback exists in every network namespace
    with pytest.raises(ConfigError, match="'no-such-if0' \\(no-such-if0 not found\\)"):
        check_socket_ifnames({"GLOO_SOCKET_IFNAME": "no-such-if0"})


def test_nodes_that_would_sit_idle_are_refused(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('name = "idle"\n[trainer]\ndp = 1\n[resources]\nnodes = 4\n')
    result = CliRunner().invoke(cli, ["plan", str(job), "--site", "local-multinode"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines == [f"milehpc: error: {job}: resources.nodes: expected resources.nodes = 2 (the layout's 2 ranks fill "
                     "2 node(s) of 1; 2 more would sit idle): add rollout engines or trainer ranks to use them, or "
                     "leave resources.nodes unset, got 4"], lines
    job.write_text('name = "used"\n[trainer]\ndp = 2\n[rollout]\nengines = 2\n[resources]\nnodes = 4\n')
    assert CliRunner().invoke(cli, ["plan", str(job), "--site", "local-multinode"]).exit_code == 0


def test_the_resume_advice_after_a_dead_node_keeps_the_partitions_sbatch_options(tmp_path: Path) -> None:
    # The advice's --set replaces the partition's access.options: dgx-h100-like's --exclusive --mem=0 must survive it.
    prep = prepare(str(GOLDEN_JOB), "dgx-h100-like", (), run_dir=str(tmp_path / "run"))
    kept = prep.partition.access.options
    assert kept, "a site with access.options is needed for this check"
    line, = (text for text in prep.script.splitlines() if "not requeued" in text)
    env = {"PATH": os.environ["PATH"], "dead": "mn2,mn4", "restarts": "3", "MILEHPC_RUN_DIR": "/runs/x"}
    proc = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, check=True)
    argv = shlex.split(proc.stderr.split("resume with: ", 1)[1])
    assert argv[:5] == ["milehpc", "submit", "--resume", "/runs/x", "--set"], argv
    assert apply_overrides({}, argv[5:]) == {"site": {"access": {"options": [*kept, "--exclude=mn2,mn4"]}}}


def _launch_wait_block(tmp_path: Path) -> str:
    """The rendered job script's wait for the launcher, from the watcher to the status it settles on."""
    from milehpc.render.script import FAILED_GRACE_S

    script = prepare(str(GOLDEN_JOB), "local-multinode", (), run_dir=str(tmp_path / "run")).script
    start = script.index('watcher=""')
    end = script.index("rc=1  # a step ended by the shell failed")
    block = script[start:script.index("fi\n", end) + 3]
    assert f"sleep {FAILED_GRACE_S}\n" in block
    return block.replace(f"sleep {FAILED_GRACE_S}\n", "sleep 0.2\n")  # the grace, shortened for the test


@pytest.mark.parametrize("reported", [True, False])
def test_the_job_script_stops_waiting_for_srun_once_rank_0_reported(tmp_path: Path, reported: bool) -> None:
    """A launcher that never ends (srun waiting for an unreachable node's step; here a process that exits 0 on the
    interrupt stands in for it) is ended after the grace once rank 0 marked its report, with a failed status whatever
    the launcher's own; without the mark the script waits for the launcher, whose own status counts."""
    from milehpc.render.script import FAILED_FILE

    run = tmp_path / "run"
    (run / ".milehpc").mkdir(parents=True)
    mark = f'(sleep 0.3; touch "$MILEHPC_RUN_DIR/{FAILED_FILE}") &\n' if reported else ""
    # srun, interrupted, may exit 0: the status must still say the step failed
    stand_in = "import signal, sys, time; signal.signal(signal.SIGINT, lambda *_: sys.exit(0)); time.sleep(8)"
    launcher = f"{shlex.quote(sys.executable)} -c {shlex.quote(stand_in)}" if reported else "sleep 0.5"
    body = f"set -eo pipefail\n{launcher} &\nstep=$!\n{mark}{_launch_wait_block(tmp_path)}echo \"rc=$rc\"\n"
    env = {"PATH": os.environ["PATH"], "MILEHPC_RUN_DIR": str(run), "SLURM_JOB_NUM_NODES": "2"}
    proc = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    rc = int(proc.stdout.split("rc=")[1])
    ended = "srun still runs (waiting for a node it cannot reach, or for KillWait): ending the step" in proc.stderr
    if reported:
        assert ended and rc != 0 and (run / f"{FAILED_FILE}.abandoned").exists(), (rc, proc.stderr)
    else:
        assert not ended and rc == 0 and not (run / f"{FAILED_FILE}.abandoned").exists(), (rc, proc.stderr)


def test_rank_0_marks_its_report_for_the_job_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from milehpc.render.script import FAILED_FILE
    from milehpc.runtime import launch

    monkeypatch.setattr(launch, "_failed_marker", tmp_path / FAILED_FILE)
    launch._say("something broke", 1)  # another rank's line: no mark
    assert not (tmp_path / FAILED_FILE).exists()
    launch._say("something broke", 0)
    assert (tmp_path / FAILED_FILE).exists()

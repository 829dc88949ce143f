"""Login-side and rank-side pieces of the multi-node support that need no cluster: the socket-interface check every
rank runs before gloo/NCCL, the refusal of a request whose extra nodes would sit idle, and the resume command the
job script prints when a node died and it cannot requeue."""

from __future__ import annotations

import os
import shlex
import subprocess
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

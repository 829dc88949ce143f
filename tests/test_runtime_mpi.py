"""The job runtime under a real ``mpirun -np 4`` (PyPI Open MPI wheel): the split, the groups, bucketed weight sync,
check_weight_update_equal, and failures (killed / frozen / stuck / crashing rank, wrong world size) that must end
every rank within the timeout with a message naming the rank, never hang."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from required import unavailable

from milehpc.config.load import job_from_dict
from milehpc.config.site import Launcher, Partition
from milehpc.plan import make_plan

pytestmark = pytest.mark.mpi

TESTS = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
MPIRUN = VENV_BIN / "mpirun"


@functools.lru_cache(maxsize=1)
def _has_ulfm() -> bool:
    """Open MPI built with fault tolerance (the PyPI wheel is): ``mpirun --with-ft ulfm`` keeps survivors alive."""
    try:
        info = subprocess.run([str(VENV_BIN / "ompi_info")], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "FT MPI support: yes" in info


def needs_ulfm() -> None:
    """Skip (plain run) or fail (MILEHPC_REQUIRE_ALL=1, as CI): the survivor tests need ``--with-ft ulfm``."""
    if not _has_ulfm():
        unavailable("this Open MPI has no ULFM (FT MPI support) for --with-ft ulfm")


def write_run_dir(path: Path, spec: dict[str, Any]) -> Path:
    """plan.json + job.json as `milehpc submit` writes them, for a local 4-slot partition."""
    spec = {"name": "rt-test", **spec}
    job = job_from_dict(spec)
    plan = make_plan(job, Partition(scheduler="local", launcher=Launcher(kind="mpirun"), cpus_per_node=4),
                     site="local", partition_name="local")
    path.mkdir(parents=True, exist_ok=True)
    (path / "plan.json").write_text(json.dumps(plan.to_dict()))
    (path / "job.json").write_text(json.dumps(spec))
    return path


def mpirun(run_dir: Path, entry: str | None, *, np: int = 4, flags: tuple[str, ...] = (),
           env: dict[str, str] | None = None, timeout: float = 150) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [str(MPIRUN), "--allow-run-as-root", "--oversubscribe", *flags, "-np", str(np),
           "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH", "-x", "MILEHPC_HEARTBEAT_TIMEOUT",
           *[arg for key in (env or {}) for arg in ("-x", key)],  # the ranks see only what is passed on
           str(VENV_BIN / "milehpc"), "launch", str(run_dir)]
    if entry:
        cmd += ["--entry", f"runtime_mpi_entries:{entry}"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS),
                "MILEHPC_HEARTBEAT_TIMEOUT": os.environ.get("MILEHPC_HEARTBEAT_TIMEOUT", "60"), **(env or {})}
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    return proc, time.monotonic() - start


def outputs(run_dir: Path, n: int = 4) -> list[dict[str, Any]]:
    files = sorted((run_dir / "out").glob("rank-*.json"))
    assert len(files) == n, f"expected {n} rank reports, got {[f.name for f in files]}"
    return [json.loads((run_dir / "out" / f"rank-{r}.json").read_text()) for r in range(n)]


def ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"


def test_split_groups_and_bucketed_sync_pp2(tmp_path: Path) -> None:
    """PP=2 trainer (ranks 0-1) + 2 rollout ranks: split, default group = trainers only, one weight-sync group per
    stage, and a bit-exact bucketed sync of 324 mixed-dtype tensors; the check catches a corrupted parameter."""
    run = write_run_dir(tmp_path / "run", {"trainer": {"pp": 2}, "rollout": {"engines": 2},
                                           "resources": {"collective_timeout_s": 60}})
    proc, _ = mpirun(run, "groups_and_sync")
    ok(proc)
    out = outputs(run)
    assert [o["size"] for o in out] == [4, 4, 4, 4]
    assert [o["role"] for o in out] == ["trainer", "trainer", "rollout", "rollout"]
    assert [o["trainer"] for o in out] == [2, 2, None, None]
    assert [o["rollout"] for o in out] == [None, None, 2, 2]
    assert [o["engine"] for o in out] == [None, None, 1, 1]
    # torch.distributed default group: the trainer ranks only (what Megatron's parallel_state must see).
    assert [(o.get("dist_world"), o.get("dist_rank")) for o in out[:2]] == [(2, 0), (2, 1)]
    assert out[0]["allreduce"] == out[1]["allreduce"] == 3.0
    assert "dist_world" not in out[2]
    assert out[0]["sync"] == {"0": [0, 2, 3]} and out[1]["sync"] == {"1": [1, 2, 3]}
    assert out[2]["sync"] == out[3]["sync"] == {"0": [0, 2, 3], "1": [1, 2, 3]}
    assert out[3]["sync_bcast"] == {"0": 100.0, "1": 101.0}
    for rollout in out[2:]:
        assert rollout["tensors"] == rollout["checked"] == 324
        assert rollout["bit_exact"], rollout["summary"]
        assert rollout["version"] == 2 and rollout["updates"] == 4  # 2 versions x 2 stages
        assert set(rollout["dtypes"]) == {"torch.bfloat16", "torch.bool", "torch.float16", "torch.float32",
                                          "torch.float64", "torch.int64"}
    assert [o["group_versions"] for o in out] == [{"0": 2}, {"1": 2}, {"0": 2, "1": 2}, {"0": 2, "1": 2}]
    # Each stage leader sent its half of the tensors in many 64 KiB buckets (plus the 128 KiB embedding alone).
    (t0, b0, _), (t1, b1, _) = out[0]["sent"][0], out[1]["sent"][0]
    assert t0 + t1 == 324 and b0 > 10 and b1 > 10
    assert out[2]["sent"] == out[3]["sent"] == []
    for o in out:  # every member of a group gets the same merged verdict
        for key, check in o["checks"].items():
            stage = key.split("/")[1]
            assert check["skipped"] > 0  # the skip list (*.router.counts) was applied
            if key.startswith("clean") or stage == "1":
                assert check["ok"], check
            else:  # the corrupted parameter lives in stage 0's half, on rank 3
                assert not check["ok"]
                assert check["worst"] == ["layers.7.mlp.fc1.weight", 3, 0.25]
    assert out[3]["tolerant"] is True
    # Issue 30, fault 9: two adapters in more 4 KiB buckets than receive buffers arrive as sent.
    assert out[0]["lora_buckets"] > 2 * 2
    assert out[2]["lora_equal"] == out[3]["lora_equal"] == {"small": True, "wide": True}
    # Issue 33: a lazy export is sent as it is made: at most 3 of its tensors alive at once on the source (the one
    # being made, the one before, the one on the wire), not the whole export (the old send listed it all first).
    streamed = out[0]["streamed"]
    assert streamed["buckets"] > 10 and streamed["total"] > 10 * streamed["largest"]
    assert streamed["peak"] <= 3 * streamed["largest"], streamed
    assert out[2]["streamed_equal"] and out[3]["streamed_equal"]
    # Issue 30, fault 3: broadcasts that waited seconds for their receivers completed under NCCL's wait rules.
    assert all(o["slow_member_check"] for o in out)
    assert out[2]["slow_member"] == out[3]["slow_member"] == {"0": 7.0, "1": 8.0}


def test_colocated_layout_in_place(tmp_path: Path) -> None:
    """Colocated TP=2 x DP=2: every rank is both roles, the default group is the whole world, engines of 2 ranks,
    no weight-sync groups; the weights go into the engine in place."""
    run = write_run_dir(tmp_path / "run", {"trainer": {"tp": 2, "dp": 2},
                                           "rollout": {"engines": 2, "gpus_per_engine": 2},
                                           "resources": {"colocate": True, "collective_timeout_s": 60}})
    proc, _ = mpirun(run, "colocated")
    ok(proc)
    out = outputs(run)
    assert [o["role"] for o in out] == ["both"] * 4
    assert [(o["trainer"], o["rollout"], o["engine"]) for o in out] == [(4, 4, 2)] * 4
    assert [o["dist_world"] for o in out] == [4] * 4 and out[0]["allreduce"] == 10.0
    assert all(o["sync"] == {} and o["bit_exact"] and o["version"] == 5 for o in out)
    assert all(o["whole_model"] for o in out)  # a model exported in parts reaches every rank's engine whole


def _assert_ended_naming(proc: subprocess.CompletedProcess[str], needle: str, rank: int) -> None:
    assert proc.returncode != 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("milehpc: error:")]
    assert any(f"rank {rank}" in line.split(": ", 3)[-1] and needle in line for line in lines), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_killed_rank_is_named_within_timeout(tmp_path: Path) -> None:
    """Rank 2 is SIGKILLed while the others wait for it in a weight sync, under plain mpirun: non-zero exit, rank 2
    named, well within the timeout. (With ULFM, where milehpc alone must end the survivors:
    test_rank_dying_in_native_code_says_where, and under srun tests/test_runtime_slurm.py with SIGKILL.)"""
    timeout = 20
    run = write_run_dir(tmp_path / "run", {"trainer": {"pp": 2}, "rollout": {"engines": 2},
                                           "resources": {"collective_timeout_s": timeout}})
    proc, _ = mpirun(run, "die")
    # plain mpirun kills the survivors itself as soon as it sees the death; it may beat milehpc's message
    assert proc.returncode != 0
    assert ("process rank 2 with PID" in proc.stderr or "rank 2 (pid" in proc.stderr), proc.stderr[-3000:]
    killed_at = json.loads((run / "out" / "rank-2.json").read_text())["started"] + 0.5
    assert time.time() - killed_at < timeout + 10  # ended by milehpc, not by the test's own timeout


def test_rank_dying_in_native_code_says_where(tmp_path: Path) -> None:
    """Rank 2 dies of a segfault while the others wait for it in a weight sync. With ULFM the launcher keeps the
    others alive, so milehpc alone must end them: non-zero exit, 'rank 2 ... gone', well within the timeout. A
    segfault leaves no Python traceback: the rank's fault handler prints its stack into the job's log."""
    needs_ulfm()
    timeout = 20
    run = write_run_dir(tmp_path / "run", {"trainer": {"pp": 2}, "rollout": {"engines": 2},
                                           "resources": {"collective_timeout_s": timeout}})
    proc, _ = mpirun(run, "die", flags=("--with-ft", "ulfm"), env={"MILEHPC_TEST_DIE_SIGNAL": "SIGSEGV"})
    _assert_ended_naming(proc, "gone", 2)
    killed_at = json.loads((run / "out" / "rank-2.json").read_text())["started"] + 0.5
    assert time.time() - killed_at < timeout + 10  # ended by milehpc, not by the test's own timeout
    assert "Fatal Python error: Segmentation fault" in proc.stderr, proc.stderr[-3000:]
    assert re.search(r'File ".*runtime_mpi_entries\.py", line \d+ in die', proc.stderr), proc.stderr[-3000:]


@pytest.mark.slow
def test_frozen_rank_is_found_by_heartbeat(tmp_path: Path) -> None:
    """Rank 2 is frozen (SIGSTOP): its process exists, MPI sees nothing wrong; the heartbeat ring names it."""
    run = write_run_dir(tmp_path / "run", {"rollout": {"engines": 3}, "resources": {"collective_timeout_s": 60}})
    proc, _ = mpirun(run, "hang", env={"MILEHPC_HEARTBEAT_TIMEOUT": "5"})
    _assert_ended_naming(proc, "stopped responding", 2)
    frozen_at = json.loads((run / "out" / "rank-2.json").read_text())["started"] + 0.5
    assert time.time() - frozen_at < 40  # the heartbeat (5 s), not the 60 s collective timeout


@pytest.mark.slow
def test_sync_to_three_rollout_ranks_then_a_stuck_rank_is_named_by_the_barrier_timeout(tmp_path: Path) -> None:
    """One trainer rank, three single-rank engines: one weight-sync group of 4, bit-exact on all three (32 KiB
    buckets). Then rank 1 never arrives at a barrier: the others end naming it (one launch for both: CI time)."""
    run = write_run_dir(tmp_path / "run", {"rollout": {"engines": 3}, "resources": {"collective_timeout_s": 60}})
    proc, _ = mpirun(run, "stuck", env={"TEST_BUCKET_BYTES": str(32 * 1024)})
    out = outputs(run)
    assert out[0]["group_versions"] == {"0": 2}
    for rollout in out[1:]:
        assert rollout["bit_exact"] and rollout["checked"] == 324 and rollout["version"] == 2
        assert not rollout["checks"]["corrupted/0"]["ok"]
        assert rollout["checks"]["corrupted/0"]["worst"][:2] == ["layers.7.mlp.fc1.weight", 3]
    _assert_ended_naming(proc, "did not arrive within 3 s", 1)


@pytest.mark.slow
def test_crashing_rank_ends_the_others_with_its_error(tmp_path: Path) -> None:
    """Also when rank 0 takes the notice late, as under load (its watchdog made 1.5 s slow; the plain case is the
    same run without the delay): the crashing rank waits until rank 0 repeated it."""
    needs_ulfm()
    run = write_run_dir(tmp_path / "run", {"rollout": {"engines": 3}, "resources": {"collective_timeout_s": 60}})
    proc, _ = mpirun(run, "crash", flags=("--with-ft", "ulfm"), env={"MILEHPC_TEST_SLOW_RANK0": "1.5"})
    assert proc.returncode != 0
    assert "ValueError: deliberate failure in the test entry" in proc.stderr
    # rank 0 (alive, waiting in the barrier) repeats rank 3's error: it did not just vanish.
    assert any(line.startswith("milehpc: error: rank 0:") and "rank 3 failed" in line
               for line in proc.stderr.splitlines()), proc.stderr[-3000:]


def test_wrong_world_size_is_one_clear_error(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path / "run", {"trainer": {"pp": 2}, "rollout": {"engines": 2}})
    proc, _ = mpirun(run, None, np=3)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("milehpc: error:")]
    assert len(errors) == 1, proc.stderr
    assert "plan.json: world_size: expected an MPI world of 4 ranks, got 3" in errors[0]
    assert errors[0].startswith("milehpc: error: rank 0:")
    assert "Traceback" not in proc.stderr

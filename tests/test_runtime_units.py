"""Single-process parts of the job runtime: device choice, bucket layout and byte packing, weight comparison,
rendezvous ports, converters, run-directory loading. (The MPI parts are in test_runtime_mpi.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from milehpc.comm import devices, net
from milehpc.errors import ConfigError, PluginError, RuntimeFailure
from milehpc.weights.broadcast import ALIGN, plan_buckets, recv_weights_stream, send_weights
from milehpc.weights.check import compare_named_tensors
from milehpc.weights.converters import find_converter, identity

# ---- devices ----------------------------------------------------------------------------------------------


def test_cpu_site_binds_no_gpu() -> None:
    assert devices.choose_device("none", 3, 4, {"CUDA_VISIBLE_DEVICES": "1"}).kind == "cpu"


def test_slurm_per_task_binding_is_index_zero() -> None:
    """--gpus-per-task=1: Slurm shows each task one GPU, which the runtime renumbers to 0."""
    choice = devices.choose_device("nvidia", 5, 8, {"CUDA_VISIBLE_DEVICES": "5"})
    assert (choice.kind, choice.index, choice.physical, choice.unset) == ("cuda", 0, "5", ())


def test_per_node_binding_uses_local_rank() -> None:
    choice = devices.choose_device("nvidia", 2, 4, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert (choice.index, choice.physical) == (2, "2")
    assert devices.choose_device("nvidia", 3, 4, {}).index == 3  # nothing set: all visible


def test_amd_double_filter_is_removed_not_repeated() -> None:
    """Slurm set ROCR_VISIBLE_DEVICES=6; a site script also set HIP_VISIBLE_DEVICES=6 (physical): HIP would look for
    its 7th device among the 1 ROCr left and find none. The HIP variable is dropped; index 0 is used."""
    env = {"ROCR_VISIBLE_DEVICES": "6", "HIP_VISIBLE_DEVICES": "6", "CUDA_VISIBLE_DEVICES": "6"}
    choice = devices.choose_device("amd", 6, 8, env)
    assert choice.index == 0 and choice.physical == "6"
    assert set(choice.unset) == {"HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"}
    # Already renumbered (0..n-1) is not a double filter: leave it.
    assert devices.choose_device("amd", 0, 8, {"ROCR_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0"}).unset == ()


def test_amd_without_rocr_uses_hip_list() -> None:
    choice = devices.choose_device("amd", 1, 2, {"HIP_VISIBLE_DEVICES": "4,5"})
    assert (choice.index, choice.physical) == (1, "5")


def test_empty_visibility_is_a_clear_error() -> None:
    with pytest.raises(RuntimeFailure, match="CUDA_VISIBLE_DEVICES is set but empty"):
        devices.choose_device("nvidia", 0, 1, {"CUDA_VISIBLE_DEVICES": ""})


def test_local_rank_prefers_the_launcher() -> None:
    assert devices.local_rank_from_env({"SLURM_LOCALID": "3"}, 0) == 3
    assert devices.local_rank_from_env({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 0) == 2
    assert devices.local_rank_from_env({}, 7) == 7


# ---- buckets ----------------------------------------------------------------------------------------------


def _mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c", torch.rand(9, generator=g) > 0.5),
        ("d", torch.randint(0, 1 << 50, (3,), generator=g)),
        ("e", torch.randn(4, 6, generator=g).to(torch.float16).t()),  # non-contiguous
        ("f", torch.tensor(2.5, dtype=torch.float64)),  # 0-d
        ("g", torch.empty(0, 4)),  # empty
        ("big", torch.randn(64, 64, generator=g)),
    ]


def test_bucket_layout_is_aligned_and_bounded() -> None:
    named = _mixed()
    metas, buckets = plan_buckets(named, bucket_bytes=128, direct_bytes=4096)
    assert [m.name for m in metas] == [n for n, _ in named]
    for bucket in buckets:
        assert bucket.direct or bucket.nbytes <= 128
        offsets = [metas[i].offset for i in bucket.tensors]
        assert all(o % ALIGN == 0 for o in offsets)
    big = next(m for m in metas if m.name == "big")
    assert buckets[big.bucket].direct and buckets[big.bucket].tensors == (len(named) - 1,)
    assert len([b for b in buckets if not b.direct]) > 1


class _Wire:
    """One weight-sync group's two channels (MPI headers, backend broadcasts) recorded on the source and replayed
    on a receiver: the byte layout alone, no processes (tests/test_runtime_mpi.py sends it for real)."""

    def __init__(self) -> None:
        self.headers: list = []
        self.sent: list[torch.Tensor] = []
        self.buffers: list = []
        self.device, self.stage, self.source, self.ranks, self.rank = torch.device("cpu"), 0, 0, [0, 1], 0
        self.version, self.comms = -1, self

    @property
    def is_source(self) -> bool:
        return self.rank == self.source

    def bcast(self, obj, root, ranks, *, what="", timeout=None):  # noqa: ANN001, ANN201
        if self.is_source:
            self.headers.append(obj)
            return obj
        return self.headers.pop(0)

    def broadcast(self, buf: torch.Tensor) -> None:
        if self.is_source:
            self.sent.append(buf.clone())
        else:
            buf.copy_(self.sent.pop(0))

    def wait(self, work, what, timeout=None) -> None:  # noqa: ANN001
        pass


def test_pack_unpack_round_trip_is_bit_exact() -> None:
    named = _mixed()
    wire = _Wire()
    stats = send_weights(wire, iter(named), 1, bucket_bytes=256, direct_bytes=1024)
    assert stats.buckets == len(plan_buckets(named, bucket_bytes=256, direct_bytes=1024)[1])
    assert stats.tensors == len(named) and not wire.buffers  # released after the sync
    wire.rank = 1
    got = {name: t.clone() for name, t in recv_weights_stream(wire)}
    for name, want in named:
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        assert torch.equal(got[name], want), name
    assert not wire.buffers and not wire.sent and not wire.headers


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        plan_buckets([("w", torch.zeros(1)), ("w", torch.zeros(1))])


# ---- comparing ----------------------------------------------------------------------------------------------


def test_compare_reports_the_worst_mismatch() -> None:
    want = [("x", torch.zeros(4)), ("y", torch.zeros(2, 2)), ("z", torch.ones(3)), ("q.scale", torch.ones(1))]
    have = {"x": torch.tensor([0.0, 0.1, 0.0, 0.0]), "y": torch.tensor([[0.0, 0.0], [0.0, 2.0]]),
            "z": torch.ones(3), "q.scale": torch.full((1,), 9.0)}
    res = compare_named_tensors(want, have, rank=5, skip=["*.scale"])
    assert not res.ok and res.checked == 3 and res.skipped == 1
    assert {m.name for m in res.mismatches} == {"x", "y"}
    assert res.worst is not None and (res.worst.name, res.worst.rank, res.worst.max_abs_diff) == ("y", 5, 2.0)
    assert "worst: y on rank 5" in res.summary()
    assert compare_named_tensors(want, have, atol=2.0, skip=["*.scale"]).ok


def test_compare_exact_catches_a_one_ulp_change_and_dtype_and_missing() -> None:
    t = torch.randn(10, dtype=torch.bfloat16)
    bumped = t.clone()
    bumped.view(torch.int16)[3] += 1  # one ulp
    assert not compare_named_tensors([("t", t)], {"t": bumped}).ok
    assert compare_named_tensors([("t", t)], {"t": bumped}, rtol=0.01).ok
    assert "dtype" in compare_named_tensors([("t", t)], {"t": t.float()}).mismatches[0].reason
    assert "missing" in compare_named_tensors([("t", t)], {}).mismatches[0].reason
    # Issue 30: a name the engine holds but cannot read back (SGLang's get_weights_by_name answering None) fails.
    unreadable = compare_named_tensors([("t", t)], {"t": None})
    assert not unreadable.ok and "unreadable" in unreadable.mismatches[0].reason
    assert "(1 unreadable)" in unreadable.summary()
    nan = torch.tensor([float("nan")])
    assert compare_named_tensors([("n", nan)], {"n": nan.clone()}).ok  # bit-exact NaN is equal
    assert not compare_named_tensors([("n", nan)], {"n": torch.zeros(1)}, atol=1.0).ok


# ---- rendezvous ---------------------------------------------------------------------------------------------


def test_seeded_port_is_stable_and_in_range() -> None:
    assert net.seeded_port("12345") == net.seeded_port("12345")
    assert net.seeded_port("12345") != net.seeded_port("12346")
    assert all(20000 <= net.seeded_port(str(i), a) < 60000 for i in range(50) for a in range(3))


def test_host_store_skips_a_busy_port() -> None:
    first, port1 = net.host_store("127.0.0.1", "busy-port-test", 1, 10)
    second, port2 = net.host_store("127.0.0.1", "busy-port-test", 1, 10)  # same seed: the port is taken
    assert port1 == net.seeded_port("busy-port-test") or port1 == net.seeded_port("busy-port-test", 1)
    assert port2 != port1
    first.set("k", "v")
    assert first.get("k") == b"v"
    del first, second


def test_resolve_address_modes() -> None:
    import socket

    assert net.resolve_address("127.0.0.1") == "127.0.0.1"
    assert net.resolve_address("hostname") == socket.gethostname()


# ---- converters ---------------------------------------------------------------------------------------------


def test_identity_converter_when_formats_agree() -> None:
    assert find_converter("hf", "hf") is identity


def test_missing_converter_is_one_line() -> None:
    with pytest.raises(PluginError, match="no weight converter from 'nonexistent' to 'hf'"):
        find_converter("nonexistent", "hf")


# ---- run directory ------------------------------------------------------------------------------------------


def test_run_dir_errors_name_the_file(tmp_path: Path) -> None:
    from milehpc.runtime.launch import load_run_dir

    with pytest.raises(ConfigError, match="job.json: file not found"):
        load_run_dir(tmp_path)
    (tmp_path / "job.json").write_text(json.dumps({"name": "x"}))
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(ConfigError, match="plan.json: cannot read"):
        load_run_dir(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps({"world_size": 4}))
    with pytest.raises(ConfigError, match="plan.json: not a plan"):
        load_run_dir(tmp_path)


def test_launch_without_a_run_dir_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "milehpc", "launch", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"milehpc: error: rank 0: {tmp_path / 'nope' / 'job.json'}: file not found (is this a run directory "
        "written by `milehpc submit`?)"]


def test_liveness_check_survives_a_clock_step_and_sees_death_and_pid_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """A neighbour rank is alive while its process runs, whatever the wall clock does: /proc/stat's btime moves by a
    whole second when the clock is slewed or stepped (CI saw a live rank 0 reported "gone"), so the check must not
    depend on it. A killed process (zombie, then reaped) and a reused pid are not alive."""
    import dataclasses

    import psutil

    from milehpc.comm import watchdog

    # the neighbour describes itself, as a rank does at start-up
    child = subprocess.Popen([sys.executable, "-c", "import dataclasses, json, time; from milehpc.comm import watchdog; "
                              "print(json.dumps(dataclasses.astuple(watchdog.this_peer(1))), flush=True); "
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        peer = watchdog.Peer(*json.loads(child.stdout.readline()))
        assert peer.pid == child.pid
        assert watchdog._alive(peer)
        booted = psutil.boot_time()
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: booted + 1.0)  # btime after a clock step
        assert watchdog._alive(peer)
        assert not watchdog._alive(dataclasses.replace(peer, started=peer.started + 1))  # the pid, reused
        child.kill()
        deadline = time.monotonic() + 10
        while watchdog._alive(peer):  # dead but not reaped: a zombie, which is not alive either
            assert time.monotonic() < deadline, "a killed process still looks alive"
            time.sleep(0.01)
        child.wait(timeout=10)
        assert not watchdog._alive(peer)
    finally:
        child.kill()
        child.wait()


def _combine_rank(rank: int, store: str, out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from milehpc.comm.collectives import combine_rank_metrics

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    assert dist.get_world_size() == 2
    mine = [{"advantages/max": 0.5, "advantages/min": -0.25, "advantages/mean": 0.1},
            {"advantages/max": 2.0, "advantages/min": -3.0, "advantages/mean": 0.3}][rank]
    got = combine_rank_metrics(mine, 2)
    (Path(out_dir) / f"rank-{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


def test_rank_metrics_combine_maxima_minima_and_means_over_dp(tmp_path: Path) -> None:
    """Each DP rank's advantage statistics are of its share of the batch: the step's maximum is the largest, its
    minimum the smallest, and only the other keys are means (a mean of maxima is not the maximum)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_combine_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline, "the 2 gloo ranks did not finish"
    want = {"advantages/max": 2.0, "advantages/min": -3.0, "advantages/mean": pytest.approx(0.2)}
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank-{rank}.json").read_text()) == want

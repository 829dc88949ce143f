"""The device check's NCCL stand-in keeps NCCL's rules on every process-group operation (issue 30): two spawned ranks
over real gloo groups, the check on (``milehpc.comm.devcheck``: the CPU stands in for CUDA, gloo groups for NCCL
groups unless asked for as gloo). One launch; each rank writes what it saw and the tests below read it.

What NCCL refuses and the stand-in must refuse too:

* a CPU tensor on any operation, the ProcessGroup's own methods included: the default group's ``pg.allreduce``, a
  ``new_group``'s ``pg.broadcast`` and the ``pg.broadcast`` of an update group built SGLang's way
  (``_new_process_group_helper``, :func:`milehpc.weights.sglang.join_update_group`: what fault 1 sent into);
* two devices in one call, or a rank changing its device on a group (one device per rank);
* two members of a group on one GPU of one host (``Duplicate GPU detected``), declared into the group's store;
* a ``work.wait(timeout)`` past ``timeout`` after the *enqueue*: the wait throws, the work reads as completed and
  the group is aborted (``WorkNCCL::wait`` / ``checkTimeout``);
* any operation on a communicator whose memory is released (``ncclCommSuspend``) until it is resumed.

And FSDP2's weight export on separate rollout ranks gathers each tensor onto the sending rank only.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from spawn_ranks import spawn_ranks

WORLD = 2


def _refused(fn: Any, kind: type[BaseException]) -> str | None:
    """The first line of the error ``fn`` raised if it is a ``kind``, else None (it went through)."""
    try:
        work = fn()
        if work is not None:
            work.wait()
    except kind as err:
        return str(err).splitlines()[0]
    return None


def _rank(rank: int, store: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from milehpc.comm import devcheck
    from milehpc.comm.nccl_memory import CommunicatorMemory
    from milehpc.weights.sglang import join_update_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    res: dict[str, Any] = {"fsdp": _fsdp_export(rank)}  # on the plain CPU: the trainer is not on a (stand-in) GPU
    devcheck.enable()  # the default group made before stands for NCCL all the same
    bad = devcheck.DevicePlacementError

    def bcast(pg: Any, t: Any) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return pg.broadcast([t], opts)

    # CUDA tensors only, on every method of every group that stands for NCCL.
    default = dist.distributed_c10d._get_default_group()
    res["default_cpu"] = _refused(lambda: default.allreduce([torch.ones(2)], dist.AllreduceOptions()), bad)
    t = torch.ones(2, device="cuda")
    default.allreduce([t], dist.AllreduceOptions()).wait()
    res["default_cuda"] = t.tolist()
    res["functional_cpu"] = _refused(lambda: dist.all_reduce(torch.ones(2)), bad)
    nccl_like = dist.new_group([0, 1])
    res["new_group_cpu"] = _refused(lambda: bcast(nccl_like, torch.ones(3)), bad)
    gloo = dist.new_group([0, 1], backend="gloo")
    res["gloo_cpu"] = _refused(lambda: bcast(gloo, torch.ones(3)), bad)  # asked for as gloo: takes anything
    upd = join_update_group(dist.FileStore(f"{store}-upd", WORLD), world_size=WORLD, rank=rank, group_name="upd",
                            backend="gloo", timeout=60)
    res["update_cpu"] = _refused(lambda: bcast(upd, torch.zeros(8, dtype=torch.uint8)), bad)
    flat = torch.full((8,), 5 if rank == 0 else 0, dtype=torch.uint8, device="cuda")
    bcast(upd, flat).wait()
    res["update_cuda"] = flat.tolist()
    res["object_collective"] = [None, None]
    dist.all_gather_object(res["object_collective"], rank)  # torch's own tensors for it go on CUDA, as for NCCL

    # One device per rank.
    res["two_devices"] = _refused(lambda: default.allreduce([torch.ones(1, device="cuda:0"),
                                                             torch.ones(1, device="cuda:1")],
                                                            dist.AllreduceOptions()), bad)
    moved = dist.new_group([0, 1])
    bcast(moved, torch.ones(2, device=f"cuda:{rank}")).wait()
    res["device_changed"] = _refused(lambda: bcast(moved, torch.ones(2, device=f"cuda:{rank + 2}")), bad)

    # No two members on one GPU: both ranks declare GPU 3 of this host into the group's store.
    dup_file = dist.FileStore(f"{store}-dup", WORLD)
    devcheck.declare_device(dist.PrefixStore("dup", dup_file), rank, 3)  # what the engine side declares
    dist.barrier(group=gloo)
    dup = join_update_group(dup_file, world_size=WORLD, rank=rank, group_name="dup", backend="gloo", timeout=60)
    res["duplicate_gpu"] = _refused(lambda: bcast(dup, torch.ones(1, device="cuda")), bad)

    # wait(timeout) counts from the enqueue and aborts the group.
    slow = dist.new_group([0, 1])
    dist.barrier(group=gloo)
    t = torch.full((2,), 9.0 if rank == 0 else 0.0, device="cuda")
    if rank == 0:
        work = bcast(slow, t)
        time.sleep(2.0)
        # 2.5 s after the enqueue the receiver (4 s) is not there: NCCL aborts even though this wait began at 2 s.
        res["wait_timeout"] = _refused(lambda: work.wait(timedelta(seconds=2.5)), dist.DistBackendError)
        res["completed_after_abort"] = work.is_completed()
        res["after_abort"] = _refused(lambda: bcast(slow, t), dist.DistBackendError)
    else:
        time.sleep(4.0)
        bcast(slow, t).wait()  # the sender's gloo op is still there to meet
        res["slow_received"] = t.tolist()
    # A wait(timeout) that the operation beats stays a normal wait.
    t = torch.ones(1, device="cuda")
    default.allreduce([t], dist.AllreduceOptions()).wait(timedelta(seconds=30))
    res["timely_wait"] = t.tolist()

    # The trainer's communicator memory released during rollout: unusable until restored.
    memory = CommunicatorMemory()
    memory.release()
    res["suspended"] = _refused(lambda: dist.all_reduce(torch.ones(1, device="cuda")), dist.DistBackendError)
    res["suspended_gloo"] = _refused(lambda: bcast(gloo, torch.ones(1)), dist.DistBackendError)
    memory.restore()
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    res["resumed"] = t.tolist()
    res["violations"] = devcheck.violations()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(res))
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def _fsdp_export(rank: int) -> dict[str, Any]:
    """FSDP2 over the two ranks (separate rollout ranks): the export gathers each weight onto rank 0 alone."""
    import torch

    from milehpc.config.load import job_from_dict
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import build_model
    from milehpc.train.torch_trainer import TorchTrainer

    # 3 layers: hidden 24 and 3 KV rows do not split evenly over 2 ranks (a shorter last shard).
    job = job_from_dict({"name": "fsdp", "model": {"hidden_size": 24, "num_layers": 3, "num_heads": 2,
                                                   "num_kv_heads": 1, "intermediate_size": 40},
                         "trainer": {"dp": WORLD, "micro_batch_size": 4}})
    tok = build_tokenizer("toy")
    trainer = TorchTrainer(job, tok, options={"fsdp": True})
    assert trainer.export_is_collective
    from torch.distributed.tensor import DTensor

    full_gathers = []
    real = DTensor.full_tensor

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:  # the all-gather: the whole tensor on every rank
        full_gathers.append(1)
        return real(self, *args, **kwargs)

    DTensor.full_tensor = counted  # type: ignore[method-assign]
    try:
        named = list(trainer.export_weights())
    finally:
        DTensor.full_tensor = real  # type: ignore[method-assign]
    want = build_model(job.model, tok.vocab_size, seed=job.run.seed, pad_id=int(tok.pad_id),
                       eos_id=tok.eos_id).state_dict()
    return {"names": len(named), "want": len(want), "full_gathers": len(full_gathers),
            "exact": all(torch.equal(t, want[n]) for n, t in named) and {n for n, _ in named} == set(want),
            "sync_bytes": trainer.sync_bytes}


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    work = tmp_path_factory.mktemp("nccl-rules")
    spawn_ranks(_rank, (str(work / "store"), str(work)), WORLD, seconds=240, what="the NCCL-rule checks")
    return [json.loads((work / f"rank-{r}.json").read_text()) for r in range(WORLD)]


def test_cpu_tensors_are_refused_on_every_group_method(seen: list[dict[str, Any]]) -> None:
    for res in seen:
        for key in ("default_cpu", "new_group_cpu", "update_cpu"):
            assert res[key] and "cpu tensor" in res[key] and "ProcessGroup." in res[key], (key, res[key])
        assert "torch.distributed.all_reduce" in res["functional_cpu"]
        assert res["gloo_cpu"] is None  # a group asked for as gloo is not NCCL
        assert res["default_cuda"] == [2.0, 2.0] and res["update_cuda"] == [5] * 8
        assert res["object_collective"] == [0, 1]


def test_one_device_per_rank_and_no_shared_gpu(seen: list[dict[str, Any]]) -> None:
    for res in seen:
        assert "2 devices" in res["two_devices"]
        assert "one device per rank" in res["device_changed"]
        assert "both on GPU" in res["duplicate_gpu"] and "/3" in res["duplicate_gpu"]


def test_wait_timeout_counts_from_the_enqueue_and_aborts_the_group(seen: list[dict[str, Any]]) -> None:
    sender, receiver = seen
    assert "before timing out" in sender["wait_timeout"] and "timed out" not in sender["wait_timeout"]
    assert sender["completed_after_abort"] is True  # as WorkNCCL: the error makes it "completed"
    assert "NCCL communicator was aborted" in sender["after_abort"]
    assert receiver["slow_received"] == [9.0, 9.0]
    assert sender["timely_wait"] == receiver["timely_wait"] == [2.0]


def test_released_communicators_are_unusable_until_restored(seen: list[dict[str, Any]]) -> None:
    for res in seen:
        assert "suspended NCCL communicator" in res["suspended"]
        assert res["suspended_gloo"] is None
        assert res["resumed"] == [2.0]


def test_fsdp2_export_gathers_onto_the_sender_only(seen: list[dict[str, Any]]) -> None:
    """Issue 30: FSDP2 with separate rollout ranks copied the whole model on every rank at each export."""
    sender, other = seen[0]["fsdp"], seen[1]["fsdp"]
    assert sender["exact"] and sender["names"] == sender["want"] > 0 and sender["sync_bytes"] > 0
    assert other["names"] == 0 and other["sync_bytes"] == 0
    assert sender["full_gathers"] == other["full_gathers"] == 0  # gathers to rank 0, no all-gather anywhere

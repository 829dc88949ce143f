"""Entry points (``module:function``) that the runtime's MPI tests launch on every rank with ``milehpc launch``.

Each writes what it saw to ``RUN_DIR/out/rank-N.json`` for the test to assert on. Imported by the ranks only.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any


def _write(ctx: Any, data: dict[str, Any]) -> None:
    out = ctx.run_dir / "out"
    out.mkdir(exist_ok=True)
    (out / f"rank-{ctx.rank}.json").write_text(json.dumps(data))


def _size(comm: Any) -> int | None:
    return None if comm is None else comm.Get_size()


def model_tensors(seed: int = 0, layers: int = 40) -> list[tuple[str, Any]]:
    """A few hundred named tensors of mixed dtypes, shapes like a small transformer (deterministic)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out: list[tuple[str, Any]] = [("embed_tokens.weight", torch.randn(512, 64, generator=gen))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            (p + "self_attn.qkv.weight", torch.randn(192, 64, generator=gen).to(torch.bfloat16)),
            (p + "self_attn.qkv.bias", torch.randn(192, generator=gen).to(torch.bfloat16)),
            (p + "self_attn.o_proj.weight", torch.randn(64, 64, generator=gen).to(torch.float16)),
            (p + "mlp.fc1.weight", torch.randn(256, 64, generator=gen)),
            (p + "mlp.fc2.weight", torch.randn(64, 128, generator=gen).t()),  # non-contiguous
            (p + "input_layernorm.weight", torch.rand(64, generator=gen)),
            (p + "router.counts", torch.randint(0, 1 << 40, (8,), generator=gen)),  # int64
            (p + "mask", torch.rand(7, generator=gen) > 0.5),  # bool, odd size (alignment)
        ]
    out += [("norm.weight", torch.ones(64)), ("step", torch.tensor(3.5, dtype=torch.float64)),
            ("lm_head.weight", torch.randn(512, 64, generator=gen))]
    return out


class DictEngine:
    """The part of the Engine protocol weight sync touches: loads (copies) named tensors, tracks the version."""

    def __init__(self) -> None:
        self.weights: dict[str, Any] = {}
        self.version = -1
        self.updates = 0

    def update_weights(self, named_tensors: Any, version: int) -> None:
        for name, tensor in named_tensors:
            self.weights[name] = tensor.clone()
        self.version = version
        self.updates += 1

    def named_parameters(self) -> Any:
        return iter(self.weights.items())


def groups(ctx: Any) -> None:
    _write(ctx, _groups(ctx))


def sync(ctx: Any) -> None:
    _write(ctx, _sync(ctx))


def groups_and_sync(ctx: Any) -> None:
    _write(ctx, _groups(ctx) | _sync(ctx) | _lora_buckets(ctx) | _streamed(ctx) | _slow_member(ctx))


def _groups(ctx: Any) -> dict[str, Any]:
    """Report the split and the groups, and prove the torch groups work (all-reduce / broadcast)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    comms, plan = ctx.comms, ctx.plan
    data: dict[str, Any] = {
        "rank": comms.rank, "size": comms.size, "role": plan.role(comms.rank), "trainer": _size(comms.trainer),
        "rollout": _size(comms.rollout), "engine": _size(comms.engine), "device": str(comms.device),
        "backend": comms.backend, "restart_count": ctx.restart_count,
        "sync": {str(s): g.ranks for s, g in comms.sync_groups.items()},
        # one world over COMM_WORLD itself, and which MPI and launcher task it is (srun: SLURM_PROCID)
        "world_sum": comms.world.allreduce(comms.rank, op=MPI.SUM),
        "library": MPI.Get_library_version().split(",")[0], "procid": int(os.environ.get("SLURM_PROCID", "-1")),
    }
    if comms.is_trainer:
        t = torch.tensor([float(comms.rank + 1)])
        dist.all_reduce(t)
        data |= {"dist_world": dist.get_world_size(), "dist_rank": dist.get_rank(), "allreduce": t.item()}
    got = {}
    for stage, group in sorted(comms.sync_groups.items()):
        t = torch.tensor([100.0 + stage]) if group.is_source else torch.zeros(1)
        group.wait(group.broadcast(t), f"test broadcast stage {stage}")
        got[str(stage)] = t.item()
    data["sync_bcast"] = got
    return data


def _sync(ctx: Any) -> dict[str, Any]:
    """Bucketed sync of model_tensors() to every rollout rank, bit-exact; then check_weight_update_equal, clean and
    with one corrupted parameter on the last rank."""
    from milehpc.weights.check import check_weight_update_equal, compare_named_tensors
    from milehpc.weights.sync import sync_weights

    comms, plan = ctx.comms, ctx.plan
    bucket = int(os.environ.get("TEST_BUCKET_BYTES", 64 * 1024))
    expected = model_tensors()
    split = len(expected) // plan.pp

    def stage_tensors(stage: int) -> list[tuple[str, Any]]:
        return expected[stage * split: (stage + 1) * split if stage < plan.pp - 1 else None]

    engine = DictEngine() if comms.is_rollout else None
    data: dict[str, Any] = {"rank": comms.rank, "tensors": len(expected)}
    for version in (1, 2):
        sent = sync_weights(comms, version, named_tensors=stage_tensors, engine=engine, bucket_bytes=bucket)
        data["sent"] = [[s.tensors, s.buckets, s.nbytes] for s in sent]
    if engine is not None:
        result = compare_named_tensors(expected, engine.weights, rank=comms.rank)
        data |= {"bit_exact": result.ok, "checked": result.checked, "version": engine.version,
                 "updates": engine.updates, "dtypes": sorted({str(t.dtype) for t in engine.weights.values()}),
                 "summary": result.summary()}
    data["group_versions"] = {str(s): g.version for s, g in comms.sync_groups.items()}
    checks = {}
    for label in ("clean", "corrupted"):
        if label == "corrupted" and engine is not None and comms.rank == plan.world_size - 1:
            target = engine.weights["layers.7.mlp.fc1.weight"]
            target[3, 5] += 0.25
        for stage, group in sorted(comms.sync_groups.items()):
            res = check_weight_update_equal(group, named_tensors=stage_tensors(stage) if group.is_source else None,
                                            local=engine.weights if engine is not None else None,
                                            skip=["*.router.counts"], bucket_bytes=bucket)
            worst = res.worst
            checks[f"{label}/{stage}"] = {"ok": res.ok, "checked": res.checked, "skipped": res.skipped,
                                          "worst": None if worst is None else [worst.name, worst.rank,
                                                                               worst.max_abs_diff],
                                          "summary": res.summary()}
    data["checks"] = checks
    if engine is not None:  # tolerance: the same corruption passes with atol 0.3
        data["tolerant"] = compare_named_tensors(expected, engine.weights, atol=0.3).ok
    return data


def lora_adapters(seed: int = 1) -> list[tuple[str, Any]]:
    """Two adapters' sync in multi-LoRA names (milehpc.train.multi_lora): "small" at rank 8 (2 KiB per matrix),
    "wide" at rank 16 (4 KiB per matrix: a bucket of its own at 4 KiB buckets), each with its scaling."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out: list[tuple[str, Any]] = []
    for adapter, rank in (("small", 8), ("wide", 16)):
        out.append((f"lora.scaling.{adapter}", torch.tensor([2.0], dtype=torch.float64)))
        for i in range(3):
            for m in ("q_proj", "v_proj"):
                pre = f"model.layers.{i}.self_attn.{m}"
                out += [(f"{pre}.lora_A.{adapter}.weight", torch.randn(rank, 64, generator=gen)),
                        (f"{pre}.lora_B.{adapter}.weight", torch.randn(64, rank, generator=gen))]
    return out


def _lora_buckets(ctx: Any) -> dict[str, Any]:
    """Issue 30, fault 9: an adapter sync spanning more buckets than the group's two receive buffers, taken apart on
    the rollout ranks by sglang_lora.split_adapters straight from the stream (as SGLangEngine._load_adapter does),
    must hand over the adapters as sent, not views the later buckets overwrote."""
    import torch

    from milehpc.rollout import sglang_lora
    from milehpc.weights.broadcast import recv_weights_stream, send_weights

    group = ctx.comms.sync_groups.get(0)
    if group is None:
        return {}
    sent = lora_adapters()
    if group.is_source:
        return {"lora_buckets": send_weights(group, sent, group.version + 1, bucket_bytes=4096).buckets}
    stream = recv_weights_stream(group)
    got = sglang_lora.split_adapters(stream)
    stream.drain()
    equal = {}
    for adapter, part in sglang_lora.split_adapters(sent).items():  # (buckets may reorder the tensors)
        have = dict(got.get(adapter, []))
        equal[str(adapter)] = have.keys() == dict(part).keys() and all(torch.equal(have[n], t) for n, t in part)
    return {"lora_equal": equal}


def _streamed(ctx: Any) -> dict[str, Any]:
    """Issue 33: a lazy export (each tensor made just before it is sent, as Megatron's gathers are) is sent as it
    comes: the source never holds more of it than the tensor being made, the one before (still named by the
    loops) and the one on the wire, whatever the model's size; the receivers get it bit-exact."""
    import weakref

    import torch

    group = ctx.comms.sync_groups.get(0)
    if group is None:
        return {}
    sent = model_tensors(seed=2, layers=20)
    if not group.is_source:
        got = {n: t.clone() for n, t in recv_weights_stream_of(group)}
        return {"streamed_equal": got.keys() == dict(sent).keys()
                and all(torch.equal(got[n], t) for n, t in sent)}
    live = [0, 0]  # bytes of the export alive now, the peak

    def gone(n: int) -> None:
        live[0] -= n

    def export() -> Any:
        for name, tensor in sent:
            fresh = tensor.clone()  # a gathered tensor: new memory the exporter must not pile up
            n = fresh.numel() * fresh.element_size()
            live[0] += n
            live[1] = max(live[1], live[0])
            weakref.finalize(fresh, gone, n)
            yield name, fresh

    from milehpc.weights.broadcast import send_weights

    stats = send_weights(group, export(), group.version + 1, bucket_bytes=64 * 1024)
    return {"streamed": {"peak": live[1], "largest": max(t.numel() * t.element_size() for _, t in sent),
                         "total": sum(t.numel() * t.element_size() for _, t in sent), "buckets": stats.buckets}}


def recv_weights_stream_of(group: Any) -> Any:
    from milehpc.weights.broadcast import recv_weights_stream

    stream = recv_weights_stream(group)
    yield from stream
    stream.drain()


def _slow_member(ctx: Any) -> dict[str, Any]:
    """Issue 30, fault 3: a bucket still in flight seconds after it was queued (the rollout ranks busy elsewhere)
    must not end the sync. Under the device check the sync groups keep NCCL's rules, among them that
    ``work.wait(timeout)`` counts from the enqueue and aborts the group (the old 1-s wait slices did that)."""
    import torch

    from milehpc.comm import devcheck

    devcheck.enable()  # last in the launch: the sync above ran on CPU buffers, which the check would refuse
    got = {}
    for stage, group in sorted(ctx.comms.sync_groups.items()):
        if group.is_source:
            t = torch.full((4,), 7.0 + stage, device="cuda")
        else:
            time.sleep(1.5)  # the broadcast waits this long for its receivers, past a 1-s slice after its enqueue
            t = torch.zeros(4, device="cuda")
        group.wait(group.broadcast(t), f"slow-member broadcast (stage {stage})", timeout=60)
        got[str(stage)] = t[0].item()
    return {"slow_member": got, "slow_member_check": devcheck.enabled()}


def colocated(ctx: Any) -> None:
    """Colocated: every rank is trainer and rollout; weights go into the engine in place, no broadcast."""
    from milehpc.weights.check import compare_named_tensors
    from milehpc.weights.inplace import whole_model
    from milehpc.weights.sync import sync_weights

    data = _groups(ctx)
    engine = DictEngine()
    tensors = model_tensors(layers=3)
    sync_weights(ctx.comms, 5, named_tensors=tensors, engine=engine)
    data |= {"bit_exact": compare_named_tensors(tensors, engine.weights).ok, "version": engine.version}
    # Exported the Megatron way at PP=2 (issue 30 fault 4): each stage's leader (ranks 0 and 2) its half, the others
    # nothing; every rank's engine still gets the whole model, in one order.
    half = len(tensors) // 2
    part = {0: tensors[:half], 2: tensors[half:]}.get(ctx.rank, [])
    whole = DictEngine()
    sync_weights(ctx.comms, 6, named_tensors=whole_model(ctx.comms, part), engine=whole)
    data["whole_model"] = (compare_named_tensors(tensors, whole.weights).ok and whole.version == 6
                           and list(whole.weights) == [n for n, _ in tensors])
    _write(ctx, data)


def die(ctx: Any) -> None:
    """Rank 2 is killed (SIGKILL, or ``MILEHPC_TEST_DIE_SIGNAL``) while the others wait for it in a weight sync /
    a barrier."""
    comms = ctx.comms
    _write(ctx, {"rank": comms.rank, "pid": os.getpid(), "started": time.time()})
    if comms.rank == 2:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.Signals[os.environ.get("MILEHPC_TEST_DIE_SIGNAL", "SIGKILL")])
    if comms.sync_groups:
        from milehpc.weights.sync import sync_weights

        engine = DictEngine() if comms.is_rollout else None
        sync_weights(comms, 1, named_tensors=model_tensors(layers=2), engine=engine)
    comms.barrier(what="after the weight sync")
    time.sleep(600)  # never reached when the runtime works


def hang(ctx: Any) -> None:
    """Rank 2 is frozen (SIGSTOP): alive to the OS, silent to everyone; only the heartbeat can tell."""
    comms = ctx.comms
    _write(ctx, {"rank": comms.rank, "pid": os.getpid(), "started": time.time()})
    if comms.rank == 2:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGSTOP)
    comms.barrier(what="waiting for the frozen rank")
    time.sleep(600)


def stuck(ctx: Any) -> None:
    """A weight sync to every rollout rank first (:func:`sync`, reported); then rank 1 never arrives at the barrier
    (alive but stuck): the others must time out naming it."""
    sync(ctx)
    ctx.comms.barrier(what="after the weight sync")  # the 3 s below start together
    if ctx.comms.rank == 1:
        time.sleep(600)
    ctx.comms.barrier(what="test barrier", timeout=3)


class _SlowComm:
    """A communicator whose every liveness pass starts late (the first probe of a pass waits)."""

    def __init__(self, comm: Any, delay: float) -> None:
        self._comm, self._delay = comm, delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def isend(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self._delay)  # the heartbeat, sent first in every pass
        return self._comm.isend(*args, **kwargs)


def _slow_down(dog: Any, delay: float) -> None:
    dog.comm = _SlowComm(dog.comm, delay)


def crash(ctx: Any) -> None:
    """Rank 3 raises; the others are waiting in a barrier and must end with its message."""
    if ctx.comms.rank == 0 and os.environ.get("MILEHPC_TEST_SLOW_RANK0"):
        # A loaded machine, made certain: rank 0's watchdog takes notices only every few seconds, so rank 3
        # must not exit (and have the launcher end rank 0) before rank 0 has repeated its error.
        _slow_down(ctx.comms.watchdog, float(os.environ["MILEHPC_TEST_SLOW_RANK0"]))
    if ctx.comms.rank == 3:
        raise ValueError("deliberate failure in the test entry")
    ctx.comms.barrier(what="test barrier")

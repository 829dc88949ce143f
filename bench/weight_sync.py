"""Weight-sync benchmark: bucketed, named broadcast vs a single flat-tensor broadcast of the same bytes.

One source (the trainer's stage leader) and 2 rollout ranks in a real weight-sync group (gloo on CPU), built by
``milehpc.comm.world.bootstrap`` exactly as in a job. The model is ~200 MB of Qwen2-shaped parameters (bf16
matrices, fp32 norms and biases). Each repetition times, side by side:

* ``flat``: one ``broadcast`` of a single preallocated uint8 tensor with the same number of bytes (the ceiling);
* ``bucketed``: ``send_weights`` / ``recv_weights`` (metadata first, then buckets, unpacked by name) for each
  bucket size of the sweep.

The ratio is flat time / bucketed time (1.0 = as fast as the flat broadcast): each bucketed run is paired with
a flat run just before it, and the median of the per-pair ratios is reported (the machine's load drifts).
The last line is one JSON object. Run: ``python bench/weight_sync.py`` (it starts ``mpirun -np 3`` itself).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20


def qwen2_like(layers: int = 5, hidden: int = 896, inter: int = 4864, vocab: int = 32768, heads: int = 14,
               kv_heads: int = 2) -> list[tuple[str, object]]:
    """Named parameters with a Qwen2 layout (tied embeddings), deterministic values."""
    import torch

    gen = torch.Generator().manual_seed(0)
    kv = hidden // heads * kv_heads

    def w(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    out: list[tuple[str, object]] = [("model.embed_tokens.weight", w(vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", w(hidden, dtype=torch.float32)),
            (p + "self_attn.q_proj.weight", w(hidden, hidden)), (p + "self_attn.q_proj.bias", w(hidden, dtype=torch.float32)),
            (p + "self_attn.k_proj.weight", w(kv, hidden)), (p + "self_attn.k_proj.bias", w(kv, dtype=torch.float32)),
            (p + "self_attn.v_proj.weight", w(kv, hidden)), (p + "self_attn.v_proj.bias", w(kv, dtype=torch.float32)),
            (p + "self_attn.o_proj.weight", w(hidden, hidden)),
            (p + "post_attention_layernorm.weight", w(hidden, dtype=torch.float32)),
            (p + "mlp.gate_proj.weight", w(inter, hidden)), (p + "mlp.up_proj.weight", w(inter, hidden)),
            (p + "mlp.down_proj.weight", w(hidden, inter)),
        ]
    out.append(("model.norm.weight", w(hidden, dtype=torch.float32)))
    return out


def _label(size: int) -> str:
    return f"{size // MiB}MiB" if size % MiB == 0 else f"{size / MiB:g}MiB"


def worker(args: argparse.Namespace) -> None:
    import torch

    from milehpc.comm.world import bootstrap
    from milehpc.config.load import job_from_dict
    from milehpc.config.site import Launcher, Partition
    from milehpc.plan import make_plan
    from milehpc.weights.broadcast import plan_buckets, recv_weights_stream, send_weights

    torch.set_num_threads(1)
    job = job_from_dict({"name": "bench-weight-sync", "rollout": {"engines": 2},
                         "resources": {"collective_timeout_s": 300}})
    plan = make_plan(job, Partition(scheduler="local", launcher=Launcher(kind="mpirun"), cpus_per_node=3),
                     site="local", partition_name="local")
    comms = bootstrap(plan, job, run_id=f"bench-weight-sync-{os.getppid()}")
    group = comms.sync_groups[0]
    named = qwen2_like(layers=args.layers) if group.is_source else []
    total = comms.bcast(sum(t.numel() * t.element_size() for _, t in named), group.source, group.ranks)
    flat = torch.zeros(total, dtype=torch.uint8)
    sizes = [int(float(s) * MiB) for s in args.buckets.split(",")]
    # (label, bucket bytes, direct threshold): the default (tensors >= min(bucket, 1 MiB) go as themselves,
    # zero-copy) and, to show what packing costs, "packed" = every tensor copied into buckets.
    configs = [(_label(s), s, None) for s in sizes] + [(_label(s) + "-packed", s, s) for s in sizes if s >= MiB]

    def timed(fn) -> float:
        comms.barrier(ranks=group.ranks, what="bench barrier")
        start = time.perf_counter()
        fn()
        comms.barrier(ranks=group.ranks, what="bench barrier")
        return time.perf_counter() - start

    def flat_once() -> None:
        group.wait(group.broadcast(flat), "flat broadcast")

    def bucketed_once(size: int, direct: int | None) -> None:
        if group.is_source:
            send_weights(group, named, 1, size, direct_bytes=direct)
        else:
            # What an engine sees: (name, tensor) views, one bucket at a time (loading them is the engine's cost).
            got = sum(1 for _ in recv_weights_stream(group))
            assert got == args.expect

    args.expect = comms.bcast(len(named), group.source, group.ranks)
    flat_once()  # warm-up: connections, buffers
    for _, size, direct in configs:
        bucketed_once(size, direct)
    # Each bucketed run is paired with a flat run just before it: on a shared machine the load drifts, and the
    # per-pair ratio cancels the drift. Reported: the median over repetitions of the per-pair ratios.
    times: dict[str, list[float]] = {label: [] for label, _, _ in configs}
    flats: dict[str, list[float]] = {label: [] for label, _, _ in configs}
    for rep in range(args.reps):
        for label, size, direct in configs[rep % len(configs):] + configs[:rep % len(configs)]:  # no order bias
            flats[label].append(timed(flat_once))
            times[label].append(timed(lambda size=size, direct=direct: bucketed_once(size, direct)))
    if comms.rank == group.source:
        all_flat = [t for v in flats.values() for t in v]
        flat_med = statistics.median(all_flat)
        rows = []
        for key, size, direct in configs:
            _, buckets = plan_buckets(named, size, direct)
            ratio = statistics.median(f / t for f, t in zip(flats[key], times[key], strict=True))
            med = statistics.median(times[key])
            rows.append({"bucket": key, "buckets": len(buckets), "seconds": round(med, 4),
                         "GB_per_s": round(total / med / 1e9, 3), "ratio_vs_flat": round(ratio, 3),
                         "best_ratio": round(min(flats[key]) / min(times[key]), 3)})
        print(f"weight sync, gloo, 1 source -> 2 rollout ranks: {len(named)} tensors, {total / 1e6:.1f} MB, "
              f"{args.reps} paired repetitions, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(f"  flat single tensor: {flat_med:.4f} s ({total / flat_med / 1e9:.3f} GB/s), median")
        for row in rows:
            print(f"  bucketed {row['bucket']:>13}: {row['seconds']:.4f} s ({row['GB_per_s']:.3f} GB/s) "
                  f"{row['buckets']:3d} bucket(s)  ratio {row['ratio_vs_flat']:.3f} (best-of {row['best_ratio']:.3f})")
        default = next((r for r in rows if r["bucket"] == "512MiB"), rows[0])
        print(json.dumps({"bench": "weight_sync", "backend": "gloo", "receivers": 2, "tensors": len(named),
                          "mbytes": round(total / 1e6, 1), "flat_s": round(flat_med, 4), "sweep": rows,
                          "ratio": default["ratio_vs_flat"], "best_ratio": default["best_ratio"],
                          "ratio_bucket": default["bucket"], "goal": 0.9,
                          "loadavg": round(os.getloadavg()[0], 1)}), flush=True)
    comms.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=5, help="5 layers = ~208 MB")
    parser.add_argument("--buckets", default="0.25,16,512", help="bucket sizes (MiB) to sweep")
    args = parser.parse_args()
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMIX_RANK" in os.environ:
        worker(args)
        return
    mpirun = Path(sys.executable).with_name("mpirun")
    cmd = [str(mpirun) if mpirun.exists() else (shutil.which("mpirun") or "mpirun"), "-np", "3", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["-x", "OMP_NUM_THREADS=1", sys.executable, __file__, *sys.argv[1:]]
    sys.exit(subprocess.call(cmd))


if __name__ == "__main__":
    main()

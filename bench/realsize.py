"""A published model's shape end to end (issue 33 item 1): a random model with Qwen2.5-0.5B's shape (hidden 896, 24
layers, 14/2 heads, MLP 4864, vocabulary 151,936, tied embeddings: ~494M parameters; built in code, no download; the
char tokenizer of the ``task:reverse`` data, made locally) runs GRPO steps through ``milehpc run --site local`` with
(a) the reference engine + the torch trainer and (b) the real SGLang CPU engine + the Megatron trainer.

Per pair it prints, from the run's own metrics (medians over the steps after the first, which warms up):

* generation tokens/s (the engine's ``perf/gen_tokens_per_s``); logprob tokens/s (the trainer's no-grad pass before
  the update: ``trainer.mini_batch_size`` makes two optimizer steps per batch, so PPO's old log-probs are computed,
  ``time/train_prepare``) and training tokens/s (forward, backward and optimizer over the rest of the step);
* weight sync: the bytes on the wire, GB/s of the whole sync (``time/sync``: the export's gathers and conversions
  are streamed into it) against a flat gloo broadcast of the same bytes between two processes timed here, 3 times
  just before and 3 times just after the run (the median: the load drifts; goal >= 0.9), and the export's share
  (``time/sync_export``);
* checkpoint write and read GB/s: the run's last checkpoint read back and written again here (rank files with
  ``torch.load`` and milehpc's durable writer, Megatron's dist-checkpoint shards as bytes with an fsync; read from the
  page cache, so the read figure is an upper bound);
* each rank's peak memory (PSS of the rank and its child processes, sampled every 0.2 s) against ``milehpc plan``'s
  estimate. The estimate counts what the model and the batch take (parameters, gradients, optimizer, activations,
  engine weights and KV), not the interpreter and libraries, so both sides are taken relative to a run of the same
  pair with a model of a few thousand parameters (the baseline): measured = peak - baseline peak, estimated =
  estimate - baseline estimate (goal: within +-20%).

Last line: one JSON object. A full-size pair takes ~10 GB and minutes per step on 2 cores: ``--layers 2`` (or 4) for
quick runs; ``--pairs`` picks the pairs.

    .venv/bin/python bench/realsize.py [--layers 24] [--steps 3] [--pairs reference+torch,sglang+megatron]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
QWEN25_05B = {"arch": "qwen2", "hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
              "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
# The baseline: the same pair with a model of a few thousand parameters (the interpreter, torch, the engine).
BASELINE = {"arch": "qwen2", "hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
            "intermediate_size": 16, "tie_word_embeddings": True}
PAIRS = {"reference+torch": ("reference", "torch"), "sglang+megatron": ("sglang", "megatron")}
GB = 1e9


def job_toml(pair: str, model: dict[str, Any], args: argparse.Namespace) -> str:
    engine, backend = PAIRS[pair]
    samples = args.prompts * args.samples
    lines = ['name = "realsize"', "[model]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in model.items()]
    lines += ["[data]", 'source = "task:reverse"', "params = { min_len = 4, max_len = 8 }",
              "[rollout]", f'engine = "{engine}"', f"prompts_per_step = {args.prompts}",
              f"n_samples = {args.samples}", f"max_new_tokens = {args.max_new_tokens}"]
    options = [f"weight_bucket_mb = {args.bucket_mb}"] if args.bucket_mb else []
    if engine == "sglang":
        options.append(f"cpu_memory_gib = {engine_gib(model):g}")
    if options:
        lines.append(f"options = {{ {', '.join(options)} }}")
    lines += ["[trainer]", f'backend = "{backend}"', f"micro_batch_size = {samples}",
              f"mini_batch_size = {samples // 2}", "lr = 1e-6",
              "[run]", f"steps = {args.steps}", "dump_rollouts = false"]
    return "\n".join(lines) + "\n"


def params(model: dict[str, Any]) -> int:
    """Parameters of a qwen2 model of this table (tied embeddings), for the SGLang engine's budget."""
    h, f, L = model["hidden_size"], model["intermediate_size"], model["num_layers"]
    kv = model["num_kv_heads"] * h // model["num_heads"]
    layer = h * h * 2 + 2 * h * kv + h + 2 * kv + 3 * h * f + 2 * h
    return model.get("vocab_size", 64) * h + L * layer + h


def engine_gib(model: dict[str, Any]) -> float:
    """SGLang's CPU budget: its static share (0.5) must hold the fp32 weights and the KV pool (4096 tokens)."""
    return max(1.0, math.ceil((2.2 * params(model) * 4 / (1 << 30) + 0.3) * 4) / 4)


# ---- peak memory of each rank ------------------------------------------------------------------------------------
def _pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rank_of(pid: int, cache: dict[int, int | None]) -> int | None:
    if pid not in cache:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            got = [e.split(b"=", 1)[1] for e in env if e.startswith(b"OMPI_COMM_WORLD_RANK=")]
            cache[pid] = int(got[0]) if got else None
        except (OSError, ValueError):
            cache[pid] = None
    return cache[pid]


class PeakSampler(threading.Thread):
    """Every 0.2 s: the PSS of each MPI rank's process tree (an SGLang engine's scheduler is a child of its rank), the
    peak per rank."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.peaks, self.done = root, {}, threading.Event()
        self.cache: dict[int, int | None] = {}

    def run(self) -> None:
        import psutil

        while not self.done.is_set():
            try:
                procs = psutil.Process(self.root).children(recursive=True)
            except psutil.Error:
                break
            now: dict[int, int] = {}
            for p in procs:
                rank = _rank_of(p.pid, self.cache)
                if rank is not None:
                    now[rank] = now.get(rank, 0) + _pss(p.pid)
            for rank, b in now.items():
                self.peaks[rank] = max(self.peaks.get(rank, 0), b)
            self.done.wait(0.2)


def run_job(work: Path, label: str, text: str) -> tuple[list[dict[str, Any]], dict[int, int], Path]:
    job = work / f"{label}.toml"
    job.write_text(text)
    rdir = work / f"run-{label}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILEHPC_PROGRESS": "plain"}
    milehpc = Path(sys.executable).with_name("milehpc")
    proc = subprocess.Popen([str(milehpc), "run", str(job), "--site", "local", "--run-dir", str(rdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    sampler = PeakSampler(proc.pid)
    sampler.start()
    out, _ = proc.communicate()
    sampler.done.set()
    sampler.join()
    if proc.returncode:
        sys.exit(f"{label} run failed (exit {proc.returncode}):\n{out[-4000:]}")
    recs = [json.loads(line) for line in (rdir / "metrics.jsonl").read_text().splitlines()]
    return recs, sampler.peaks, rdir


def plan_estimate(work: Path, label: str) -> dict[str, int]:
    """``milehpc plan``'s total per role (trainer, rollout), bytes."""
    milehpc = Path(sys.executable).with_name("milehpc")
    out = subprocess.run([str(milehpc), "plan", str(work / f"{label}.toml"), "--site", "local", "--json"],
                         capture_output=True, text=True, check=True).stdout
    return {row["rank"]: row["bytes"] for row in json.loads(out)["memory"] if row["item"] == "total"}


# ---- side measurements --------------------------------------------------------------------------------------------
def _flat_worker(rank: int, store: str, orders: Any, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    while (order := orders.get()) is not None:
        nbytes, reps = order
        buf = torch.zeros(nbytes, dtype=torch.uint8)  # (freed between orders: nothing held during the run)
        times = []
        for _ in range(reps + 1):  # the first one warms the connection and the pages up
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(buf, 0)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        del buf
        if rank == 0:
            out.put(times[1:])
    dist.destroy_process_group()


class FlatBroadcast:
    """The sync's yardstick: flat gloo broadcasts of one byte tensor between two processes, into a buffer the
    receiver reuses (as the sync receives into the engine's parameters). The two processes start once and are asked
    again after the run (a second start cost ~6-10 s on the loaded CI machine)."""

    def __init__(self, work: Path) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.orders = [ctx.Queue(), ctx.Queue()]
        store = work / f"flat-{time.time_ns()}"
        self.procs = [ctx.Process(target=_flat_worker, args=(r, str(store), self.orders[r], self.out))
                      for r in range(2)]
        for p in self.procs:
            p.start()

    def seconds(self, nbytes: int, reps: int = 3) -> list[float]:
        """Seconds of each of ``reps`` broadcasts of ``nbytes``."""
        for q in self.orders:
            q.put((nbytes, reps))
        return self.out.get(timeout=1800)

    def close(self) -> None:
        for q in self.orders:
            q.put(None)
        for p in self.procs:
            p.join()


def checkpoint_rates(rdir: Path, work: Path) -> dict[str, float]:
    """The run's last checkpoint read back and written again, timed here: a rank file (``.pt``) with ``torch.load``
    (as a resume does) and milehpc's durable writer (fsynced); Megatron's dist-checkpoint shards (``.distcp``, torch
    DCP's own format) as bytes, written with an fsync. Just written by the run, the files are read from the page
    cache: the read figure is an upper bound."""
    import torch

    from milehpc.checkpoint.files import fsync_path, torch_save_durable

    ckpts = rdir / "checkpoints"
    steps = sorted(p for p in ckpts.glob("step-*") if p.is_dir())
    shards = sorted(ckpts.glob("megatron/*"))
    files = sorted(steps[-1].glob("*.pt")) + (sorted(shards[-1].glob("*.distcp")) if shards else [])
    nbytes = sum(f.stat().st_size for f in files)
    read = write = 0.0
    copy = work / "ckpt-copy"
    for f in files:
        t0 = time.perf_counter()
        obj = torch.load(f, map_location="cpu", weights_only=False) if f.suffix == ".pt" else f.read_bytes()
        read += time.perf_counter() - t0
        t0 = time.perf_counter()
        if isinstance(obj, bytes):
            copy.write_bytes(obj)
            fsync_path(copy)
        else:
            torch_save_durable(obj, copy)
        write += time.perf_counter() - t0
        copy.unlink()
        del obj
    return {"ckpt_bytes": nbytes, "ckpt_write_gbps": nbytes / write / GB if write else 0.0,
            "ckpt_read_gbps": nbytes / read / GB if read else 0.0}


def _median(recs: list[dict[str, Any]], key: str) -> float | None:
    """Over the steps after the first (which warms up), or the first alone when only it has ``key`` (two steps:
    one sync)."""
    vals = [r[key] for r in recs[1:] if key in r] or [r[key] for r in recs[:1] if key in r]
    return statistics.median(vals) if vals else None


def sync_bytes(work: Path, label: str) -> int:
    """The bytes one sync sends (the exported tensors; tests/test_sync_cost.py checks them against the export)."""
    from milehpc.config.load import load_job
    from milehpc.weights import cost

    return sum(t.nbytes for t in cost.job_tensors(load_job(work / f"{label}.toml")))


def measure(pair: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    d = args.width_div
    model = {**QWEN25_05B, "num_layers": args.layers, "hidden_size": QWEN25_05B["hidden_size"] // d,
             "intermediate_size": QWEN25_05B["intermediate_size"] // d, "vocab_size": QWEN25_05B["vocab_size"] // d}
    text = job_toml(pair, model, args)
    (work / f"{pair}.toml").write_text(text)
    nbytes = sync_bytes(work, pair)
    # The yardstick just before and just after the run (the machine's load drifts; the median of both).
    flat = FlatBroadcast(work)
    try:
        flat_before = flat.seconds(nbytes)
        recs, peaks, rdir = run_job(work, pair, text)
        flat_after = flat.seconds(nbytes)
    finally:
        flat.close()
    flat_s = statistics.median(flat_before + flat_after)
    _, base_peaks, _ = run_job(work, pair + "-baseline", job_toml(pair, BASELINE, args))
    est, base_est = plan_estimate(work, pair), plan_estimate(work, pair + "-baseline")
    steady = recs
    tokens = _median(steady, "train/tokens") or 0.0
    prepare = _median(steady, "time/train_prepare") or 0.0
    compute = _median(steady, "time/train_compute") or 0.0
    sync_s, export_s = _median(steady, "time/sync"), _median(steady, "time/sync_export")
    out: dict[str, Any] = {
        "pair": pair, "layers": args.layers, "width_div": d, "params": params(model), "steps": len(recs),
        "gen_tokens_per_s": _median(steady, "perf/gen_tokens_per_s"),
        "logprob_tokens_per_s": tokens / prepare if prepare else None,
        "train_tokens_per_s": tokens / (compute - prepare) if compute > prepare else None,
        "sync_bytes": nbytes, "sync_s": sync_s, "export_s": export_s, "flat_s": flat_s,
        "sync_gbps": nbytes / sync_s / GB if sync_s else None, "flat_gbps": nbytes / flat_s / GB,
        "sync_vs_flat": flat_s / sync_s if sync_s else None, "flat_runs_s": flat_before + flat_after,
        "sync_runs_s": [r["time/sync"] for r in recs if "time/sync" in r],
    }
    out.update(checkpoint_rates(rdir, work))
    ranks = {0: "trainer", 1: "rollout"}  # one trainer rank, one engine of one rank
    out["memory"] = {}
    for rank, role in ranks.items():
        measured = peaks.get(rank, 0) - base_peaks.get(rank, 0)
        estimated = est.get(role, 0) - base_est.get(role, 0)
        out["memory"][role] = {"peak": peaks.get(rank, 0), "baseline_peak": base_peaks.get(rank, 0),
                               "measured": measured, "estimated": estimated,
                               "ratio": measured / estimated if estimated else None}
    return out


def show(r: dict[str, Any]) -> None:
    def f(x: Any, fmt: str = ".1f") -> str:
        return "-" if x is None else format(x, fmt)

    print(f"{r['pair']}: {r['layers']} layers, {r['params'] / 1e6:.0f}M parameters, {r['steps']} steps")
    print(f"  generation {f(r['gen_tokens_per_s'])} tok/s, logprob {f(r['logprob_tokens_per_s'])} tok/s, "
          f"training {f(r['train_tokens_per_s'])} tok/s")
    print(f"  weight sync {r['sync_bytes'] / GB:.3f} GB in {f(r['sync_s'], '.3f')} s ({f(r['sync_gbps'], '.3f')} GB/s; "
          f"export {f(r['export_s'], '.3f')} s of it) vs flat broadcast {r['flat_s']:.3f} s "
          f"({r['flat_gbps']:.3f} GB/s): {f(r['sync_vs_flat'], '.2f')} of flat (goal >= 0.9)")
    print(f"  checkpoint {r['ckpt_bytes'] / GB:.3f} GB: write {r['ckpt_write_gbps']:.3f} GB/s, "
          f"read {r['ckpt_read_gbps']:.3f} GB/s")
    for role, m in r["memory"].items():
        print(f"  {role}: peak {m['peak'] / GB:.2f} GB (baseline {m['baseline_peak'] / GB:.2f}): model and batch "
              f"{m['measured'] / GB:.3f} GB measured vs {m['estimated'] / GB:.3f} GB estimated "
              f"({f(m['ratio'], '.2f')}, goal 0.8-1.2)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="fewer layers for quick runs (the shape's other sizes kept)")
    ap.add_argument("--width-div", type=int, default=1,
                    help="divide the hidden size, MLP and vocabulary by this (heads kept): the smallest configuration "
                         "(tests/test_realsize_bench.py) runs --layers 1 --width-div 4")
    ap.add_argument("--bucket-mb", type=int, default=0,
                    help="rollout.options.weight_bucket_mb (0: the default, 512): several buckets at a small shape")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, of {', '.join(PAIRS)}")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="milehpc-realsize-") as tmp:
        for pair in args.pairs.split(","):
            if pair not in PAIRS:
                sys.exit(f"--pairs: expected names from {', '.join(PAIRS)}, got {pair!r}")
            results.append(measure(pair, args, Path(tmp)))
            show(results[-1])
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(json.dumps({"load": os.getloadavg()[0], "results": results}))


if __name__ == "__main__":
    main()

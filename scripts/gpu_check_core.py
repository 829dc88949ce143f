"""GPU check of milehpc's core path (no SGLang): what a bare GPU machine with carried megatron-core and
torch_memory_saver wheels can run, in one process on one GPU, in well under 8 minutes.

Run by ``bash scripts/gpu-check.sh core``. Parts, each with its figures in the JSON (``--out``; also the last line
of stdout):

1. ``colocated`` — the torch trainer and the reference engine on the same GPU, driven by
   :class:`milehpc.runtime.offload.ColocatedStep` (Miles' order) with the real ``torch_memory_saver``: the trainer
   is built inside its pausable region, paused after training (GPU memory freed, measured), the engine's weights
   updated in place from the trainer's snapshot, the trainer resumed for the next step. A GRPO loop of ``--steps``
   steps; after every update the engine's logprobs of fresh samples must match the trainer's recomputation.
2. ``ipc`` — the trainer's weights handed to another process as CUDA-IPC handles (what colocated SGLang's
   ``update_weights_from_tensor`` receives): the child opens each handle, checksums it; bytes and GB/s.
3. ``megatron`` — the Megatron trainer (local layer spec, bf16 in ``Float16Module``) on CUDA: training steps (step
   time, tokens/s), and the packed (THD-layout) micro-batches agreeing with the padded layout.

Exit 0 when every check passes, 1 when one fails, 2 when there is no GPU or a needed package is missing.
``--device cpu`` runs the same logic on the CPU with CUDA-IPC skipped, for the script's own test
(tests/test_gpu_check_core_script.py), which puts the real torch_memory_saver over a faked CUDA binding on the path
(tests/standin_gpu_stack/): there, as on a GPU, the trainer's tensors are unusable between pause and resume.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NEEDS_GPU = "gpu-check core: needs a CUDA GPU (torch.cuda.is_available() is False on this machine)"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu-check-core.json"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--small", action="store_true", help="a tiny model (the script's CPU test)")
    p.add_argument("--device", default="cuda", help="cuda (the check); cpu only for the script's own test")
    return p.parse_args()


def model_table(small: bool) -> dict[str, Any]:
    if small:
        return {"arch": "qwen2", "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                "intermediate_size": 128}
    # ~0.2B parameters: large enough for meaningful GB/s and memory figures, small enough for minutes.
    return {"arch": "qwen2", "hidden_size": 1024, "num_layers": 12, "num_heads": 16, "num_kv_heads": 4,
            "intermediate_size": 2816, "max_position_embeddings": 2048}


def job_spec(args: argparse.Namespace, backend: str, **trainer: Any) -> Any:
    from milehpc.config.load import job_from_dict

    return job_from_dict({
        "name": f"gpu-check-core-{backend}", "model": model_table(args.small),
        "rollout": {"n_samples": args.n, "prompts_per_step": args.prompts, "max_new_tokens": args.max_new_tokens,
                    "temperature": 1.0},
        "trainer": {"backend": backend, "lr": 1e-5, "micro_batch_size": 16, **trainer},
        "run": {"steps": args.steps, "seed": 0}}, file="gpu-check-core")


def score(samples: list[Any]) -> None:
    """Fraction of even token ids: cheap and varied within a group, so GRPO has advantages."""
    for s in samples:
        s.reward = sum(1 for t in s.response_ids if t % 2 == 0) / max(len(s.response_ids), 1)


def _diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max((abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)), default=0.0)


def check_colocated(args: argparse.Namespace, device: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Torch trainer + reference engine on one GPU, colocated, GRPO steps with the logprob check."""
    import dataclasses

    import torch

    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import build_model
    from milehpc.rollout.reference import ReferenceEngine, sampling_from_spec
    from milehpc.runtime.offload import ColocatedStep, gpu_used_bytes, torch_memory_saver_backend
    from milehpc.train.torch_trainer import TorchTrainer

    job = job_spec(args, "torch")
    tok = build_tokenizer(job.model.tokenizer)
    # On the CPU (the script's test) the same package with its CUDA binding faked: a paused tensor is unusable there
    # too (tests/standin_gpu_stack), so reading the trainer between pause and resume fails on both.
    saver = torch_memory_saver_backend()
    engine = ReferenceEngine(build_model(job.model, tok.vocab_size, seed=0, pad_id=tok.pad_id, eos_id=tok.eos_id),
                             tok, device=device, seed=1)
    step = ColocatedStep(engine, None, saver, device=device)
    with step.train_region():
        trainer = TorchTrainer(job, tok, device=device)
    step.trainer = trainer
    sampling = sampling_from_spec(job.rollout, tok)
    g = torch.Generator().manual_seed(0)
    res: dict[str, Any] = {"steps": [], "params": sum(p.numel() for p in trainer.module.parameters())}
    for i in range(args.steps):
        prompts = [torch.randint(3, tok.vocab_size, (8,), generator=g).tolist() for _ in range(args.prompts)]
        t0 = time.perf_counter()

        def produce(prompts: list[list[int]] = prompts) -> list[Any]:
            samples = engine.generate(prompts, sampling)  # n per prompt, with the engine's logprobs
            for k, s in enumerate(samples):
                s.index = k
            return samples

        samples = step.generate_phase(produce)
        gen_s = time.perf_counter() - t0
        tokens = sum(len(s.response_ids) for s in samples)
        score(samples)
        metrics = step.train_phase(lambda samples=samples, i=i: trainer.train_step(samples, i))
        # After the update the engine holds the trainer's new weights: fresh samples agree token by token.
        fresh = engine.generate(prompts[:4], dataclasses.replace(sampling, n=1))
        # train_phase ended with the trainer paused (its memory unmapped): resume before reading it, as
        # scripts/gpu_check.py does; the next train_phase finds it resident and pauses it again.
        step.onload_train()
        diff = _diff(trainer.compute_logprobs(fresh), [s.rollout_logprobs for s in fresh])
        res["steps"].append({
            "step": i, "gen_tokens_per_s": tokens / gen_s, "train_s": metrics.get("time/colocate_train", 0.0),
            "update_gbps": metrics.get("colocate/update_gbps", 0.0),
            "update_gb": metrics.get("colocate/update_gb", 0.0),
            "freed_train_gb": metrics.get("colocate/freed_train_gb", 0.0),
            "logprob_diff_in_step": metrics.get("train/logprob_diff_max"),
            "logprob_diff_after_update": diff, "engine_version": engine.weight_version(),
            "trainer_version": trainer.version})
    res["gpu_used_gb_end"] = gpu_used_bytes() / 1e9
    last = res["steps"][-1]
    tol = 2e-2 if next(trainer.module.parameters()).dtype == torch.bfloat16 else 1e-4
    out["checks"]["colocated_versions_agree"] = last["engine_version"] == last["trainer_version"]
    out["checks"]["colocated_logprobs_agree"] = all(s["logprob_diff_after_update"] <= tol for s in res["steps"])
    if device.type == "cuda":
        out["checks"]["memory_saver_frees_trainer_memory"] = all(s["freed_train_gb"] > 0 for s in res["steps"])
    step.onload_train()  # resident already (the loop's last check resumed it); the export reads the trainer
    res["_named"] = [(n, t) for n, t in trainer.export_weights()]  # for the IPC part (dropped from the JSON)
    return res


def _ipc_child(queue: Any, done: Any) -> None:
    import torch

    total, nbytes = 0.0, 0
    while (item := queue.get()) is not None:
        _name, t = item  # a CUDA tensor rebuilt from its IPC handle
        nbytes += t.numel() * t.element_size()
        total += float(t.float().sum())
        del t
    torch.cuda.synchronize()
    done.put((nbytes, total))


def check_ipc(named: list[tuple[str, Any]], device: Any, out: dict[str, Any]) -> dict[str, Any]:
    """The weights as CUDA-IPC handles to another process (spawned), checksummed there."""
    if device.type != "cuda":
        return {"skipped": "cpu"}
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(queue, done))
    child.start()
    from milehpc.weights.inplace import HostSnapshot

    # What the colocated loop shares: the host snapshot uploaded into fresh memory. The trainer's own tensors live in
    # torch_memory_saver's region (cuMemCreate mappings), which legacy CUDA IPC cannot export ("invalid argument").
    snap = HostSnapshot()
    snap.take(named)
    on_gpu = list(snap.upload(device))
    torch.cuda.synchronize()
    want = sum(float(t.float().sum()) for _, t in on_gpu)
    t0 = time.perf_counter()
    for item in on_gpu:
        queue.put(item)
    queue.put(None)
    nbytes, got = done.get(timeout=120)
    secs = time.perf_counter() - t0
    child.join(timeout=30)
    out["checks"]["ipc_weights_identical"] = abs(got - want) <= 1e-3 * max(1.0, abs(want))
    return {"bytes": nbytes, "seconds": secs, "gbps": nbytes / secs / 1e9, "tensors": len(on_gpu)}


def check_megatron(args: argparse.Namespace, device: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Megatron (local spec, bf16 in Float16Module) training steps; packed vs padded micro-batches."""
    import torch

    from milehpc.samples import Sample
    from milehpc.train.megatron.trainer import MegatronTrainer

    # The local spec on the GPU too (no transformer-engine wheel fits the carried 64 MiB).
    job = job_spec(args, "megatron", precision="bf16", options={"transformer_engine": False})
    vocab = 4096 if args.small else 32000
    tr = MegatronTrainer(job, pad_id=0, vocab_size=vocab)
    g = torch.Generator().manual_seed(3)
    samples = [Sample(prompt_ids=torch.randint(3, vocab, (int(torch.randint(8, 64, (1,), generator=g)),),
                                               generator=g).tolist(),
                      response_ids=torch.randint(3, vocab, (int(torch.randint(16, 128, (1,), generator=g)),),
                                                 generator=g).tolist(),
                      reward=float(k % 2), group=k // 4, index=k) for k in range(32)]
    times, losses, step_peaks = [], [], []
    for i in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        m = tr.train_step(samples, i)
        if device.type == "cuda":
            torch.cuda.synchronize()
            step_peaks.append(torch.cuda.max_memory_allocated() - base)
        times.append(time.perf_counter() - t0)
        losses.append(m.get("train/loss", 0.0))
    recompute = _recompute_step(args, device, vocab, samples)
    recompute["plain_step_peak_bytes"] = step_peaks[0] if step_peaks else 0
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    padded = tr.compute_logprobs(samples)
    tr.packed, tr.thd = True, False  # packed rows, block-diagonal mask (the local spec reads masks)
    packed = tr.compute_logprobs(samples)
    tr.packed = False
    diff = _diff(padded, packed)
    out["checks"]["megatron_float16module"] = type(tr.ddp.module).__name__ == "Float16Module"
    out["checks"]["megatron_on_device"] = next(tr.module.parameters()).device.type == device.type
    out["checks"]["megatron_packed_matches_padded"] = diff < 5e-2  # bf16 rounding differs by layout
    out["checks"]["megatron_steps_finite"] = all(abs(x) < 1e6 for x in losses)
    # Issue 33: full recomputation (Megatron's CheckpointFunction with the CUDA RNG tracker) gives the first step's
    # loss of the plain trainer (the same forward) and, on a GPU, a first step whose memory above what was allocated
    # before it (activations, gradients, Adam's new state) is lower than the plain trainer's first step's.
    out["checks"]["megatron_recompute_same_loss"] = abs(recompute["loss"] - losses[0]) <= 1e-6 * (1 + abs(losses[0]))
    if device.type == "cuda":
        out["checks"]["megatron_recompute_lowers_peak"] = (recompute["step_peak_bytes"]
                                                           < recompute["plain_step_peak_bytes"])
    warm = times[1:] or times  # the first step compiles and allocates; with one step it is all there is
    return {"step_s": times, "tokens_per_s": tokens / (sum(warm) / len(warm)),
            "packed_vs_padded_logprob_diff": diff, "params": sum(p.numel() for p in tr.module.parameters()),
            "recompute": recompute}


def _recompute_step(args: argparse.Namespace, device: Any, vocab: int, samples: list[Any]) -> dict[str, Any]:
    """The first step of a fresh trainer with ``trainer.recompute = "full"``: its loss and (CUDA) its peak memory
    above what was allocated before it."""
    import torch

    from milehpc.train.megatron.trainer import MegatronTrainer

    cuda = device.type == "cuda"
    job = job_spec(args, "megatron", precision="bf16", recompute="full", options={"transformer_engine": False})
    rc = MegatronTrainer(job, pad_id=0, vocab_size=vocab)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    loss = rc.train_step(samples, 0).get("train/loss", 0.0)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    del rc
    return {"loss": loss, "step_peak_bytes": peak}


def main() -> int:
    args = parse()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(NEEDS_GPU, file=sys.stderr)
        return 2
    if args.device == "cuda":
        import importlib.util

        # Exactly what the check needs beyond torch (README "GPU checks"; each brings its own dependencies).
        missing = [m for m in ("megatron", "torch_memory_saver", "transformers", "pluggy")
                   if importlib.util.find_spec(m) is None]
        if missing:
            print(f"gpu-check core: {', '.join(missing)} not importable (carry the wheels in .whl/; see "
                  "scripts/gpu-check.sh)", file=sys.stderr)
            return 2
    import socket

    import torch.distributed as dist
    from gpu_check import ensure_builtin_plugins  # scripts/ is this script's sys.path[0]

    ensure_builtin_plugins()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    t_start = time.perf_counter()
    out: dict[str, Any] = {"ok": False, "checks": {}, "device": torch.cuda.get_device_name(device)
                           if device.type == "cuda" else "cpu", "torch": torch.__version__}
    try:
        colocated = check_colocated(args, device, out)
        named = colocated.pop("_named")
        out["colocated"] = colocated
        out["ipc"] = check_ipc(named, device, out)
        del named
        out["megatron"] = check_megatron(args, device, out)
    except Exception as err:  # the JSON still says how far it got
        import traceback

        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc()[-4000:]
    out["seconds"] = time.perf_counter() - t_start
    out["ok"] = "error" not in out and all(out["checks"].values())
    steps = out.get("colocated", {}).get("steps", [])
    out["figures"] = {
        "update_gbps": max((s["update_gbps"] for s in steps), default=0.0),
        "ipc_gbps": out.get("ipc", {}).get("gbps", 0.0),
        "freed_train_gb": max((s["freed_train_gb"] for s in steps), default=0.0),
        "gen_tokens_per_s": max((s["gen_tokens_per_s"] for s in steps), default=0.0),
        "megatron_step_s": min(out.get("megatron", {}).get("step_s", [0.0]) or [0.0]),
        "megatron_tokens_per_s": out.get("megatron", {}).get("tokens_per_s", 0.0)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({"ok": out["ok"], "checks": out["checks"], "figures": out["figures"],
                      **({"error": out["error"]} if "error" in out else {})}))
    dist.destroy_process_group()
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    code = main()
    from milehpc.runtime.offload import end_process, saver_initialised

    if saver_initialised():  # the interpreter's teardown would end it with 1 (see end_process)
        end_process(code)
    sys.exit(code)

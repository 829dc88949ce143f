"""GPU check of the SGLang integration: a few colocated GRPO steps on one GPU, then figures to a JSON file.

Run by ``scripts/gpu-check.sh`` (which installs carried wheels first). What it does, in one process:

1. a randomly initialised Qwen2 model of Qwen2.5-0.5B's shape (~0.5B parameters, bf16) — the config is written to a
   temporary folder and SGLang loads it with ``load_format="dummy"``; the torch trainer builds the same architecture
   inside a torch_memory_saver region (tag ``train``, CPU backup);
2. one in-process SGLang engine (milehpc's :class:`SGLangEngine`, colocated: ``enable_memory_saver``), the trainer's
   initial weights pushed first (``update_weights_from_tensor``), then ``--steps`` GRPO steps in Miles' order
   (generate → offload rollout → train → offload train → onload weights → update weights → onload KV cache) with
   :class:`milehpc.runtime.offload.ColocatedStep`;
3. after the last update: the engine's weights read back by name equal the trainer's (bit-exact), and rollout
   logprobs of a fresh generation agree with the trainer's recomputation on the same tokens;
4. figures: colocated weight-update time and GB/s, GPU memory freed by torch_memory_saver (trainer) and by SGLang's
   release (rollout), generation tokens/s, step times — written to ``--out`` (JSON), last line of stdout too.

Exit code 0 when every check passes, 1 when a check fails, 2 when sglang / torch_memory_saver are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN2_05B = {"arch": "qwen2", "hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
             "intermediate_size": 4864, "max_position_embeddings": 4096, "vocab_size": 151936,
             "tie_word_embeddings": True, "dtype": "bfloat16"}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu-check.json"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--mem-fraction", type=float, default=0.35)
    p.add_argument("--disable-cuda-graph", action="store_true", help="faster start, slower decode")
    p.add_argument("--small", action="store_true", help="a 2-layer model (smoke test of the script itself)")
    p.add_argument("--device", default="cuda", help="cuda (the check); cpu only for the script's own CPU test")
    return p.parse_args()


def job_spec(args: argparse.Namespace):
    from milehpc.config.load import job_from_dict

    model = dict(QWEN2_05B)
    if args.small:
        model.update(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256,
                     vocab_size=4096)
    return job_from_dict({
        "name": "gpu-check", "model": model,
        "rollout": {"engine": "sglang", "n_samples": args.n, "prompts_per_step": args.prompts,
                    "max_new_tokens": args.max_new_tokens, "temperature": 1.0,
                    "options": {"mem_fraction_static": args.mem_fraction, "weight_bucket_mb": 512}},
        "trainer": {"backend": "torch", "precision": "bf16", "lr": 1e-6, "micro_batch_size": args.micro_batch},
        "resources": {"colocate": True}, "run": {"steps": args.steps, "seed": 0}}, file="gpu-check")


def ensure_builtin_plugins() -> None:
    """On a machine where milehpc is on PYTHONPATH but not pip-installed, its entry points are not visible:
    register the built-ins listed in pyproject.toml by hand (exactly what the entry points would load)."""
    import importlib

    from milehpc import plugins

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    pm = plugins.get_plugin_manager()
    if any(name.startswith("builtin-") for name, _ in pm.list_name_plugin()):
        return
    entries = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["milehpc"]
    for name, module in entries.items():
        if name.startswith("builtin-"):
            plugins.register(importlib.import_module(module), name=name)


def reward(samples) -> None:
    """Fraction of even token ids: cheap, varies within a group, so GRPO advantages are not all zero."""
    for s in samples:
        s.reward = sum(1 for t in s.response_ids if t % 2 == 0) / max(len(s.response_ids), 1)


def main() -> int:
    args = parse()
    out: dict = {"ok": False, "checks": {}}
    try:
        import sglang  # noqa: F401
        import torch_memory_saver  # noqa: F401
    except ImportError as err:
        print(f"gpu-check: {err.name} is not importable (carry its wheels in .whl/; see scripts/gpu-check.sh)",
              file=sys.stderr)
        return 2
    import torch

    from milehpc.config.precision import resolve_precision
    from milehpc.config.sglang_options import parse_options
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import causal_lm_class, hf_config
    from milehpc.rollout import sglang_mapping as sm
    from milehpc.rollout.engine import SamplingParams
    from milehpc.rollout.sglang_engine import CPU_SERVER_ARGS, SGLangEngine, cpu_colocated_args
    from milehpc.runtime.offload import ColocatedStep, gpu_used_bytes, torch_memory_saver_backend
    from milehpc.train.torch_trainer import TorchTrainer

    ensure_builtin_plugins()
    t_start = time.perf_counter()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    job = job_spec(args)
    tok = build_tokenizer("toy")
    out["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    out["torch"] = torch.__version__
    out["sglang"] = getattr(sys.modules["sglang"], "__version__", "?")

    # --- the engine (random weights, overwritten by the first update) ---
    folder = Path(tempfile.mkdtemp(prefix="milehpc-gpu-check-"))
    cfg = hf_config(job.model, tok.vocab_size, pad_id=tok.pad_id, eos_id=tok.eos_id)
    cfg.torch_dtype = "bfloat16"
    cfg.architectures = [causal_lm_class(job.model).__name__]  # SGLang picks its model class by this name
    (folder / "config.json").write_text(cfg.to_json_string())
    opts = parse_options(job.rollout.options)
    layout = sm.EngineLayout(engine=0, engine_rank=0, gpus_per_engine=1, dist_init_addr=None, port=31000)
    server_args = sm.server_args(job, opts, resolve_precision(job), layout, model_path=str(folder),
                                 tokenizer_path=None)
    server_args["load_format"] = "dummy"
    if args.disable_cuda_graph:
        server_args["disable_cuda_graph"] = True
    if device.type == "cpu":  # the script's logic against the real engine on a CPU: memory saving off, CPU settings
        server_args = cpu_colocated_args({**server_args, **CPU_SERVER_ARGS}, opts)
    out["server_args"] = {k: v for k, v in server_args.items() if isinstance(v, str | int | float | bool)}
    saver = torch_memory_saver_backend("torch")
    t0 = time.perf_counter()
    engine = SGLangEngine(job, server_args, opts, eos_id=tok.eos_id, colocated=True, version=-1)
    out["engine_start_s"] = time.perf_counter() - t0
    mem_after_engine = gpu_used_bytes()

    # --- the trainer, allocated inside the pausable region ---
    colo = ColocatedStep(engine, None, saver, device=device)
    t0 = time.perf_counter()
    with colo.train_region():
        colo.trainer = TorchTrainer(job, tok, device=device)
    out["trainer_build_s"] = time.perf_counter() - t0
    out["model_params"] = sum(p.numel() for p in colo.trainer.module.parameters())
    out["gpu_used_gb_both_resident"] = gpu_used_bytes() / 1e9

    colo.initial_sync(version=0)
    out["initial_sync"] = colo.report.metrics()
    out["tms_freed_train_gb"] = colo.report.freed_train_bytes / 1e9

    gen = torch.Generator().manual_seed(0)

    def prompts() -> list[list[int]]:
        return [torch.randint(3, tok.vocab_size, (int(torch.randint(16, 33, (1,), generator=gen)),),
                              generator=gen).tolist() for _ in range(args.prompts)]

    sp = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.n)
    steps = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        samples, metrics = colo.step(prompts(), sp, step, score=reward)
        new_tokens = sum(len(s.response_ids) for s in samples)
        rec = {"step": step, "step_s": time.perf_counter() - t0, "samples": len(samples),
               "gen_tokens": new_tokens, "gen_tokens_per_s": new_tokens / colo.report.times["generate"],
               "reward_mean": sum(s.scalar_reward for s in samples) / len(samples),
               "update_s": colo.report.times["update_weights"], "update_gbps": colo.report.update_gbps,
               "update_gb": colo.report.update_bytes / 1e9,
               "freed_rollout_gb": colo.report.freed_rollout_bytes / 1e9,
               "freed_train_gb": colo.report.freed_train_bytes / 1e9}
        rec.update({k: v for k, v in metrics.items() if k.startswith(("train/", "time/colocate_"))})
        steps.append(rec)
        print(json.dumps(rec), flush=True)
    out["steps"] = steps

    # --- agreement after the last update ---
    check = SamplingParams(temperature=1.0, max_new_tokens=64, n=2)
    samples = engine.generate(prompts()[:16], check)
    colo.onload_train()  # both sides resident for the comparison (0.5B: plenty of room)
    diffs = []
    for i in range(0, len(samples), args.micro_batch):
        chunk = samples[i:i + args.micro_batch]
        for s, lp in zip(chunk, colo.trainer.compute_logprobs(chunk), strict=True):
            diffs.extend(abs(a - b) for a, b in zip(s.rollout_logprobs, lp, strict=True))
    out["logprob_diff_mean"] = sum(diffs) / len(diffs)
    out["logprob_diff_max"] = max(diffs)
    trained = dict(colo.trainer.export_weights())
    # Names SGLang keeps unfused (q/k/v and gate/up are stacked into one parameter on its side).
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight",
             "model.layers.0.input_layernorm.weight", "model.norm.weight"]
    equal = {}
    for name in names:
        values = engine._engine.get_weights_by_name(name, truncate_size=100)
        if values is None:  # models without get_weights_by_name (Qwen2 in sglang 0.5.23): the logprob check covers it
            equal[name] = None
            continue
        got = torch.as_tensor(values).flatten()
        want = trained[name].flatten()[:got.numel()].float().cpu()
        equal[name] = bool(torch.equal(got.float(), want))
    out["weights_equal_after_update"] = equal

    # --- figures and verdict ---
    last = steps[-1]
    out.update({
        "colocated_weight_update_s": last["update_s"], "colocated_weight_update_gbps": last["update_gbps"],
        "colocated_weight_update_gb": last["update_gb"],
        "memory_freed_by_torch_memory_saver_gb": last["freed_train_gb"],
        "memory_freed_by_sglang_release_gb": last["freed_rollout_gb"],
        "generation_tokens_per_s": sum(s["gen_tokens_per_s"] for s in steps[1:] or steps) / len(steps[1:] or steps),
        "gpu_used_gb_after_engine_start": mem_after_engine / 1e9,
        "wall_s": time.perf_counter() - t_start,
    })
    out["checks"] = {
        "weights_equal": all(v is not False for v in equal.values()),  # None: not readable on this model
        # bf16 on both sides with different kernels: a small mean difference is expected, a large one is a bug.
        "logprobs_agree": out["logprob_diff_mean"] < 0.05,
        "torch_memory_saver_freed_memory": last["freed_train_gb"] > 0.5,
        "sglang_released_memory": last["freed_rollout_gb"] > 0.5,
        "versions_advance": engine.weight_version() == args.steps,
    }
    out["ok"] = all(out["checks"].values())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    engine.shutdown()
    print(json.dumps({k: v for k, v in out.items() if k not in ("steps", "server_args", "initial_sync")}))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

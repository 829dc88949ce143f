"""The reference engine's generation speed vs transformers' own ``model.generate``, side by side in one run.

Same model (the CPU demo's: examples/cpu-demo.toml's ``[model]`` table, seeded init), same batch (the demo's first
``prompts_per_step`` prompts x ``n_samples``, left-padded), same sampling (``[rollout]``: temperature, top-k/top-p,
``max_new_tokens``, stopping at EOS), same torch thread count. transformers generates the way TRL's GRPOTrainer
calls it without vLLM: every prompt repeated ``n_samples`` times, ``do_sample=True``, a dynamic KV cache.
The rounds alternate (engine, generate, engine, ...) so the machine's load drifts over both alike; medians over the
rounds. Tokens are the generated ones up to and including each row's first EOS (what either tool hands on).

Per-phase split of each tool's round: the model's forward calls (the first one of a round is the prefill, the
rest are decode steps), timed by hooks on the model, and everything else (sampling, logprobs, stop checks, Python
per token) as the remainder. Wall time (the headline) and the process's CPU time (less sensitive to other load
with one thread: a busy machine slows the wall clock of both tools, a single-threaded run's CPU time much less;
with more threads it counts their spinning too).

``--baseline FILE``: also run the engine class of another ``reference.py`` (e.g.
``git show HEAD~1:milehpc/rollout/reference.py > /tmp/old.py``) in the same rounds, for a before/after ratio.
The last line is one JSON object: ``ratio`` = engine tokens/s / generate tokens/s (wall), with the figures.

    .venv/bin/python bench/engine_speed.py [--rounds 20] [--threads 1] [--config examples/cpu-demo.toml]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class PhaseClock:
    """Wall and CPU seconds inside the model's forward calls (prefill = a round's first call, then decode), by
    forward hooks on the top-level model."""

    def __init__(self, model: Any) -> None:
        self.calls = 0
        self.spent = {k: [0.0, 0.0] for k in ("prefill", "decode")}
        self._t0 = (0.0, 0.0)
        model.register_forward_pre_hook(self._before)
        model.register_forward_hook(self._after)

    def _before(self, *_: Any) -> None:
        self._t0 = (time.perf_counter(), time.process_time())

    def _after(self, *_: Any) -> None:
        phase = self.spent["prefill" if self.calls == 0 else "decode"]
        phase[0] += time.perf_counter() - self._t0[0]
        phase[1] += time.process_time() - self._t0[1]
        self.calls += 1

    def reset(self) -> None:
        self.calls = 0
        self.spent = {k: [0.0, 0.0] for k in self.spent}


def load_engine_class(path: Path) -> type:
    """``ReferenceEngine`` of another revision's ``reference.py`` (its milehpc imports resolve to this checkout)."""
    spec = importlib.util.spec_from_file_location(f"baseline_reference_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        sys.exit(f"engine_speed: expected a Python file for --baseline, got {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ReferenceEngine


def setup(config: Path) -> tuple[Any, Any, list[list[int]], Any]:
    """The demo's model, tokenizer, first step's prompts and sampling parameters."""
    from milehpc.config.load import load_job
    from milehpc.data.source import build_source
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import build_model
    from milehpc.rollout.reference import sampling_from_spec

    job = load_job(config, [])
    tok = build_tokenizer(job.model.tokenizer)
    model = build_model(job.model, tok.vocab_size, seed=job.run.seed, pad_id=tok.pad_id, eos_id=tok.eos_id).eval()
    prompts = [p.ids for p in build_source(job.data, tok).take(job.rollout.prompts_per_step)]
    return model, tok, prompts, sampling_from_spec(job.rollout, tok)


def hf_generate(model: Any, tok: Any, prompts: list[list[int]], sp: Any) -> Callable[[], int]:
    """A round of transformers' ``generate`` on the same batch; returns the tokens it generated."""
    import torch
    from transformers import GenerationConfig

    rows = [p for p in prompts for _ in range(sp.n)]
    L = max(map(len, rows))
    ids = torch.tensor([[tok.pad_id] * (L - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows])
    greedy = sp.temperature == 0
    # top_k 0 is off, as in the engine (None would take transformers' default of 50)
    cfg = GenerationConfig(do_sample=not greedy, temperature=None if greedy else sp.temperature,
                           top_k=sp.top_k, top_p=sp.top_p, max_new_tokens=sp.max_new_tokens,
                           pad_token_id=tok.pad_id, eos_token_id=tok.eos_id)

    def run() -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, L:]
        ended = out == tok.eos_id
        # up to and including the first EOS; the whole row when it has none
        first = torch.where(ended.any(-1), ended.int().argmax(-1) + 1, torch.tensor(out.shape[1]))
        return int(first.sum())

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=REPO / "examples" / "cpu-demo.toml")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: what a demo rank gets, OMP_NUM_THREADS=1)")
    ap.add_argument("--baseline", type=Path, help="another revision's milehpc/rollout/reference.py, also timed")
    args = ap.parse_args()

    import torch

    from milehpc.rollout.reference import ReferenceEngine

    torch.set_num_threads(args.threads)
    model, tok, prompts, sp = setup(args.config)
    clock = PhaseClock(model)
    tools: dict[str, Callable[[], int]] = {}

    def engine_round(cls: type) -> Callable[[], int]:
        eng = cls(model, tok, seed=0)
        return lambda: sum(len(s.response_ids) for s in eng.generate(prompts, sp))

    tools["engine"] = engine_round(ReferenceEngine)
    tools["hf_generate"] = hf_generate(model, tok, prompts, sp)
    if args.baseline:
        tools["baseline_engine"] = engine_round(load_engine_class(args.baseline))
    rec: dict[str, list[dict[str, float]]] = {k: [] for k in tools}
    for r in range(args.warmup + args.rounds):
        for name, run in tools.items():
            clock.reset()
            t, c = time.perf_counter(), time.process_time()
            n = run()
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            if r >= args.warmup:
                rec[name].append({"tokens": n, "wall": wall, "cpu": cpu, "forwards": clock.calls,
                                  **{f"{k}_{w}": v[i] for k, v in clock.spent.items() for i, w in enumerate(("wall", "cpu"))}})

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in rec[name])

    summary = {}
    print(f"batch {len(prompts)} prompts x {sp.n} samples, {sp.max_new_tokens} new tokens, temperature "
          f"{sp.temperature}, {args.threads} thread(s), {args.rounds} rounds; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    print(f"{'':<16}{'tok/s wall':>11}{'tok/s CPU':>11}{'tokens':>8}{'fwd':>5}   ms per round, wall/CPU:"
          f"{'prefill':>10}{'decode':>13}{'rest':>13}{'total':>13}")
    for name in tools:
        tok_s = statistics.median(x["tokens"] / x["wall"] for x in rec[name])
        tok_cpu = statistics.median(x["tokens"] / x["cpu"] for x in rec[name])
        ms = {k: (med(name, f"{k}_wall") * 1e3, med(name, f"{k}_cpu") * 1e3) for k in ("prefill", "decode")}
        rest = (statistics.median((x["wall"] - x["prefill_wall"] - x["decode_wall"]) for x in rec[name]) * 1e3,
                statistics.median((x["cpu"] - x["prefill_cpu"] - x["decode_cpu"]) for x in rec[name]) * 1e3)
        total = (med(name, "wall") * 1e3, med(name, "cpu") * 1e3)
        cells = "".join(f"{f'{a:.1f}/{b:.1f}':>13}" for a, b in (ms["prefill"], ms["decode"], rest, total))
        print(f"{name:<16}{tok_s:>11.0f}{tok_cpu:>11.0f}{med(name, 'tokens'):>8.0f}{med(name, 'forwards'):>5.0f}"
              f"{'':>23}{cells}")
        summary[name] = {"tok_s": tok_s, "tok_s_cpu": tok_cpu, "ms_prefill": ms["prefill"][0],
                         "ms_decode": ms["decode"][0], "ms_rest": rest[0], "ms_total": total[0]}
    result = {"ratio": summary["engine"]["tok_s"] / summary["hf_generate"]["tok_s"],
              "ratio_cpu": summary["engine"]["tok_s_cpu"] / summary["hf_generate"]["tok_s_cpu"],
              "engine_tok_s": summary["engine"]["tok_s"], "hf_generate_tok_s": summary["hf_generate"]["tok_s"]}
    if args.baseline:
        result["baseline_ratio"] = summary["baseline_engine"]["tok_s"] / summary["hf_generate"]["tok_s"]
        result["speedup_over_baseline"] = summary["engine"]["tok_s"] / summary["baseline_engine"]["tok_s"]
    result.update(threads=args.threads, rounds=args.rounds, load_average=os.getloadavg()[0], phases=summary)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

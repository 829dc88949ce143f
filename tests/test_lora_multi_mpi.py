"""Multi-LoRA under real mpirun (`milehpc run examples/multi-lora.toml --site local`, the README's command), 1 rollout
rank + 1 trainer rank: two adapters on one base, one on task:reverse and one on task:sort, each with its own prompts,
reward and optimizer (the warm-up is LoRA too: each adapter's SFT on its own task, then GRPO). Each adapter learns
its own task in the RL phase (its mean reward over the first 10 steps against the last 10, the run ending when both
reach the target), only the adapters travel (bytes per adapter); then `milehpc export --adapter` writes one peft
folder per adapter, `PeftModel.from_pretrained` on the base reproduces the reference engine's greedy output for that
adapter's prompts, and each adapter answers its own task better than the base and than the other adapter does
(greedy partial-credit reward on held-out prompts where the two tasks' answers differ)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from required import require_module
from test_loop_mpi import run_cli

pytestmark = [pytest.mark.mpi, pytest.mark.slow(minutes=1.5)]
require_module("peft")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "multi-lora.toml"  # the README's multi-LoRA job
WINDOW = 10  # steps averaged (as run.target_reward's window)
# The example's 0.8 takes ~317 RL steps; 0.55 ~139 (CI time), still far above where the warm-up leaves the
# adapters (rev ~0.28, srt ~0.36: a run whose RL or sync is broken stays there and never ends).
TARGET = 0.55


def _greedy(model, ids: list[int], eos: int, n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] == eos:
                break
    return out


def test_two_adapters_each_learn_their_task_and_export_as_peft_folders(tmp_path) -> None:
    from peft import PeftModel

    from milehpc.cli import cli
    from milehpc.config.load import run_job as load_run
    from milehpc.data.adapters import adapter_mix
    from milehpc.data.tasks import match_score
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import build_model
    from milehpc.rollout.engine import SamplingParams
    from milehpc.rollout.reference import build_engine
    from milehpc.train import lora

    records = run_cli(tmp_path, EXAMPLE, timeout=900, args=["--set", f"run.target_reward={TARGET}"])
    assert records[0]["dist/mpi_world_size"] == 2 and records[0]["dist/rollout_ranks"] == 1
    steps = len(records)
    assert [r["step"] for r in records] == list(range(steps)) and steps < 1500  # stopped at the target
    for r in records:
        assert r["adapter/rev/samples"] == r["adapter/srt/samples"] == 128  # 16 prompts x 8 each, every step
        assert r["sync/bytes"] == r["adapter/rev/sync_bytes"] + r["adapter/srt/sync_bytes"] > 0
        assert r["sync/bytes"] < r["sync/full_model_bytes"]
    assert all(math.isfinite(r[f"adapter/{n}/loss"]) for r in records for n in ("rev", "srt"))
    first = {n: sum(r[f"adapter/{n}/reward_mean"] for r in records[:WINDOW]) / WINDOW for n in ("rev", "srt")}
    last = {n: sum(r[f"adapter/{n}/reward_mean"] for r in records[-WINDOW:]) / WINDOW for n in ("rev", "srt")}
    full = records[0]["sync/full_model_bytes"]
    print(f"multi-LoRA job: {steps} RL steps, {records[-1]['time/elapsed']:.1f}s; exact-match reward first "
          f"{WINDOW} -> last {WINDOW} steps: {first} -> {last}; bytes per sync {records[0]['sync/bytes']:.0f} "
          f"(rev {records[0]['adapter/rev/sync_bytes']:.0f}, srt {records[0]['adapter/srt/sync_bytes']:.0f}) "
          f"vs {full:.0f} for the full model")
    for n in ("rev", "srt"):  # the RL phase does the learning: each adapter rises to the target by itself
        assert last[n] >= TARGET and last[n] >= first[n] + 0.15, (n, first, last)  # measured +0.27, +0.24

    out = tmp_path / "adapters"
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "run"), "-o", str(out), "--adapter"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "rev" / "milehpc_export.json").read_text())["kind"] == "adapter"

    job = load_run(tmp_path / "run")
    tok = build_tokenizer(job.model.tokenizer)
    engine = build_engine(job)
    ckpt = torch.load(sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1] / "rank-00000.pt",
                      weights_only=True)["state"]["trainer"]["trainer"]["model"]["adapter"]
    spec = job.trainer.lora
    scaling = [(f"lora.scaling.{n}", torch.tensor([spec.alpha / spec.rank], dtype=torch.float64)) for n in ("rev", "srt")]
    engine.update_weights([*scaling, *((lora.engine_name(n), t) for n, t in ckpt.items())], steps)
    mix = adapter_mix(job, tok, seed_offset=1)  # held-out: other prompts than the run's stream
    # prompts on which the two tasks' answers differ (digits not in order, read alike either way)
    prompts = [p for p in map(mix.peek, range(64)) if p.text.split(":")[1].rstrip("=")[::-1]
               != "".join(sorted(p.text.split(":")[1].rstrip("=")))]
    new = job.rollout.max_new_tokens
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new, n=1)
    score: dict[tuple[str, str], float] = {}  # (task adapter, policy) -> mean greedy reward on that task's prompts
    for name in ("rev", "srt"):
        base = build_model(job.model, tok.vocab_size, seed=job.run.seed, pad_id=tok.pad_id, eos_id=tok.eos_id)
        peft_model = PeftModel.from_pretrained(base, str(out / name)).eval()
        mine = [p for p in prompts if p.metadata["adapter"] == name]
        got = engine.generate([p.ids for p in mine], replace(greedy, adapters=[name] * len(mine)))
        assert [s.response_ids for s in got] == [_greedy(peft_model, p.ids, tok.eos_id, new) for p in mine], name
        fresh = build_engine(job)  # the base alone
        for policy, engine_ in (("base", fresh), ("rev", engine), ("srt", engine)):
            answers = engine_.generate([p.ids for p in mine], greedy if policy == "base" else
                                       replace(greedy, adapters=[policy] * len(mine)))
            score[name, policy] = sum(match_score(tok.decode([t for t in s.response_ids if t != tok.eos_id]),
                                                  p.label, 1.0) for s, p in zip(answers, mine, strict=True)) / len(mine)
    print(f"multi-LoRA: greedy partial-credit reward (task, policy) {score}")
    for name, other in (("rev", "srt"), ("srt", "rev")):
        assert score[name, name] >= score[name, "base"] + 0.5, (name, score)
        assert score[name, name] >= score[name, other] + 0.2, (name, score)

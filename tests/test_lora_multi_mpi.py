"""Multi-LoRA under real mpirun (`milehpc run examples/multi-lora.toml --site local`), 1 rollout rank + 2 trainer ranks: two adapters on one
base, one on task:reverse and one on task:sort, each with its own prompts, reward and optimizer (the warm-up is LoRA
too: each adapter's SFT on its own task, then RL). The engine's logprobs agree with the trainer's peft forward after
every sync (each adapter's prompts were generated with that adapter), only the adapters travel (bytes per adapter),
each adapter's RL reward (adapter/<NAME>/reward_mean) is well above the base's on its task; then `milehpc export
--adapter` writes one peft folder per adapter, `PeftModel.from_pretrained` on the base reproduces the reference
engine's greedy output for that adapter's prompts, and each adapter answers its own task better than the base and
than the other adapter does (greedy partial-credit reward on the prompts where the two tasks' answers differ)."""

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

pytestmark = [pytest.mark.mpi]
require_module("peft")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "multi-lora.toml"  # the README's multi-LoRA job
SFT, STEPS = 100, 8


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

    records = run_cli(tmp_path, EXAMPLE, timeout=600)
    print(f"multi-LoRA job: {records[-1]['time/elapsed']:.1f}s of RL after a {SFT}-step LoRA warm-up")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert records[0]["dist/mpi_world_size"] == 3 and records[0]["dist/rollout_ranks"] == 1
    for r in records:
        assert r["train/logprob_diff_max"] <= 1e-5, r["train/logprob_diff_max"]
        assert r["adapter/rev/samples"] == r["adapter/srt/samples"] == 16
        assert r["sync/bytes"] == r["adapter/rev/sync_bytes"] + r["adapter/srt/sync_bytes"] > 0
        assert r["sync/bytes"] < r["sync/full_model_bytes"]
    rl = {n: sum(r[f"adapter/{n}/reward_mean"] for r in records) / STEPS for n in ("rev", "srt")}
    assert all(math.isfinite(r[f"adapter/{n}/loss"]) for r in records for n in ("rev", "srt"))

    out = tmp_path / "adapters"
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "run"), "-o", str(out), "--adapter"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "rev" / "milehpc_export.json").read_text())["kind"] == "adapter"

    job = load_run(tmp_path / "run")
    tok = build_tokenizer(job.model.tokenizer)
    engine = build_engine(job)
    ckpt = torch.load(sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1] / "rank-00000.pt",
                      weights_only=True)["state"]["trainer"]["trainer"]["model"]["adapter"]
    scaling = [(f"lora.scaling.{n}", torch.tensor([32 / 8], dtype=torch.float64)) for n in ("rev", "srt")]
    engine.update_weights([*scaling, *((lora.engine_name(n), t) for n, t in ckpt.items())], STEPS)
    mix = adapter_mix(job, tok)
    # prompts on which the two tasks' answers differ (one digit, or digits in order, read alike either way)
    prompts = [p for p in map(mix.peek, range(96)) if p.text.split(":")[1].rstrip("=")[::-1]
               != "".join(sorted(p.text.split(":")[1].rstrip("=")))]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, n=1)
    score: dict[tuple[str, str], float] = {}  # (task adapter, policy) -> mean greedy reward on that task's prompts
    for name in ("rev", "srt"):
        base = build_model(job.model, tok.vocab_size, seed=job.run.seed, pad_id=tok.pad_id, eos_id=tok.eos_id)
        peft_model = PeftModel.from_pretrained(base, str(out / name)).eval()
        mine = [p for p in prompts if p.metadata["adapter"] == name]
        got = engine.generate([p.ids for p in mine], replace(greedy, adapter=name))
        assert [s.response_ids for s in got] == [_greedy(peft_model, p.ids, tok.eos_id, 4) for p in mine], name
        fresh = build_engine(job)  # the base alone
        for policy, engine_ in (("base", fresh), ("rev", engine), ("srt", engine)):
            answers = engine_.generate([p.ids for p in mine], greedy if policy == "base" else
                                       replace(greedy, adapter=policy))
            score[name, policy] = sum(match_score(tok.decode([t for t in s.response_ids if t != tok.eos_id]),
                                                  p.label, 1.0) for s, p in zip(answers, mine, strict=True)) / len(mine)
    print(f"multi-LoRA: RL reward per adapter {rl}; greedy reward (task, policy) {score}")
    for name, other in (("rev", "srt"), ("srt", "rev")):
        assert rl[name] >= score[name, "base"] + 0.1, (name, rl, score)
        assert score[name, name] >= score[name, "base"] + 0.15, (name, score)
        assert score[name, name] > score[name, other], (name, score)

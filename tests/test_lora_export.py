"""A LoRA run's newest checkpoint exported as a peft adapter folder (milehpc.train.lora.export_adapter):
``PeftModel.from_pretrained`` over the job's base loads it and decodes greedily exactly what the reference engine
decodes with the adapter synced to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from required import require_module

from milehpc.checkpoint import Checkpointer
from milehpc.config.job import JobSpec
from milehpc.config.load import load_job
from milehpc.config.schema import to_dict
from milehpc.data.tokenizer import build_tokenizer
from milehpc.errors import ConfigError
from milehpc.models import build_model
from milehpc.rollout.engine import SamplingParams
from milehpc.rollout.reference import build_engine
from milehpc.runtime.loop import run_local
from milehpc.train.lora_export import export_adapter
from milehpc.train.torch_trainer import TorchTrainer
from milehpc.weights.inplace import load_in_place

peft = require_module("peft")

JOB = """
name = "lora-export"
[model]
hidden_size = 32
num_layers = 1
num_heads = 2
num_kv_heads = 1
intermediate_size = 64
max_position_embeddings = 64
[data]
source = "task:sort"
params = { min_len = 3, max_len = 4 }
[rollout]
prompts_per_step = 4
n_samples = 2
max_new_tokens = 6
[trainer]
micro_batch_size = 32
lr = 3e-2
sft_warmup_steps = 3
sft_lr = 3e-2
[trainer.lora]
rank = 4
alpha = 8
target_modules = ["*_proj"]
modules_to_save = ["lm_head"]
[run]
steps = 2
loop = "sync"
dump_rollouts = false
"""


def _greedy(model: torch.nn.Module, prompt: list[int], steps: int, eos: int) -> list[int]:
    """Plain greedy decoding, no cache: the whole sequence through the model for every token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tok = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(tok)
            if tok == eos:
                break
    return ids[len(prompt):]


def _run_dir(tmp_path: Path, text: str) -> JobSpec:
    """A run directory as ``milehpc submit`` writes it: the job as ``job.json``."""
    (tmp_path / "job.toml").write_text(text)
    job = load_job(tmp_path / "job.toml")
    (tmp_path / "job.json").write_text(json.dumps(to_dict(job)))
    (tmp_path / "job.toml").unlink()
    return job


def test_exported_adapter_loads_in_peft_and_decodes_as_the_engine(tmp_path: Path) -> None:
    job = _run_dir(tmp_path, JOB)
    run_local(job, tmp_path, checkpointing=True)
    out = export_adapter(tmp_path, tmp_path / "adapter")
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()

    tok = build_tokenizer(job.model.tokenizer)
    ckpt = Checkpointer(tmp_path / "checkpoints")
    trainer = TorchTrainer(job, tok)
    trainer.load_checkpoint_state(ckpt.load(ckpt.find_latest()).state["trainer"]["trainer"])
    assert any(p.abs().sum() > 0 for n, p in trainer.module.named_parameters() if ".lora_B." in n)  # it trained
    engine = build_engine(job)
    load_in_place(engine, trainer.export_weights(), trainer.version)
    prompts = [tok.encode(f"sort:{d}=") for d in ("312", "9041", "775", "2860")]
    want = [s.response_ids for s in engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6))]

    base = build_model(job.model, tok.vocab_size, seed=job.run.seed, pad_id=tok.pad_id, eos_id=tok.eos_id)
    loaded = peft.PeftModel.from_pretrained(base, str(out)).eval()
    assert len({tuple(w) for w in want}) > 1  # the prompts decode differently: a real comparison
    assert [_greedy(loaded, p, 6, tok.eos_id) for p in prompts] == want


def test_exporting_a_run_without_lora_is_one_line(tmp_path: Path) -> None:
    _run_dir(tmp_path, JOB.split("[trainer.lora]")[0] + "[run]\nsteps = 1\nloop = 'sync'\n")
    with pytest.raises(ConfigError, match=r"trainer.lora: expected a run with \[trainer.lora\], got none"):
        export_adapter(tmp_path, tmp_path / "adapter")

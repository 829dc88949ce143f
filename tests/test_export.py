"""``milehpc export RUN_DIR -o DIR``: a run's checkpoint as a Hugging Face folder that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load with the trainer's logits and token ids; ``--dtype``, ``--step``, the refusals (one line,
exit 2), nothing half-written on failure; LoRA runs as a peft adapter folder (``--adapter``) or merged.

Real runs of the sync loop in this process (``run_local``), the real CLI through click's runner. Checkpoints that
need real mpirun are exported by the tests that already write them, with the checks from here: a Megatron TP=2 one
at the end of tests/test_ckpt_reshard_mpi.py (:func:`check_megatron_export`), a Megatron TP=2 x PP=2 one in
tests/test_megatron_mpi.py (:func:`check_export_generates_the_loop_answers`: the engine's greedy tokens), FSDP2
shards of 2 ranks in tests/test_loop_mpi.py (:func:`check_export_matches_rollouts`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from required import require_module
from tiny_model import TINY_MODEL

from milehpc.checkpoint import Checkpointer, list_checkpoints
from milehpc.cli import cli
from milehpc.config.job import JobSpec
from milehpc.config.load import load_job, run_job
from milehpc.config.schema import to_dict
from milehpc.data.tokenizer import build_tokenizer
from milehpc.models import build_model
from milehpc.runtime.loop import run_local
from milehpc.train.lora_export import policy_from_checkpoint
from milehpc.train.torch_trainer import TorchTrainer

transformers = require_module("transformers")
peft = require_module("peft")

MODEL = """
name = "{name}"
""" + TINY_MODEL + """
[data]
source = "task:sort"
params = {{ min_len = 3, max_len = 4 }}
[reward]
name = "ckpt_reshard_entries:token_reward"  # differs within every group: every step trains
[rollout]
prompts_per_step = 4
n_samples = 2
max_new_tokens = 6
[trainer]
micro_batch_size = 32
lr = 3e-2
sft_warmup_steps = 2
sft_lr = 3e-2
"""
RUN = """
[checkpoint]
interval_steps = 1
keep = 3
[run]
steps = 3
loop = "sync"
dump_rollouts = false
"""
LORA = """
[trainer.lora]
rank = 4
alpha = 8
target_modules = ["*_proj"]
modules_to_save = ["lm_head"]
"""
PROMPTS = ("sort:312=", "sort:9041=", "sort:7 75=21", "sort:2860=0")  # a space: byte-level "Ġ"


def _run(run_dir: Path, text: str) -> JobSpec:
    """A run directory as ``milehpc submit`` writes it (the job as ``job.json``), trained by the sync loop."""
    run_dir.mkdir(parents=True)
    (run_dir / "job.toml").write_text(text)
    job = load_job(run_dir / "job.toml")
    (run_dir / "job.json").write_text(json.dumps(to_dict(job)))
    (run_dir / "job.toml").unlink()
    run_local(job, run_dir, checkpointing=True)
    return job


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("export") / "run"
    _run(run_dir, MODEL.format(name="export") + RUN)
    return run_dir


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("export-lora") / "run"
    _run(run_dir, MODEL.format(name="export-lora") + LORA + RUN)
    return run_dir


def export(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["export", *map(str, args)])
    return result.exit_code, result.output


def _trainer_at(run_dir: Path, step: int) -> TorchTrainer:
    """The torch trainer as it was when it saved checkpoint ``step``."""
    job = run_job(run_dir)
    ckpt = Checkpointer(run_dir / "checkpoints")
    info = next(i for i in list_checkpoints(ckpt.root) if i.step == step)
    trainer = TorchTrainer(job, build_tokenizer(job.model.tokenizer))
    trainer.load_checkpoint_state(ckpt.load(info).state["trainer"]["trainer"])
    return trainer


def _batch(tokenizer: object) -> dict[str, torch.Tensor]:
    """The prompts, left-padded into one batch by the exported tokenizer."""
    rows = [tokenizer.encode(p) for p in PROMPTS]  # type: ignore[attr-defined]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {"input_ids": ids, "attention_mask": mask}


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**batch).logits


def test_torch_run_exports_a_folder_transformers_loads_with_the_trainers_logits(torch_run: Path,
                                                                                tmp_path: Path) -> None:
    out = tmp_path / "hf"
    code, output = export(torch_run, "-o", out)
    assert code == 0, output
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "milehpc_export.json"} <= names, names
    record = json.loads((out / "milehpc_export.json").read_text())
    trainer = _trainer_at(torch_run, 3)
    assert record["step"] == 3 and record["weight_version"] == trainer.version == 3 and record["kind"] == "model"
    assert record["source_checkpoint"].endswith("step-00000003") and "wrote" in output

    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    toy = build_tokenizer("toy")
    # The toy vocabulary as HF files: the same ids (BOS first, as the engines encode prompts) and specials.
    assert [tok.encode(p) for p in PROMPTS] == [toy.encode_prompt(p) for p in PROMPTS]
    assert (tok.pad_token_id, tok.eos_token_id, len(tok)) == (toy.pad_id, toy.eos_id, toy.vocab_size)
    assert model.generation_config.eos_token_id == toy.eos_id
    batch = _batch(tok)
    want = _logits(trainer.module, batch)
    assert torch.equal(_logits(model, batch), want)
    # ... and they are the trained weights, not the seeded build's.
    job = run_job(torch_run)
    initial = build_model(job.model, toy.vocab_size, seed=job.run.seed, pad_id=toy.pad_id, eos_id=toy.eos_id)
    assert not torch.allclose(_logits(initial, batch), want)


def test_bf16_export_of_an_older_step(torch_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    code, output = export(torch_run, "-o", out, "--step", "2", "--dtype", "bf16")
    assert code == 0, output
    assert json.loads((out / "milehpc_export.json").read_text())["step"] == 2
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    got, step2, step3 = (m.state_dict() for m in (model, _trainer_at(torch_run, 2).module,
                                                  _trainer_at(torch_run, 3).module))
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert all(torch.equal(got[n], step2[n].to(torch.bfloat16)) for n in step2)
    assert any(not torch.equal(step2[n], step3[n]) for n in step2)  # step 2, not the newest


def test_refusals_are_one_line_with_exit_2_and_leave_nothing_behind(torch_run: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, output = export(torch_run, "-o", out)
    assert code == 2 and output.count("\n") == 1, output
    assert f"{out}: -o: expected a new or empty folder, got a non-empty one (--force replaces it)" in output
    assert (out / "keep.txt").read_text() == "mine"

    code, output = export(torch_run, "-o", tmp_path / "other", "--step", "7")
    assert code == 2 and output.count("\n") == 1, output
    assert "--step: expected one of the run's checkpoint steps (1, 2, 3), got 7" in output

    code, output = export(torch_run, "-o", tmp_path / "other", "--adapter")
    assert code == 2 and "trainer.lora: --adapter exports a LoRA run" in output, output

    # A failure while writing: the staged folder is removed, the old DIR is intact.
    import milehpc.export.run as export_module

    def broken(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(export_module, "write_tokenizer", broken)
    code, _ = export(torch_run, "-o", out, "--force")
    assert code != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and (out / "keep.txt").read_text() == "mine"
    monkeypatch.undo()

    code, output = export(torch_run, "-o", out, "--force")
    assert code == 0, output
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_lora_run_exports_the_peft_adapter_or_the_merged_model(lora_run: Path, tmp_path: Path) -> None:
    job = run_job(lora_run)
    toy = build_tokenizer("toy")
    policy = policy_from_checkpoint(job, Checkpointer(lora_run / "checkpoints").load(
        list_checkpoints(lora_run / "checkpoints")[0]).state["trainer"]["trainer"]["model"])

    code, output = export(lora_run, "-o", tmp_path / "adapter", "--adapter")
    assert code == 0, output
    assert {"adapter_config.json", "adapter_model.safetensors", "milehpc_export.json"} <= \
        {p.name for p in (tmp_path / "adapter").iterdir()}
    base = build_model(job.model, toy.vocab_size, seed=job.run.seed, pad_id=toy.pad_id, eos_id=toy.eos_id)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    batch = _batch(transformers.AutoTokenizer.from_pretrained(tmp_path / "adapter"))
    want = _logits(policy, batch)
    assert torch.equal(_logits(loaded, batch), want)
    assert any(p.abs().sum() > 0 for n, p in loaded.named_parameters() if ".lora_B." in n)  # it trained

    code, output = export(lora_run, "-o", tmp_path / "merged")  # a LoRA run: merged unless --adapter
    assert code == 0 and "note: a LoRA run: writing the base with the adapter merged" in output, output
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n in merged.state_dict())
    assert torch.allclose(_logits(merged, batch), want, atol=1e-5, rtol=0)
    assert json.loads((tmp_path / "merged" / "milehpc_export.json").read_text())["kind"] == "merged"


# ---- Megatron: called by tests/test_ckpt_reshard_mpi.py (TP=2) and tests/test_megatron_mpi.py (TP=2 x PP=2) ---------

def export_in_subprocess(run_dir: Path, step: int, out: Path) -> dict:
    """``milehpc export RUN_DIR -o OUT --step N`` as a user runs it (a subprocess: Megatron's parallel state stays
    out of pytest's process); the folder's provenance record."""
    proc = subprocess.run([str(Path(sys.executable).with_name("milehpc")), "export", str(run_dir), "-o", str(out),
                           "--step", str(step)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads((out / "milehpc_export.json").read_text())
    assert record["step"] == step, record
    return record


def load_exported(out: Path) -> torch.nn.Module:
    """The folder's model through ``AutoModelForCausalLM``, every weight from the folder (transformers would
    initialise a missing one at random and only warn)."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def check_megatron_export(run_dir: Path, step: int, trainer_weights: dict[str, torch.Tensor], out: Path) -> None:
    """``milehpc export`` of a Megatron run gives exactly the weights the trainer itself exported (TP-gathered,
    HF-named) at that checkpoint, and the HF model loaded from the folder has the logits of the job's HF model
    holding those weights."""
    record = export_in_subprocess(run_dir, step, out)
    assert record["trainer_backend"] == "megatron", record
    model = load_exported(out)
    got = model.state_dict()
    assert sorted(got) == sorted(trainer_weights)
    different = [n for n in trainer_weights if not torch.equal(got[n], trainer_weights[n])]
    assert not different, different[:5]
    job = run_job(run_dir)
    tok = build_tokenizer(job.model.tokenizer)
    reference = build_model(job.model, tok.vocab_size, seed=job.run.seed, pad_id=tok.pad_id, eos_id=tok.eos_id)
    reference.load_state_dict(trainer_weights)
    batch = _batch(transformers.AutoTokenizer.from_pretrained(out))
    assert torch.equal(_logits(model, batch), _logits(reference, batch))


def check_export_generates_the_loop_answers(run_dir: Path, step: int, out: Path) -> dict:
    """Checkpoint ``step`` exported and loaded in ``transformers`` greedy-generates, one prompt at a time without
    padding (stopping at EOS, the same ``max_new_tokens``), exactly the tokens the engine answered in the loop's
    evaluation of those weights (``evals/`` of metrics step ``step - 1``). Returns the provenance record."""
    rows = [json.loads(line) for line in (run_dir / "evals" / f"step_{step - 1:08d}.jsonl").read_text().splitlines()]
    record = export_in_subprocess(run_dir, step, out)
    assert rows and {r["weight_version"] for r in rows} == {record["weight_version"]}, (record, rows[0])
    job = run_job(run_dir)
    assert not job.rollout.stop  # the engine would also stop at these strings; generate() here at EOS only
    model, tok = load_exported(out), transformers.AutoTokenizer.from_pretrained(out)
    new_tokens = job.eval.max_new_tokens or job.rollout.max_new_tokens
    for r in rows:
        ids = torch.tensor([tok.encode(r["prompt"])])
        with torch.no_grad():
            got = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        assert got[0, ids.shape[1]:].tolist() == r["response_ids"], r
    return record


# ---- FSDP2: called by tests/test_loop_mpi.py on its colocated FSDP2 run (2 trainer ranks) ---------------------------

def check_export_matches_rollouts(run_dir: Path, step: int, out: Path) -> None:
    """The export of checkpoint ``step`` (weight version ``step``), joined from the trainer ranks' FSDP2 shards, gives
    the logprobs the engines computed for the rollouts they generated with that very version (the dump of ``step``)."""
    from milehpc.samples.batch import to_batch
    from milehpc.samples.dumps import read_rollouts

    code, output = export(run_dir, "-o", out, "--step", str(step))
    assert code == 0, output
    record = json.loads((out / "milehpc_export.json").read_text())
    assert record["weight_version"] == step and record["layout"]["trainer_ranks"] == 2, record
    samples, _ = read_rollouts(run_dir, step)
    samples = [s for s in samples if s.weight_version == step]
    assert samples
    batch = to_batch(samples, build_tokenizer("toy").pad_id)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits
    temperature = run_job(run_dir).rollout.temperature
    logp = batch.response_logprobs(logits, temperature if temperature > 0 else 1.0)
    diff = max(abs(float(logp[i, j]) - lp) for i, s in enumerate(samples) for j, lp in enumerate(s.rollout_logprobs))
    assert diff < 1e-5, diff


def test_a_run_from_a_local_hf_folder_exports_that_folders_tokenizer_and_generation_config(tmp_path: Path) -> None:
    from tiny_tokenizer import SAMPLES, build_tokenizer_folder

    from milehpc.config.load import job_from_dict
    from milehpc.models import save_model

    tok_dir = build_tokenizer_folder(tmp_path / "tok")
    spec = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
            "max_position_embeddings": 96, "tokenizer": str(tok_dir)}
    hf_tok = build_tokenizer(str(tok_dir))
    base = build_model(job_from_dict({"name": "b", "model": spec}).model, hf_tok.vocab_size, pad_id=hf_tok.pad_id,
                       eos_id=hf_tok.eos_id)
    save_model(base, tmp_path / "base")
    transformers.GenerationConfig(eos_token_id=hf_tok.eos_id, do_sample=True, temperature=0.7).save_pretrained(
        tmp_path / "base")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = job_from_dict({"name": "from-path", "model": {**spec, "path": str(tmp_path / "base")},
                         "rollout": {"prompts_per_step": 2, "n_samples": 2, "max_new_tokens": 8},
                         "trainer": {"micro_batch_size": 4},
                         "data": {"source": str(SAMPLES / "gsm8k_style_train.jsonl"), "max_prompt_tokens": 64},
                         "reward": {"name": "math_answer"},
                         "run": {"steps": 1, "loop": "sync", "dump_rollouts": False}})
    (run_dir / "job.json").write_text(json.dumps(to_dict(job)))
    run_local(job, run_dir, checkpointing=True)

    code, output = export(run_dir, "-o", tmp_path / "hf")
    assert code == 0, output
    # The folder's own tokenizer files, chat template included.
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == (tok_dir / "tokenizer.json").read_text()
    got = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    assert got.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == hf_tok.render_prompt(chat)
    # transformers 5 reads a qwen2 folder's tokenizer as Qwen2Tokenizer (Qwen's pre-tokenizer), which this tiny GPT-2
    # style one is not: the export says so exactly when the ids differ.
    text = "Natalia sold 48 clips in April, and then she sold half as many clips in May."
    differs = got.encode(text, add_special_tokens=False) != hf_tok.encode(text)
    assert differs == (f"loads the exported tokenizer as {type(got).__name__}, which splits text unlike" in output)
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert (generation.temperature, generation.do_sample) == (0.7, True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    batch = _batch(got)
    assert torch.equal(_logits(model, batch), _logits(_trainer_at(run_dir, 1).module, batch))

"""Issue 19, Megatron LoRA at TP=2, two real launches:

* ``tests/megatron_lora_checks.py`` under ``mpirun -np 2`` (TP=2, megatron-core and peft as installed, under the
  device check: a CPU tensor reaching a collective of an NCCL group fails, as on a GPU): the same loss and adapter
  gradients as the torch trainer with ``peft`` on the same batch; the adapter-only checkpoint resumes exactly.
* the RL loop through ``milehpc run --site local``: Megatron trainer ranks at TP=2 with ``[trainer.lora]`` and the
  reference engine on a third rank; only the adapter is synced, the engine's logprobs agree with the trainer's after
  every sync, the checkpoint is adapter-only, and ``milehpc export --adapter`` of it loads with
  ``PeftModel.from_pretrained`` over the base and decodes the engine's greedy answers."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from local_job import run_local_job
from mpi_checks import ENV, run_checks
from required import unavailable

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def _require_peft_and_megatron() -> None:
    for name in ("peft", "megatron.core"):  # looked up, not imported: the launch's ranks import them
        if importlib.util.find_spec(name) is None:
            unavailable(f"the Python package {name!r} is not installed (pip install -e '.[dev]')")


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    _require_peft_and_megatron()
    work = tmp_path_factory.mktemp("megatron-lora")
    return run_checks("megatron_lora_checks.py", work / "out.json", work, np=2, env={"MILEHPC_DEVICE_CHECK": "nccl"})


@pytest.mark.parametrize("targets", ["default", "subset"])
def test_megatron_lora_at_tp2_matches_peft(checks: dict, targets: str) -> None:
    """The default targets (q/k/v/o, gate/up/down: 2 layers x 7 projections, an A and a B each) and a subset (q, v
    and down: k's slice of the fused qkv and the whole fc1 without adapters): the same initial adapter as peft's,
    then from the same nonzero B one step on the same batch: the same loss and every adapter gradient (full shape,
    HF names) as the torch trainer; the base frozen and out of the optimizer; only the adapter synced."""
    got = checks[targets]
    assert got["adapter_tensors"] == {"default": 28, "subset": 12}[targets]
    assert got["initial_vs_peft"] == 0.0  # peft's own draws, same names
    assert got["scaling"] == 12.0 / 4
    assert abs(got["torch_entropy"]) > 0.1  # the entropy bonus: the loss depends on the model
    assert got["loss_diff"] < 1e-6, got
    assert got["grads_min_of_max"] > 1e-4 * got["grads_max"], got  # every adapter tensor's gradient is live
    assert got["grads_maxdiff"] < 1e-5 * got["grads_max"], got
    assert got["grad_norm_rel"] < 1e-5, got
    assert got["base_trainable"] == 0 and got["base_moved"] == 0.0
    assert got["optimizer_params"] == got["local_adapter_params"] == got["adapter_tensors"]
    assert 0 < got["sync_bytes"] < got["full_model_bytes"] / 5, got  # the adapter and its scaling alone


def test_megatron_lora_checkpoint_is_adapter_only_and_resumes_exactly(checks: dict) -> None:
    """The checkpoint holds the adapter (peft's names, as the torch trainer's) and this rank's optimizer state — no
    dist checkpoint of the base; reloaded at TP=2 the next step is the uninterrupted one, bit for bit; another
    layout, or a checkpoint written without LoRA, is refused in one line; ``milehpc export``'s reader loads it over the rebuilt base as peft's adapter."""
    got = checks["default"]
    assert got["ckpt_model_keys"] == ["adapter", "base_fingerprint", "base_source"]
    assert got["ckpt_adapter_is_peft"] and not got["ckpt_dist_dir_written"]
    assert got["ckpt_optimizer_states"] == got["local_adapter_params"]
    assert got["ckpt_reload_vs_saved"] == 0.0
    assert got["ckpt_resume_loss_diff"] == 0.0 and got["ckpt_resume_vs_uninterrupted"] == 0.0
    assert got["ckpt_steps"] == [2, 2]
    assert got["ckpt_other_layout"].startswith("trainer: a Megatron LoRA checkpoint resumes at the layout")
    assert got["ckpt_without_lora"].startswith("trainer.lora: this checkpoint was written without [trainer.lora]")
    assert got["export_reader_vs_saved"] == 0.0


LOOP_JOB = """
    name = "megatron-lora-loop"
    [data]
    source = "task:reverse"
    params = { min_len = 1, max_len = 5 }
    val_source = "task:reverse"
    [reward]
    name = "ckpt_reshard_entries:token_reward"  # differs within every group: every step trains
    [rollout]
    prompts_per_step = 4
    n_samples = 4
    max_new_tokens = 6
    temperature = 0.8
    [eval]
    max_prompts = 4
    [trainer]
    backend = "megatron"
    tp = 2
    micro_batch_size = 8
    lr = 1e-2
    sft_warmup_steps = 2
    sft_lr = 1e-2
    [trainer.lora]
    rank = 4
    alpha = 8
    [run]
    steps = 3
    loop = "sync"
    check_logprobs = true
    eval_every = 2
    [checkpoint]
    interval_steps = 2
    [site]
    ranks_per_node = 3
"""


def _tensor_bytes(obj: object) -> int:
    """Bytes of every tensor in a nested checkpoint state."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def test_megatron_lora_through_the_loop_syncs_checkpoints_and_exports_the_adapter_alone(tmp_path: Path) -> None:
    """Megatron at TP=2 with [trainer.lora] (a LoRA warm-up first, so the adapter is far from zero) and the reference
    engine on a third rank under real mpirun: each sync moves the adapter alone (TP shards gathered, peft's names)
    and the engine applies it exactly (logprob check after every sync); the loss moves; the checkpoints hold the
    adapter and its optimizer state, no base and no dist checkpoint; ``milehpc export --adapter --step 2`` is a peft
    folder that ``PeftModel.from_pretrained`` loads over the job's base, greedy-decodes exactly the engine's answers
    in the loop's evaluation of the same weights and gives the logprobs the engine sampled batch 2 with."""
    _require_peft_and_megatron()
    import torch
    import transformers
    from peft import PeftModel

    from milehpc.checkpoint import Checkpointer, list_checkpoints
    from milehpc.config.load import run_job
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import build_model
    from milehpc.samples.batch import to_batch
    from milehpc.samples.dumps import read_rollouts

    records, _ = run_local_job(tmp_path, LOOP_JOB, {"PYTHONWARNINGS": "ignore", "PYTHONPATH": ENV["PYTHONPATH"]},
                               timeout=600)
    rdir = tmp_path / "run"
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["dist/mpi_world_size"] == 3 and records[0]["dist/trainer_world_size"] == 2
    for r in records:
        assert r["train/logprob_diff_max"] <= 1e-5, r  # the engine's merged adapter = Megatron's sharded one
        assert r["train/grad_norm"] > 0, r
    losses = [r["train/loss"] for r in records]
    assert len(set(losses)) == len(losses), losses
    (adapter,) = {r["sync/bytes"] for r in records}
    full = records[0]["sync/full_model_bytes"]
    print(f"Megatron LoRA sync: {adapter:.0f} bytes per sync vs {full:.0f} for the full model ({full / adapter:.1f}x)")
    assert 0 < adapter < full / 4, (adapter, full)

    # The checkpoint: the adapter (peft names, full tensors) and the adapter's optimizer state, on each trainer rank.
    job = run_job(rdir)
    info = list_checkpoints(rdir / "checkpoints")[0]  # the newest
    assert info.step == 3 and not (rdir / "checkpoints" / "megatron").exists()  # no dist checkpoint of the base
    for rank in (0, 1):
        state = Checkpointer(info.path.parent).load(info, source_rank=rank).state["trainer"]["trainer"]
        assert sorted(state["model"]) == ["adapter", "base_fingerprint", "base_source"], sorted(state["model"])
        assert state["model"]["adapter"] and all(".lora_" in n for n in state["model"]["adapter"])
        assert _tensor_bytes(state["model"]) == adapter - 8  # the sync's tensors less its float64 scaling
        # The optimizer holds Adam's two moments of this rank's adapter shards (a base would be more than `full`).
        assert 0 < _tensor_bytes(state["optimizer"]) <= 2 * adapter, (_tensor_bytes(state["optimizer"]), adapter)
    assert any(float(t.abs().max()) > 0 for n, t in state["model"]["adapter"].items() if ".lora_B." in n)

    # milehpc export --adapter, as a user runs it: a peft folder over the job's base.
    out = tmp_path / "adapter"
    proc = subprocess.run([str(Path(sys.executable).with_name("milehpc")), "export", str(rdir), "-o", str(out),
                           "--adapter", "--step", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads((out / "milehpc_export.json").read_text())
    assert (record["kind"], record["trainer_backend"], record["weight_version"]) == ("adapter", "megatron", 2), record
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    tok = build_tokenizer(job.model.tokenizer)
    base = build_model(job.model, tok.vocab_size, seed=job.run.seed, pad_id=tok.pad_id, eos_id=tok.eos_id)
    model = PeftModel.from_pretrained(base, str(out)).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    rows = [json.loads(line) for line in (rdir / "evals" / "step_00000001.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["weight_version"] for r in rows} == {2}, rows
    new_tokens = job.eval.max_new_tokens or job.rollout.max_new_tokens
    for r in rows:
        ids = torch.tensor([hf_tok.encode(r["prompt"])])
        with torch.no_grad():
            got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        assert got[0, ids.shape[1]:].tolist() == r["response_ids"], r
    # The tokens the engine sampled with adapter 2 (batch 2), scored by the exported folder: the engine's logprobs.
    samples, _ = read_rollouts(rdir, 2)
    assert samples and {s.weight_version for s in samples} == {2}
    batch = to_batch(samples, tok.pad_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits
    logp = batch.response_logprobs(logits, job.rollout.temperature)
    diff = max(abs(float(logp[i, j]) - lp) for i, s in enumerate(samples) for j, lp in enumerate(s.rollout_logprobs))
    assert diff < 1e-5, diff

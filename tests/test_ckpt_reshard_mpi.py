"""Resuming a Megatron run, end to end through the rendered local job script: at another trainer layout, then at
the same one bit-exactly (one run directory for both: each launch of Megatron ranks costs CI seconds).

A GRPO + KL run with Megatron trainer ranks (distributed optimizer) at TP=1 (1 trainer + 1 rollout rank)
checkpoints after step 2; then ``milehpc submit --resume RUN_DIR --set trainer.tp=2 --set run.steps=6`` (the real
login path: re-planned at TP=2, so the rollout rank moves from rank 1 to rank 2) starts the job again, which
reshards the dist checkpoint to TP=2 and trains steps 2-5, checkpointing after steps 4 and 6. The ranks run the
real loop and LoopCheckpoint, with the job's ``[env] MILEHPC_ENTRY`` = ``ckpt_reshard_entries:run`` recording the
trainer's exported (TP-gathered, HF-named) weights when it checkpoints and right after it resumed. Then the last
checkpoint is set aside and the job script runs again (what ``milehpc submit --resume`` does): it resumes at TP=2
from the dist checkpoint after step 4, and steps 4-5 and the final dist checkpoint (model and optimizer state) come
out bit-identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tiny_model import TINY_MODEL

pytestmark = [pytest.mark.mpi, pytest.mark.slow(minutes=1)]

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MILEHPC_PROGRESS": "plain", "PYTHONWARNINGS": "ignore"}

JOB = """
name = "megatron-reshard"
""" + TINY_MODEL + f"""[data]
source = "task:reverse"
params = {{ min_len = 1, max_len = 4 }}
[reward]
name = "ckpt_reshard_entries:token_reward"
[rollout]
prompts_per_step = 2
n_samples = 4
max_new_tokens = 6
temperature = 0.8
[algorithm]
kl_coef = 0.05
kl_type = "low_var_kl"
[trainer]
backend = "megatron"
micro_batch_size = 8
lr = 1e-3
distributed_optimizer = true
[run]
steps = 2
loop = "sync"
check_logprobs = true
[checkpoint]
interval_steps = 2
[resources]
collective_timeout_s = 120
[site]
ranks_per_node = 3
[env]
PYTHONPATH = "{ROOT / 'tests'}"
MILEHPC_ENTRY = "ckpt_reshard_entries:run"
OMP_NUM_THREADS = "1"
"""


def _milehpc(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "milehpc"), *args], capture_output=True, text=True, timeout=timeout, env=ENV,
                          cwd=ROOT)


def _wait_local(rdir: Path, timeout: float = 300) -> None:
    """Wait for the detached local job (`milehpc submit`, site local) to end."""
    pid = int((rdir / ".milehpc" / "local.pid").read_text())
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and "zombie" not in _proc_state(pid):
        assert time.monotonic() < deadline, "the resumed job did not finish"
        time.sleep(0.2)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


def _records(rdir: Path) -> dict[int, dict]:
    last = {}
    for line in (rdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        last[record["step"]] = record
    return last


def test_megatron_run_resumes_at_another_tp_through_submit_resume(tmp_path: Path) -> None:
    import torch

    job = tmp_path / "job.toml"
    job.write_text(textwrap.dedent(JOB))
    rdir = tmp_path / "run"
    first = _milehpc("run", str(job), "--site", "local", "--run-dir", str(rdir), timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    plan = json.loads((rdir / "plan.json").read_text())
    assert (plan["world_size"], plan["trainer_ranks"], plan["tp"]) == (2, 1, 1)
    # Both steps before the checkpoint trained: the saved weights are not the seeded initial ones (which a
    # resumed trainer that failed to load would also export).
    assert all(r["train/grad_norm"] > 0 for r in _records(rdir).values()), _records(rdir)
    saved = torch.load(rdir / "probe" / "saved-2.pt", weights_only=True)
    assert len(saved) > 10 and "model.embed_tokens.weight" in saved

    args = ("submit", "--resume", str(rdir), "--site", "local", "--set", "trainer.tp=2", "--set", "run.steps=6",
            "--json")
    dry = _milehpc(*args, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    found = json.loads(dry.stdout)["resume_from"]
    assert found["step"] == 2 and found["resharded"] is True
    assert json.loads((rdir / "plan.json").read_text())["tp"] == 1  # a dry run rewrites nothing

    real = _milehpc(*args)
    assert real.returncode == 0, real.stderr
    assert json.loads(real.stdout)["resume_from"]["resharded"] is True
    _wait_local(rdir, timeout=600)  # steps 2-5 at TP=2; a loaded machine takes minutes
    log = (rdir / "logs" / "local.out").read_text(errors="replace")
    plan = json.loads((rdir / "plan.json").read_text())
    assert (plan["world_size"], plan["trainer_ranks"], plan["tp"]) == (3, 2, 2), log[-3000:]
    assert "(step 2, restart 0, resharded from tp=1 pp=1 dp=1 to tp=2 pp=1 dp=1)" in log, log[-3000:]

    # Right after loading at TP=2, the gathered weights are exactly the ones saved at TP=1.
    resumed = torch.load(rdir / "probe" / "resumed-2.pt", weights_only=True)
    assert sorted(resumed) == sorted(saved)
    different = [n for n in saved if not torch.equal(saved[n], resumed[n])]
    assert not different, different[:5]

    # ... and the run continued at TP=2 and finished: steps 2-5 trained, engine and trainer agree.
    records = _records(rdir)
    assert sorted(records) == list(range(6)), log[-3000:]
    assert records[2]["dist/trainer_world_size"] == 2 and records[2]["dist/mpi_world_size"] == 3
    for step in range(2, 6):
        r = records[step]
        assert r["train/tokens"] > 0 and r["train/grad_norm"] > 0, r
        assert r["train/logprob_diff_max"] <= 1e-5, r
    final = torch.load(rdir / "probe" / "saved-6.pt", weights_only=True)
    assert any(not torch.equal(final[n], saved[n]) for n in saved)
    manifest = json.loads((rdir / "checkpoints" / "step-00000006" / "manifest.json").read_text())
    assert manifest["layout"]["parallel"]["tp"] == 2 and manifest["world_size"] == 3
    assert {"rank-00000.pt", "rank-00001.pt", "rank-00002.pt", "rank-00002.h5"} <= set(manifest["files"])

    # `milehpc export` of the TP=2 dist checkpoint: the trainer's own gathered weights, loadable by transformers.
    from test_export import check_megatron_export

    check_megatron_export(rdir, 6, final, tmp_path / "hf")
    _resume_at_the_same_layout_is_bit_exact(rdir, records, tmp_path)


def _resume_at_the_same_layout_is_bit_exact(rdir: Path, first: dict[int, dict], tmp_path: Path) -> None:
    """The last checkpoint (after step 6) set aside, the job script again: it resumes at TP=2 from the dist
    checkpoint after step 4; steps 4-5 run again (their metrics records are the new run's: each step has one) and
    come out bit-identical, and so does the final dist checkpoint, model and optimizer state, tensor by tensor."""
    import shutil

    import torch

    ckpt = rdir / "checkpoints"
    assert (ckpt / "megatron" / "v00000006").is_dir() and (ckpt / "step-00000004").is_dir()
    shutil.rmtree(ckpt / "step-00000006")
    shutil.move(ckpt / "megatron" / "v00000006", tmp_path / "first-v6")
    proc = subprocess.run(["bash", str(rdir / "job.sbatch")], capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout + proc.stderr
    assert "(step 4, restart 0)" in out and out.count("milehpc: resumed from") == 1, out[-3000:]
    steps = [json.loads(line)["step"] for line in (rdir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(6))  # the first run's records of steps 4-5 were replaced by the new run's
    again = _records(rdir)
    keys = ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/logprob_diff_max", "train/actor/kl")
    assert first[4]["train/grad_norm"] != first[5]["train/grad_norm"] and first[4]["train/actor/kl"] > 0  # live
    for step in (4, 5):
        assert {k: again[step][k] for k in keys} == {k: first[step][k] for k in keys}
    want = _dist_checkpoint(tmp_path / "first-v6", tmp_path / "first.pt")
    got = _dist_checkpoint(ckpt / "megatron" / "v00000006", tmp_path / "again.pt")
    assert want.keys() == got.keys() and len(want) > 4, sorted(want)[:10]
    assert any("optimizer" in k for k in want), sorted(want)[:10]
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, different[:5]


def _dist_checkpoint(path: Path, out: Path) -> dict:
    """Every tensor of a Megatron dist checkpoint (model and distributed-optimizer state), read offline."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(out))
    flat: dict = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif torch.is_tensor(value):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat

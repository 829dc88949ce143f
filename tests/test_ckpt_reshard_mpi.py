"""Resuming a Megatron run at another trainer layout, end to end through the rendered local job script.

A GRPO run with Megatron trainer ranks at TP=1 (1 trainer + 1 rollout rank) checkpoints after step 2; then
``milehpc submit --resume RUN_DIR --set trainer.tp=2 --set run.steps=4`` (the real login path: re-planned at
TP=2, so the rollout rank moves from rank 1 to rank 2) starts the job again, which reshards the dist checkpoint
to TP=2 and trains steps 2 and 3. The ranks run the real loop and LoopCheckpoint, with the job's
``[env] MILEHPC_ENTRY`` = ``ckpt_reshard_entries:run`` recording the trainer's exported (TP-gathered, HF-named)
weights when it checkpoints and right after it resumed.
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

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

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
[trainer]
backend = "megatron"
micro_batch_size = 8
lr = 1e-3
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

    args = ("submit", "--resume", str(rdir), "--site", "local", "--set", "trainer.tp=2", "--set", "run.steps=4",
            "--json")
    dry = _milehpc(*args, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    found = json.loads(dry.stdout)["resume_from"]
    assert found["step"] == 2 and found["resharded"] is True
    assert json.loads((rdir / "plan.json").read_text())["tp"] == 1  # a dry run rewrites nothing

    real = _milehpc(*args)
    assert real.returncode == 0, real.stderr
    assert json.loads(real.stdout)["resume_from"]["resharded"] is True
    _wait_local(rdir)
    log = (rdir / "logs" / "local.out").read_text(errors="replace")
    plan = json.loads((rdir / "plan.json").read_text())
    assert (plan["world_size"], plan["trainer_ranks"], plan["tp"]) == (3, 2, 2), log[-3000:]
    assert "(step 2, restart 0, resharded from tp=1 pp=1 dp=1 to tp=2 pp=1 dp=1)" in log, log[-3000:]

    # Right after loading at TP=2, the gathered weights are exactly the ones saved at TP=1.
    resumed = torch.load(rdir / "probe" / "resumed-2.pt", weights_only=True)
    assert sorted(resumed) == sorted(saved)
    different = [n for n in saved if not torch.equal(saved[n], resumed[n])]
    assert not different, different[:5]

    # ... and the run continued at TP=2 and finished: steps 2 and 3 trained, engine and trainer agree.
    records = _records(rdir)
    assert sorted(records) == [0, 1, 2, 3], log[-3000:]
    assert records[2]["dist/trainer_world_size"] == 2 and records[2]["dist/mpi_world_size"] == 3
    for step in (2, 3):
        r = records[step]
        assert r["train/tokens"] > 0 and r["train/grad_norm"] > 0, r
        assert r["train/logprob_diff_max"] <= 1e-5, r
    final = torch.load(rdir / "probe" / "saved-4.pt", weights_only=True)
    assert any(not torch.equal(final[n], saved[n]) for n in saved)
    manifest = json.loads((rdir / "checkpoints" / "step-00000004" / "manifest.json").read_text())
    assert manifest["layout"]["parallel"]["tp"] == 2 and manifest["world_size"] == 3
    assert {"rank-00000.pt", "rank-00001.pt", "rank-00002.pt", "rank-00002.h5"} <= set(manifest["files"])

    # `milehpc export` of the TP=2 dist checkpoint: the trainer's own gathered weights, loadable by transformers.
    from test_export import check_megatron_export

    check_megatron_export(rdir, 4, final, tmp_path / "hf")

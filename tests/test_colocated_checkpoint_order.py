"""The colocated loop checkpoints while the trainer's memory is resident (Miles/slime: save after training, before
offloading), so the trainer's state is never read from paused device memory; a requeue still exits only after the
step is reported. Real loop under real mpirun, SGLang's CPU stand-in and the real torch_memory_saver with its CUDA
binding faked (tests/standin_gpu_stack/, tests/tms_real.py); the checkpoint writes are recorded into the same
per-rank story as the binding's pause/resume by a ``sitecustomize`` on the job's PYTHONPATH."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tms_real
from local_job import run_local_job

pytestmark = [pytest.mark.mpi]

ROOT = Path(__file__).resolve().parents[1]

RECORDER = '''
import json, os
from milehpc.checkpoint.checkpointer import Checkpointer

_save = Checkpointer.save


def save(self, step, state, **kw):
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    with open(os.path.join(os.environ["MILEHPC_STANDIN_LOG"], f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"call": "checkpoint", "tag": str(step)}) + "\\n")
    return _save(self, step, state, **kw)


Checkpointer.save = save
'''


def test_colocated_checkpoint_between_training_and_pause(tmp_path: Path) -> None:
    tms_real.require_real()
    log, rdir, hook = tmp_path / "calls", tmp_path / "run", tmp_path / "hook"
    log.mkdir()
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(RECORDER)
    records, _ = run_local_job(tmp_path, """
        name = "colocated-checkpoint-order"
        [data]
        source = "task:reverse"
        params = { min_len = 1, max_len = 4 }
        [rollout]
        engine = "sglang"
        prompts_per_step = 2
        n_samples = 2
        max_new_tokens = 4
        [trainer]
        micro_batch_size = 4
        [resources]
        colocate = true
        [run]
        steps = 2
        [checkpoint]
        interval_steps = 1
    """, {
        "MILEHPC_STANDIN_LOG": str(log),
        "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT / "tests" / "standin_gpu_stack"), str(ROOT)])})
    story = [f"{c['call']}:{c['tag']}" if c.get("tag") else c["call"]
             for c in map(json.loads, (log / "rank0.jsonl").read_text().splitlines())]
    per_step = lambda k: ["resume:train", "region:train", f"checkpoint:{k}", "pause:train"]  # noqa: E731
    trained = [s for s in story if s.split(":")[0] in ("resume", "region", "checkpoint", "pause")]
    assert trained[-8:] == per_step(1) + per_step(2)
    assert [r["step"] for r in records] == [0, 1]
    # the step's reward is in the checkpoint written before it was reported (run.target_reward after a resume)
    import torch

    shard = torch.load(rdir / "checkpoints" / "step-00000002" / "rank-00000.pt", weights_only=False)
    assert [r["step"] for r in shard["state"]["trainer"]["recent"]] == [0, 1]

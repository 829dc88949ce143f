"""The RL loop with Megatron trainer ranks resumes from its dist checkpoint bit-exactly, under real mpirun
(``milehpc run --site local``, then the rendered job script again). Its own file: the parity launch and the 5-rank
loop of tests/test_megatron_mpi.py already fill one pytest-xdist worker for minutes (``--dist loadfile``)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from test_megatron_mpi import ENV, JOB, _records, _run

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


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


def test_loop_resumes_a_megatron_checkpoint_bit_exactly(tmp_path: Path) -> None:
    """TP=2 + 1 rollout rank, 4 steps, checkpoints after steps 2 and 4. Set the last one aside and run the job
    script again (what `milehpc submit --resume` does): it resumes from the dist checkpoint after step 2, steps 2-3
    run again (their metrics records are the new run's: each step has one) and come out bit-identical, and so does
    the final dist checkpoint, model and optimizer state, tensor by tensor."""
    text = JOB.replace("tp = 1\npp = 2\ndp = 2", "tp = 2\npp = 1\ndp = 1").replace("steps = 3", "steps = 4")
    rdir, first = _run(tmp_path, text.replace("ranks_per_node = 5", "ranks_per_node = 3"))
    ckpt = rdir / "checkpoints"
    assert (ckpt / "megatron" / "v00000004").is_dir()
    shutil.rmtree(ckpt / "step-00000004")
    shutil.move(ckpt / "megatron" / "v00000004", tmp_path / "first-v4")
    proc = subprocess.run(["bash", str(rdir / "job.sbatch")], capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    logs = proc.stdout + proc.stderr + "".join(p.read_text() for p in (rdir / "logs").glob("*"))
    assert "(step 2, restart 0)" in logs and logs.count("milehpc: resumed from") == 1
    steps = [json.loads(line)["step"] for line in (rdir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]  # the first run's records of steps 2-3 were replaced by the new run's
    again = _records(rdir)
    keys = ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/logprob_diff_max")
    assert any(first[2]["train/grad_norm"] != r["train/grad_norm"] for r in first[3:])  # steps differ at all
    for step in (2, 3):
        assert {k: again[step][k] for k in keys} == {k: first[step][k] for k in keys}
    want = _dist_checkpoint(tmp_path / "first-v4", tmp_path / "first.pt")
    got = _dist_checkpoint(ckpt / "megatron" / "v00000004", tmp_path / "again.pt")
    assert want.keys() == got.keys() and len(want) > 4, sorted(want)[:10]
    assert any("optimizer" in k for k in want), sorted(want)[:10]
    import torch

    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, different[:5]

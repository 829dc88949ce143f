"""Checkpoint machinery on one process: atomic dirs, manifest checksums, keep-K, RNG, HDF5 sample buffers,
half-written and damaged checkpoints, layout refusal, SIGKILL during a write."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from milehpc.checkpoint import MANIFEST, Checkpointer, list_checkpoints
from milehpc.errors import ConfigError
from milehpc.samples import Sample, Status
from milehpc.samples.h5 import read_samples_h5, write_samples_h5

REPO = Path(__file__).resolve().parents[1]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4, generator=g)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "cursor": seed * 10, "version": seed}


def _samples() -> list[Sample]:
    return [
        Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5], rollout_logprobs=[-0.1234567890123, -2.5e-300],
               reward={"score": 1.0, "format": 0.5}, status=Status.ABORTED, group=3, index=17, weight_version=4,
               label="42", prompt_text="1+2", response_text="3\n", metadata={"versions": [3, 4]}),
        Sample(prompt_ids=[7], reward=None, status=Status.COMPLETED, label={"a": [1, 2]}, index=18),
        Sample(prompt_ids=[], response_ids=[9] * 5, rollout_logprobs=[float("-inf")] * 5, loss_mask=[1, 0, 0, 1, 1],
               routed_experts=[[[0, 1]], [[2, 3]], [[1, 1]], [[0, 0]], [[3, 2]]], reward=0.75),
    ]


def test_save_and_load_round_trip_is_exact(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ckpt")
    state = _state(1)
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    path = ck.save(3, state, samples={"pending": _samples(), "async_buffer": []}, meta={"weight_version": 3})
    expected = (random.random(), np.random.rand(3).tolist(), torch.rand(3))

    assert path.name == "step-00000003" and (path / MANIFEST).is_file()
    assert oct(os.stat(tmp_path / "ckpt").st_mode & 0o777) == "0o700"
    manifest = json.loads((path / MANIFEST).read_text())
    assert set(manifest["files"]) == {"rank-00000.pt", "rank-00000.h5"}
    assert manifest["meta"] == {"weight_version": 3} and manifest["step"] == 3

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restored = Checkpointer(tmp_path / "ckpt").resume()
    assert restored is not None and restored.info.step == 3
    for key, value in state["model"].items():
        assert torch.equal(restored.state["model"][key], value)
    assert restored.state["optimizer"]["state"][0]["exp_avg"].equal(state["optimizer"]["state"][0]["exp_avg"])
    assert restored.state["cursor"] == 10
    restored.apply_rng()
    got = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    back = restored.samples["pending"]
    assert [s.to_dict() for s in back] == [s.to_dict() for s in _samples()]
    assert restored.samples["async_buffer"] == []


def test_samples_h5_keeps_float64_logprobs_bitwise(tmp_path: Path) -> None:
    lps = [-(1 / 3), -1e-17, -123.456789012345678]
    write_samples_h5(tmp_path / "s.h5", {"partial": [Sample(prompt_ids=[1], response_ids=[2, 3, 4],
                                                            rollout_logprobs=lps)]})
    assert read_samples_h5(tmp_path / "s.h5")["partial"][0].rollout_logprobs == lps


def test_keep_last_k_and_interval_decisions(tmp_path: Path) -> None:
    now = [0.0]
    ck = Checkpointer(tmp_path, keep=2, interval_steps=3, interval_s=100.0, clock=lambda: now[0])
    decisions = {step: ck.at_step_end(step) for step in range(1, 7)}
    assert [s for s, d in decisions.items() if d.save] == [3, 6]
    assert not any(d.stop for d in decisions.values())
    now[0] = 150.0
    timed = ck.at_step_end(7)
    assert timed.save and not timed.stop and timed.reasons == ["every 100 s"]
    req = ck.at_step_end(8, requested=True)
    assert req.save and req.stop
    last = ck.at_step_end(9, requested=True, last=True)
    assert last.save and not last.stop  # nothing left to requeue for
    for step in (3, 6, 7, 8):
        ck.save(step, {"step": step})
    assert [c.step for c in list_checkpoints(tmp_path)] == [8, 7]
    assert ck.at_step_end(10).save is False  # saving reset the clock
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000007", "step-00000008"]


def test_half_written_and_damaged_checkpoints_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ck = Checkpointer(tmp_path)
    ck.keep = 5
    for step in (1, 2, 3):
        ck.save(step, {"step": step})
    # a half-written one (the job died while writing step 4)
    (tmp_path / ".tmp-step-00000004").mkdir()
    (tmp_path / ".tmp-step-00000004" / "rank-00000.pt").write_bytes(b"partial")
    # step 3 damaged in place: same size, different bytes
    shard = tmp_path / "step-00000003" / "rank-00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # step 2 truncated
    shard2 = tmp_path / "step-00000002" / "rank-00000.pt"
    shard2.write_bytes(shard2.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING, logger="milehpc.checkpoint"):
        restored = Checkpointer(tmp_path).resume()
    assert restored is not None and restored.info.step == 1 and restored.state == {"step": 1}
    text = caplog.text
    assert "half-written checkpoint" in text and ".tmp-step-00000004" in text
    assert "step-00000002" in text and "bytes" in text
    assert "sha256 mismatch" in text and "skipping damaged checkpoint step 3" in text
    # the next save at step 4 replaces the leftover and prunes it
    ck.save(4, {"step": 4})
    assert not (tmp_path / ".tmp-step-00000004").exists()
    assert Checkpointer(tmp_path).resume().state == {"step": 4}


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path)
    ck.save(5, {"v": "old"})
    ck.save(5, {"v": "new"})
    assert Checkpointer(tmp_path).resume().state == {"v": "new"}
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000005"]


def test_incompatible_layout_is_refused_in_one_line(tmp_path: Path) -> None:
    layout = {"parallel": {"tp": 1, "dp": 2, "world_size": 3, "trainer_backend": "torch"},
              "model": {"hidden_size": 64}}
    Checkpointer(tmp_path, layout=layout).save(2, {"x": 1})
    other = {"parallel": {"tp": 1, "dp": 4, "world_size": 5, "trainer_backend": "torch"},
             "model": {"hidden_size": 64}}
    with pytest.raises(ConfigError) as err:
        Checkpointer(tmp_path, layout=other).resume()
    msg = str(err.value)
    assert "\n" not in msg and "dp=2->4" in msg and "world_size=3->5" in msg and "cannot reshard" in msg
    assert "manifest.json" in msg
    # a backend that can reshard accepts it
    ok = Checkpointer(tmp_path, layout=other, can_reshard=lambda old, new: old["tp"] == new["tp"]).resume()
    assert ok is not None and ok.resharded
    # a different model is never accepted
    bigger = {"parallel": layout["parallel"], "model": {"hidden_size": 128}}
    with pytest.raises(ConfigError, match="different model .*hidden_size=64->128"):
        Checkpointer(tmp_path, layout=bigger, can_reshard=lambda *_: True).resume()


def test_no_checkpoint_means_fresh_start(tmp_path: Path) -> None:
    assert Checkpointer(tmp_path / "none").resume() is None


_WRITER = textwrap.dedent("""
    import sys, time, torch
    from milehpc import checkpoint as ck
    root = sys.argv[1]
    c = ck.Checkpointer(root, keep=3)
    c.save(1, {"w": torch.full((8,), 1.0)})
    sys.stdout.write("saved 1\\n"); sys.stdout.flush()
    # step 2 is big and written slowly: the parent kills us in the middle
    real_save = torch.save
    def slow_save(obj, f, *a, **k):
        f.write(b"x" * 4096); f.flush()
        sys.stdout.write("writing 2\\n"); sys.stdout.flush()
        time.sleep(60)
    torch.save = slow_save
    c.save(2, {"w": torch.full((8,), 2.0)})
""")


def test_sigkill_during_checkpoint_write_resumes_from_previous(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root)], stdout=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "saved 1"
        assert proc.stdout.readline().strip() == "writing 2"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (root / ".tmp-step-00000002" / "rank-00000.pt").stat().st_size == 4096
    with caplog.at_level(logging.WARNING, logger="milehpc.checkpoint"):
        restored = Checkpointer(root).resume()
    assert restored.info.step == 1 and torch.equal(restored.state["w"], torch.full((8,), 1.0))
    assert "half-written" in caplog.text
    # the run goes on and writes step 2 properly over the leftover
    Checkpointer(root, keep=3).save(2, {"w": torch.full((8,), 2.0)})
    assert [c.step for c in list_checkpoints(root)] == [2, 1]


def test_time_interval_uses_the_clock(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, interval_s=0.05)
    assert not ck.at_step_end(1).save
    time.sleep(0.06)
    assert ck.at_step_end(2).save


def test_resume_run_dir_for_submit_resume(tmp_path: Path) -> None:
    import dataclasses

    from ckpt_helpers import job_toml, prepare_local

    from milehpc.checkpoint import layout_record, resume_run_dir
    from milehpc.errors import MilehpcError
    from milehpc.runtime.launch import load_run_dir

    with pytest.raises(MilehpcError, match="not a milehpc run dir"):
        resume_run_dir(tmp_path)
    run_dir = prepare_local(tmp_path, "run", job_toml(4))
    info = resume_run_dir(run_dir)
    assert info["checkpoint"] is None and info["job_script"].endswith("job.sbatch")  # nothing saved yet: fresh

    job, plan, _ = load_run_dir(run_dir)
    Checkpointer(run_dir / "checkpoints", layout=layout_record(job, plan)).save(3, {}, meta={"weight_version": 3})
    info = resume_run_dir(run_dir)
    assert info["step"] == 3 and info["meta"] == {"weight_version": 3}
    # resubmitted with another layout (e.g. more DP ranks): refused in one line, before anything runs
    wider = dataclasses.replace(plan, dp=2, trainer_ranks=2, world_size=3)
    with pytest.raises(ConfigError) as err:
        resume_run_dir(run_dir, plan=wider)
    assert "dp=1->2" in str(err.value) and "\n" not in str(err.value)

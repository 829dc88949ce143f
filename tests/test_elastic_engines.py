"""Elastic rollout with the REAL SGLang engine (CPU build, scripts/setup-sglang-cpu.sh), as plain local processes:
no multi-node cluster (that one, tests/test_multinode_elastic.py, kills a node under the reference engine).

The local site's job script starts trainer rank 0 (under mpirun) and elastic engine 0, an SGLang engine built by
the engine plugin in a world of one; the test starts engine 1, a reference engine, as a second process joining the
same trainer (a second run directory's view of the same job: its job.json names the reference engine, its
``.milehpc`` is the first one's, with the trainer's address and the job's secret). The reward holds step 0 until
engine 1 has connected, so the order is fixed whatever the load:

* step 0: engine 0 alone. It joined the weight-update group of two SGLang's way and its schedulers took the
  trainer's buckets (``update_weights_from_distributed``): the engine's sampled-token logprobs equal the trainer's
  (check_logprobs) — an engine that kept its random start-up weights ("dummy" load) is off by whole nats;
* step 1: both engines, two prompts each; engine 1 joined at the end of step 0 and got the current weights;
* step 2: engine 0 dies as its node would (``MILEHPC_FAULT=generate:2``: SIGKILL before it generates; its
  schedulers follow it, PR_SET_PDEATHSIG): the trainer names it in one line and deals its two prompts to engine 1;
* step 3: engine 1 alone; the job ends normally.

Every prompt of every step is trained exactly once (the rollout dumps: each prompt index n_samples times, none
missing, none twice), and each dumped sample says which engine generated it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import prepare_local
from sglang_real import require_real_sglang
from tiny_model import TINY_MODEL

pytestmark = [pytest.mark.mpi, pytest.mark.slow(minutes=1)]

HERE = Path(__file__).resolve().parent
STEPS, PROMPTS, SAMPLES = 4, 4, 2
# float32 on both sides: a sampled token's logprob is a log-softmax over the vocabulary of logits that are sums of
# ~hidden (32) products of O(1) values, so the two implementations differ by ~32 * eps(1.2e-7) * |logit| ~ 1e-5 at
# most; 1e-3 keeps a margin of ~100 and is far below what wrong weights give (> 0.1: a random model's logprobs).
LOGPROB_TOL = 1e-3


def held_toy_match(samples: list[Any], partial: float = 1.0) -> list[float]:
    """The toy tasks' reward, after waiting while the file ``MILEHPC_TEST_HOLD`` names exists (the engines score
    their own prompts: this holds the step that engine is in)."""
    from milehpc.data.tasks import toy_match

    hold = os.environ.get("MILEHPC_TEST_HOLD")
    while hold and os.path.exists(hold):
        time.sleep(0.05)
    return [toy_match(s, partial) for s in samples]


held_toy_match.reward_kind = "batch"  # type: ignore[attr-defined]


def _job(hold: Path) -> str:
    return f"""
name = "elastic-sglang"
{TINY_MODEL}
[data]
source = "task:sort"
params = {{ min_len = 2, max_len = 3 }}
[reward]
name = "test_elastic_engines:held_toy_match"
[rollout]
engine = "sglang"
engines = 1
prompts_per_step = {PROMPTS}
n_samples = {SAMPLES}
max_new_tokens = 4
[run]
steps = {STEPS}
check_logprobs = true
[resources]
elastic_rollout = true
collective_timeout_s = 120
[env]
PYTHONPATH = "{HERE}:{HERE.parent}"
MILEHPC_TEST_HOLD = "{hold}"
"""


def _reference_view(run_dir: Path, where: Path) -> Path:
    """A run directory for an engine of the same job built by the reference engine plugin."""
    where.mkdir()
    job = json.loads((run_dir / "job.json").read_text())
    job["rollout"]["engine"] = "reference"
    (where / "job.json").write_text(json.dumps(job))
    for name in ("plan.json", "site.json", "job.toml"):
        shutil.copy(run_dir / name, where / name)
    (where / ".milehpc").symlink_to(run_dir / ".milehpc")
    return where


def _wait_for(pattern: str, log: Path, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout:.0f} s:\n{log.read_text(errors='replace')[-4000:]}")


def _end(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_an_sglang_engine_joins_takes_the_weights_dies_and_its_prompts_are_trained_once(tmp_path: Path) -> None:
    require_real_sglang()
    from milehpc.runtime.elastic import ENGINE_KEY
    from milehpc.samples.dumps import read_rollouts

    hold = tmp_path / "hold"
    hold.touch()
    run_dir = prepare_local(tmp_path, "run", _job(hold))
    log = run_dir / "logs" / "job.out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SGLANG_USE_CPU_ENGINE": "1", "MILEHPC_FAULT": "generate:2"}
    job = subprocess.Popen(["bash", str(run_dir / "job.sbatch")], stdout=log.open("ab"), stderr=subprocess.STDOUT,
                           env=env, cwd=run_dir)
    ref = None
    try:
        host = _wait_for(r"elastic rollout: engine 0 \(on (\S+)\) joined", log, job, 300).group(1)
        view = _reference_view(run_dir, tmp_path / "reference-view")
        ref_env = {k: v for k, v in env.items() if k != "MILEHPC_FAULT"}
        ref_env.update(PYTHONPATH=f"{HERE}:{HERE.parent}", MILEHPC_TEST_HOLD=str(hold))
        ref = subprocess.Popen([sys.executable, "-m", "milehpc", "launch", str(view), "--elastic", "engine",
                                "--engine-base", "1"], stdout=log.open("ab"), stderr=subprocess.STDOUT,
                               env=ref_env, cwd=view)
        _wait_for(r"engine 1 \(on \S+\) connected; it joins after step 0", log, job, 120)
        hold.unlink()
        assert job.wait(timeout=240) == 0, log.read_text(errors="replace")[-4000:]
        assert ref.wait(timeout=30) == 0, log.read_text(errors="replace")[-4000:]  # told to stop at the end
    finally:
        _end(job)
        _end(ref)
    text = log.read_text(errors="replace")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [int(r["rollout/engines"]) for r in records] == [1, 2, 1, 1], text[-3000:]
    assert [int(r["rollout/engines_lost"]) for r in records] == [0, 0, 1, 0]
    assert [int(r["rollout/prompts_redone"]) for r in records] == [0, 0, 2, 0]  # engine 0's share of step 2
    lost = [line for line in text.splitlines() if "elastic rollout: lost" in line]
    assert len(lost) == 1 and lost[0].startswith(f"milehpc: elastic rollout: lost engine 0 (on {host}): its "
                                                 f"connection ended"), lost
    assert "during step 2: its 2 unfinished prompt(s) go to the others" in lost[0], lost
    # The SGLang engine took the trainer's weights into its schedulers: its logprobs are the trainer's.
    assert re.search(r"SGLang engine 0 joined weight-update group milehpc_elastic_e0_j1 \(stage 0, rank 1 of 2\)",
                     text), text[-3000:]
    diffs = [r["train/logprob_diff_max"] for r in records[:2]]
    assert all(d < LOGPROB_TOL for d in diffs), diffs
    # Every prompt trained exactly once, by the engine the dealing says.
    made_by: dict[int, set[int]] = {}
    for step in range(STEPS):
        samples, _ = read_rollouts(run_dir, step)
        groups = sorted(s.group for s in samples)
        assert groups == sorted(list(range(step * PROMPTS, (step + 1) * PROMPTS)) * SAMPLES), (step, groups)
        for s in samples:
            made_by.setdefault(s.group, set()).add(s.metadata[ENGINE_KEY])
    assert all(len(e) == 1 for e in made_by.values()), made_by
    by_engine = {g: e.pop() for g, e in sorted(made_by.items())}
    assert by_engine == {0: 0, 1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 6: 1, 7: 1, 8: 1, 9: 1, 10: 1, 11: 1, 12: 1, 13: 1,
                         14: 1, 15: 1}, by_engine

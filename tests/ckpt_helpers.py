"""Shared by the tests that run the real RL job (tests/test_ckpt_*.py, tests/test_stop_loop.py,
tests/test_slurm_stop.py): the job, its reward (optionally slowed down so that a signal or stop lands mid-run),
reading final parameters.
The ranks import this module (PYTHONPATH = tests/) for the reward."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def slow_toy_match(samples: list[Any], partial: float = 1.0) -> list[float]:
    """The toy tasks' reward with partial credit (rewards differ within a group, so every step trains), after
    sleeping ``MILEHPC_TEST_REWARD_DELAY`` seconds once per batch: a step then takes about that long, whatever
    the machine's load, and the parameters do not depend on it. A requeued Slurm job (SLURM_RESTART_COUNT > 0)
    does not sleep: only the first run has to outlast the wall-time signal. With
    ``MILEHPC_TEST_REWARD_DELAY_WHILE=PATH`` it sleeps only while that file exists: a test that stopped the run
    deletes it, and the resumed run goes at full speed."""
    from milehpc.data.tasks import toy_match

    delay = float(os.environ.get("MILEHPC_TEST_REWARD_DELAY", "0") or 0)
    marker = os.environ.get("MILEHPC_TEST_REWARD_DELAY_WHILE")
    if delay and os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0") and (not marker or os.path.exists(marker)):
        time.sleep(delay)
    return [toy_match(s, partial) for s in samples]


slow_toy_match.reward_kind = "batch"  # type: ignore[attr-defined]


def job_toml(steps: int, *, extra: str = "", env: dict[str, str] | None = None, time_limit: str = "01:00:00",
             add: dict[str, str] | None = None) -> str:
    """1 trainer + 1 rollout rank, sync loop, partial rollouts, KL, cosine LR: every piece of state matters.
    ``add`` = {table: lines} sets keys of a table (replacing the ones it already has)."""
    env_lines = "\n".join(f'{k} = "{v}"' for k, v in {"PYTHONPATH": f"{HERE}:{REPO}", **(env or {})}.items())
    text = _JOB.format(steps=steps, time_limit=time_limit, extra=extra, env_lines=env_lines)
    for table, lines in (add or {}).items():
        head, sep, rest = text.partition(f"[{table}]\n")
        assert sep, table
        body, nxt, tail = rest.partition("\n[")
        keys = {line.split("=")[0].strip() for line in lines.strip().splitlines()}
        body = "\n".join(line for line in body.splitlines() if line.split("=")[0].strip() not in keys)
        text = f"{head}{sep}{lines.strip()}\n{body}{nxt}{tail}"
    return text


_JOB = """
name = "ckpt-job"
[model]
hidden_size = 32
num_layers = 1
num_heads = 2
num_kv_heads = 1
intermediate_size = 64
max_position_embeddings = 64
[data]
source = "task:sort"
params = {{ min_len = 3, max_len = 4 }}
[reward]
name = "ckpt_helpers:slow_toy_match"
[rollout]
prompts_per_step = 4
n_samples = 4
max_new_tokens = 6
partial_rollout = true
[trainer]
micro_batch_size = 32
lr = 1e-3
lr_schedule = "cosine"
[algorithm]
kl_coef = 0.01
[run]
steps = {steps}
loop = "sync"
seed = 5
[resources]
collective_timeout_s = 60
time = "{time_limit}"
{extra}
[env]
{env_lines}
"""


def prepare_local(tmp: Path, name: str, toml: str) -> Path:
    """Write a run directory for the local site, as `milehpc submit` does (without starting it)."""
    from milehpc.render.rundir import prepare, write_run_dir

    job_file = tmp / f"{name}.toml"
    job_file.write_text(toml)
    return write_run_dir(prepare(str(job_file), "local", run_dir=str(tmp / name), python=sys.executable))


def start_script(run_dir: Path) -> subprocess.Popen[bytes]:
    """Run the rendered job script (mpirun inside) as a child of this test."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (run_dir / "logs" / "job.out").open("ab")
    return subprocess.Popen(["bash", str(run_dir / "job.sbatch")], stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=run_dir)


def final_state(run_dir: Path, steps: int) -> dict[str, Any]:
    """Trainer rank 0's model parameters and optimizer state in the run's final checkpoint."""
    import torch

    from milehpc.checkpoint import list_checkpoints

    newest = list_checkpoints(run_dir / "checkpoints")[0]
    assert newest.step == steps, f"the newest checkpoint is step {newest.step}, not the end ({steps})"
    trainer = torch.load(newest.path / "rank-00000.pt", weights_only=True)["state"]["trainer"]["trainer"]
    out = dict(trainer["model"])
    for p, d in trainer["optimizer"]["state"].items():
        out.update({f"opt.{p}.{k}": v for k, v in d.items() if torch.is_tensor(v)})
    return out


def differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    import torch

    assert want.keys() == got.keys()
    return [k for k in want if not torch.equal(want[k], got[k])]

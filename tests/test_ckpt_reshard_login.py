"""Login side of resuming at another trainer layout: the trainer plugin declares whether it can reshard, and
``milehpc submit --resume RUN_DIR --set trainer.tp=2`` (dry run and real path) accepts a Megatron run and refuses a
torch-trainer run in one line with exit code 2, before anything is rewritten or started. The run dirs are written
by the real ``prepare``/``write_run_dir`` and hold a real (small) checkpoint written by the real Checkpointer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_model import TINY_MODEL

from milehpc.checkpoint import Checkpointer, CheckpointInfo, layout_record, reshard_check, resume_run_dir
from milehpc.config.load import load_job
from milehpc.render.rundir import prepare, write_run_dir
from milehpc.runtime.loop.checkpointing import LoopCheckpoint
from milehpc.train.megatron.checkpoint import can_reshard

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

JOB = """
name = "reshard-{backend}"
""" + TINY_MODEL + """[trainer]
backend = "{backend}"
[run]
steps = 4
[site]
ranks_per_node = 8
"""


def _run_dir(tmp_path: Path, backend: str) -> Path:
    """A run dir as `milehpc submit` writes it, with a complete checkpoint after step 2 at TP=1."""
    job_file = tmp_path / f"{backend}.toml"
    job_file.write_text(textwrap.dedent(JOB.format(backend=backend)))
    prep = prepare(str(job_file), "local", run_dir=str(tmp_path / f"run-{backend}"))
    rdir = write_run_dir(prep)
    Checkpointer.for_job(prep.job, prep.plan, rdir).save(2, {"trainer": {}}, meta={"steps_done": 2})
    return rdir


def _submit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "milehpc"), "submit", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, cwd=ROOT)


def test_trainer_plugins_declare_resharding() -> None:
    jobs = {b: SimpleNamespace(trainer=SimpleNamespace(backend=b)) for b in ("megatron", "torch", "nonesuch")}
    assert reshard_check(jobs["megatron"]) is can_reshard
    assert reshard_check(jobs["torch"]) is None and reshard_check(jobs["nonesuch"]) is None
    base = {"trainer_backend": "megatron", "world_size": 2, "trainer_ranks": 1, "tp": 1, "pp": 1, "dp": 1,
            "rollout_ranks": 1, "engines": 1, "colocated": False}
    assert can_reshard(base, {**base, "world_size": 3, "trainer_ranks": 2, "tp": 2})
    assert can_reshard(base, {**base, "tp": 2, "dp": 2, "pp": 2, "world_size": 9, "trainer_ranks": 8})
    assert not can_reshard(base, {**base, "engines": 2, "rollout_ranks": 2})  # rollout layout is per rank
    assert not can_reshard(base, {**base, "ep": 2})
    torch_base = {**base, "trainer_backend": "torch"}
    assert not can_reshard(torch_base, {**torch_base, "dp": 2, "trainer_ranks": 2, "world_size": 3})


@pytest.mark.parametrize("extra", [(), ("--dry-run",)])
def test_submit_resume_at_another_tp_accepts_megatron_refuses_torch(tmp_path: Path, extra: tuple[str, ...]) -> None:
    torch_dir = _run_dir(tmp_path, "torch")
    plan_before = (torch_dir / "plan.json").read_text()
    proc = _submit("--resume", str(torch_dir), "--site", "local", "--set", "trainer.tp=2", *extra)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "another rank layout" in lines[0] and "tp=1->2" in lines[0], lines[0]
    assert "torch trainer cannot reshard it" in lines[0] and "manifest.json" in lines[0], lines[0]
    assert (torch_dir / "plan.json").read_text() == plan_before  # nothing rewritten
    assert not (torch_dir / ".milehpc" / "local.pid").exists()  # nothing started
    # At the layout it was written with, the torch run resumes.
    assert resume_run_dir(torch_dir)["step"] == 2

    if not extra:
        return  # the real path of an accepted Megatron resume starts the job: tests/test_ckpt_reshard_mpi.py
    mega_dir = _run_dir(tmp_path, "megatron")
    proc = _submit("--resume", str(mega_dir), "--site", "local", "--set", "trainer.tp=2", "--json", *extra)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)["resume_from"]
    assert found["step"] == 2 and found["resharded"] is True
    assert "tp=2" in json.loads(proc.stdout)["plan"]["trainer"]
    # A different model is refused even by a trainer that reshards.
    proc = _submit("--resume", str(mega_dir), "--site", "local", "--set", "model.hidden_size=64", *extra)
    assert proc.returncode == 2 and "different model" in proc.stderr, proc.stderr


def _saved_at(layout: dict) -> CheckpointInfo:
    return CheckpointInfo(Path("step-00000002"), 2, {"layout": layout})


def test_loop_sources_map_roles_of_a_resharded_checkpoint(tmp_path: Path) -> None:
    """Which saved rank each part of a rank's state comes from (LoopCheckpoint.sources)."""
    rdir = _run_dir(tmp_path, "megatron")
    saved_job = load_job(str(rdir / "job.toml"))
    saved_plan = prepare(str(rdir / "job.toml"), "local").plan
    saved = layout_record(saved_job, saved_plan)  # TP=1: trainer rank 0, rollout rank 1
    new = prepare(str(rdir / "job.toml"), "local", ("trainer.tp=2",))
    assert new.plan.world_size == 3

    def sources(rank: int) -> dict[str, int]:
        ck = LoopCheckpoint(new.job, rdir, plan=new.plan)
        ck.rank = rank  # the rank this object would be on (no MPI here)
        return ck.sources(_saved_at(saved))

    assert sources(0) == {"trainer": 0, "rng": 0}  # trainer rank 0 keeps everything of its own
    assert sources(1) == {"trainer": 0}  # a new trainer rank: rank 0's loop state, a derived RNG stream
    assert sources(2) == {"rollout": 1, "rng": 1}  # the rollout rank moved from rank 1 to rank 2
    same = LoopCheckpoint(saved_job, rdir, plan=saved_plan)
    same.rank = 1
    assert same.sources(_saved_at(saved)) == {"trainer": 1, "rollout": 1, "rng": 1}  # identity at its layout


def test_loop_sources_colocated_keep_each_ranks_rollout_state(tmp_path: Path) -> None:
    """Colocated (every rank both): TP=2 -> TP=1 x DP=2 keeps the world and the engines, so every rank keeps its
    own rollout state and RNG and takes the trainer's loop state from rank 0."""
    rdir = _run_dir(tmp_path, "megatron")
    colo = ("resources.colocate=true", "rollout.engines=2")
    saved_prep = prepare(str(rdir / "job.toml"), "local", (*colo, "trainer.tp=2"))
    new = prepare(str(rdir / "job.toml"), "local", (*colo, "trainer.dp=2"))
    assert saved_prep.plan.colocated and new.plan.world_size == saved_prep.plan.world_size == 2
    saved = layout_record(saved_prep.job, saved_prep.plan)
    assert can_reshard(saved["parallel"], layout_record(new.job, new.plan)["parallel"])
    got = []
    for rank in (0, 1):
        ck = LoopCheckpoint(new.job, rdir, plan=new.plan)
        ck.rank = rank
        got.append(ck.sources(_saved_at(saved)))
    assert got == [{"trainer": 0, "rollout": 0, "rng": 0}, {"trainer": 0, "rollout": 1, "rng": 1}]


def test_submit_resume_without_site_goes_back_to_the_runs_own_site(tmp_path: Path) -> None:
    """The job scripts print `milehpc submit --resume RUN_DIR` with no --site: it resumes on the site the run was
    rendered for (its site.json), not on whatever this host detects as (else `local`)."""
    job_file = tmp_path / "job.toml"
    job_file.write_text(textwrap.dedent(JOB.format(backend="torch")))
    prep = prepare(str(job_file), "local-slurm", run_dir=str(tmp_path / "run"))
    rdir = write_run_dir(prep)
    Checkpointer.for_job(prep.job, prep.plan, rdir).save(2, {"trainer": {}}, meta={"steps_done": 2})
    proc = _submit("--resume", str(rdir), "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    script = json.loads(proc.stdout)["script"]
    assert "#SBATCH --partition=" in script, script[:400]  # local-slurm's script, not the local site's

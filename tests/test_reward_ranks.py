"""Issue 35 items 1, 3, 4: the reward model on ranks of its own (``[reward_model]``, a third MPI group).

Login side (quick): the reward group in ``plan --ranks``, the rendered sbatch script and the memory table on a shipped
GPU site, and one line (exit 2) for each bad value. The supervised scorer: a stalled or killed scorer is restarted and
its samples scored again or dropped, never scored 0. A real mpirun job (1 trainer, 2 rollout engines, 1 reward rank,
the reference engine, a tiny classifier RM built here) whose scorer process is killed in step 1: the job goes on, the
step's samples are scored again and counted, and every dumped sample's reward is the RM's own logit."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_model import TINY_MODEL

from milehpc.cli import cli

GPU_SITE = "dgx-h100-like"  # 8 x H100 80 GB per node
RM_SHAPE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory) -> Path:
    """A random-init Qwen2 sequence classifier with a ChatML tokenizer (the RM reads the chat template)."""
    import torch
    from tiny_tokenizer import build_tokenizer_folder
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    out = build_tokenizer_folder(tmp_path_factory.mktemp("rm"))
    tok = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), num_labels=1, pad_token_id=tok.pad_token_id, **RM_SHAPE)
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    return out


def job_text(rm: Path, *, rollout: str = "", trainer: str = "", reward_model: str = "", extra: str = "") -> str:
    """The test job: 2 reference engines, the RM scored on a reward rank; each table's extra lines appended."""
    return textwrap.dedent(f"""
        name = "rm-ranks"
        [data]
        source = "task:reverse"
        params = {{ min_len = 1, max_len = 5 }}
        [rollout]
        engines = 2
        prompts_per_step = 4
        n_samples = 2
        max_new_tokens = 6
        temperature = 0.8
        {rollout}
        [trainer]
        micro_batch_size = 8
        {trainer}
        [reward]
        name = "reward_model"
        params = {{ path = "{rm}" }}
        [reward_model]
        path = "{rm}"
        {reward_model}
    """) + TINY_MODEL + textwrap.dedent(extra)


def _cli(*args: str):
    return CliRunner().invoke(cli, list(args))


# ---- login side -------------------------------------------------------------------------------------------------

def test_reward_group_in_the_plan_script_and_memory_on_a_gpu_site(rm_folder: Path, tmp_path: Path) -> None:
    """2 trainer ranks, 2 rollout engines of 2 GPUs, 2 reward engines of 2 GPUs: one 8-GPU node, reward ranks 6-9
    would straddle it, so the plan aligns: trainer 0-1, rollout 2-5, reward 6-9 on a second node."""
    import torch
    from transformers import AutoModelForSequenceClassification

    job = tmp_path / "job.toml"
    job.write_text(job_text(rm_folder, rollout="gpus_per_engine = 2", trainer="dp = 2",
                            reward_model="engines = 2\ngpus_per_engine = 2"))
    res = _cli("plan", str(job), "--site", GPU_SITE, "--ranks", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    plan = data["plan"]
    assert (plan["world_size"], plan["trainer_ranks"], plan["rollout_ranks"], plan["reward_ranks"]) == (10, 2, 4, 4)
    roles = [(r["rank"], r["role"], r["node"], r["engine"], r["gpus"]) for r in data["ranks"]]
    assert [r[1] for r in roles] == ["trainer"] * 2 + ["rollout"] * 4 + ["reward"] * 4
    assert roles[6:] == [(6, "reward", 0, 0, [6]), (7, "reward", 0, 0, [7]), (8, "reward", 1, 1, [0]),
                         (9, "reward", 1, 1, [1])]
    assert data["summary"]["reward"] == "ranks 6-9 (2 engine(s) x 2)"
    # the memory table: a reward row whose weights are the RM's real parameters in fp32
    model = AutoModelForSequenceClassification.from_pretrained(rm_folder)
    params = sum(p.numel() for p in model.parameters())
    reward_rows = {r["item"]: r for r in data["memory"] if r["rank"] == "reward"}
    assert reward_rows["reward model weights"]["bytes"] == params * torch.finfo(torch.float32).bits // 8
    assert reward_rows["total"]["budget_bytes"] == int(79.6 * (1 << 30))  # the H100's memory, not a CPU node
    text = _cli("plan", str(job), "--site", GPU_SITE, "--ranks")
    assert text.exit_code == 0 and re.search(r"│ 9\s+│ reward\s+│ 1 ", text.stdout), text.stdout
    # the rendered sbatch script: every rank in the one srun, and the header says where the reward model runs
    script = _cli("submit", str(job), "--site", GPU_SITE, "--dry-run", "--run-dir", str(tmp_path / "r"))
    assert script.exit_code == 0, script.output
    assert "#SBATCH --nodes=2" in script.stdout and "#SBATCH --ntasks=10" in script.stdout
    assert "# reward model: ranks 6-9 (2 engine(s) x 2)" in script.stdout
    assert re.search(r"srun .*--ntasks=10", script.stdout)


def test_colocated_reward_model_adds_no_ranks_and_counts_in_the_rollout_rank(rm_folder: Path, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(job_text(rm_folder, reward_model='colocate = "rollout"'))
    alone = tmp_path / "alone.toml"
    alone.write_text(job_text(rm_folder).replace(f'[reward_model]\npath = "{rm_folder}"', "[reward_model]"))
    data, base = (json.loads(_cli("plan", str(j), "--site", GPU_SITE, "--json").stdout) for j in (job, alone))
    assert data["plan"]["world_size"] == base["plan"]["world_size"] == 3 and data["plan"]["reward_ranks"] == 0
    assert data["summary"]["reward"] == "on the rollout engine leaders (2 scorer(s))"
    rollout = {r["item"]: r["bytes"] for r in data["memory"] if r["rank"] == "rollout"}
    without = {r["item"]: r["bytes"] for r in base["memory"] if r["rank"] == "rollout"}
    # off the device while the engine generates: in the KV cache's place (tests/test_judge_engines.py: max, not sum)
    assert "KV cache | reward model" in rollout and "KV cache" in without and "KV cache" not in rollout
    assert rollout["KV cache | reward model"] == max(without["KV cache"], rollout["KV cache | reward model"])
    assert rollout["total"] == without["total"] - without["KV cache"] + rollout["KV cache | reward model"]
    assert rollout["total"] > without["total"]  # this RM is larger than the cache


@pytest.mark.parametrize(("sets", "field", "expect"), [
    (["reward_model.kind=judge"], "reward_model.kind", "expected one of"),
    (["reward_model.engines=0"], "reward_model.engines", "expected a value >= 1"),
    (["reward_model.batch_size=0"], "reward_model.batch_size", "expected a value >= 1"),
    (["reward_model.colocate=trainer"], "reward_model.colocate", "expected one of"),
    (["reward_model.colocate=rollout", "reward_model.engines=2"], "reward_model.engines", "colocate"),
    (["reward_model.kind=generative"], "reward.name", "'judge' scorer"),
    (["reward_model.path=/elsewhere"], "reward.params.path", "reward_model.path ('/elsewhere')"),
    (["reward_model.gpus_per_engine=3"], "reward_model.gpus_per_engine", "divide the 8 GPUs"),
    (["rollout.engines=3"], "reward_model.gpus_per_engine", None),  # fits: 1 + 3 ranks, reward rank 4
    (["reward_model.gpus_per_engine=8"], "reward_model.gpus_per_engine", "make the trainer and rollout ranks"),
    (["resources.colocate=true", "rollout.engines=1"], "reward_model.colocate", "resources.colocate = true"),
])
def test_bad_reward_model_values_are_one_line(rm_folder: Path, tmp_path: Path, sets: list[str], field: str,
                                              expect: str | None) -> None:
    job = tmp_path / "job.toml"
    job.write_text(job_text(rm_folder))
    res = _cli("plan", str(job), "--site", GPU_SITE, *[a for s in sets for a in ("--set", s)])
    if expect is None:
        assert res.exit_code == 0, res.output
        return
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and str(job) in lines[0] and f": {field}: " in lines[0] and expect in lines[0], res.stderr
    assert "Traceback" not in res.output


# ---- the supervised scorer (a real child process) ---------------------------------------------------------------

def _samples(n: int) -> list:
    from milehpc.samples import Sample

    return [Sample(prompt_ids=[1], response_ids=[2], prompt_text="reverse:12=", response_text=t, label="21",
                   index=i) for i, t in enumerate(["21", "12", "2", "21x"][:n])]


def test_stalled_scorer_is_restarted_then_its_samples_dropped_never_zero(monkeypatch, tmp_path: Path) -> None:
    """A scorer that answers nothing within reward_model.timeout_s is killed and restarted (reported by name); with
    reward_model.retries = 0 its batch is dropped: FAILED with the reason, counted; no made-up score. (Scoring
    again after a failure: the next test and the MPI job.)"""
    from milehpc.config.job import RewardSpec
    from milehpc.config.reward_model import RewardModelSpec
    from milehpc.rollout.scorer_process import SupervisedScorer

    helper = tmp_path / "slow_reward.py"
    helper.write_text("import time\n\ndef slow(sample):  # stalls on the test's samples (not the start-up's)\n"
                      "    time.sleep(60 if sample.label == '21' else 0)\n    return 1.0\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    spec = RewardModelSpec(path="unused", timeout_s=1.0, retries=0)
    scorer = SupervisedScorer(spec, RewardSpec(name="slow_reward:slow", timeout_s=0), None, name="reward rank 9")
    try:
        t0 = time.monotonic()
        out = scorer.score(_samples(2), step=4)
        took = time.monotonic() - t0
    finally:
        scorer.shutdown()
    assert scorer.restarts == 1  # the stalled scorer was killed and restarted (ready for the next batch)
    assert all(o.reward is None and o.dropped and o.tries == 1 for o in out)
    assert "reward rank 9" in out[0].error and "no answer to score within 1 s" in out[0].error
    assert took < 30  # the 60-s reward was cut at the timeout


def test_killed_scorer_is_restarted_and_with_no_retries_its_samples_dropped(monkeypatch, capsys) -> None:
    """MILEHPC_FAULT=scorer:STEP kills the scorer process as it takes step STEP's batch: it is restarted, and with
    reward_model.retries = 0 the batch's samples are dropped, the death named (scoring again: the MPI job)."""
    from milehpc import faults
    from milehpc.config.job import RewardSpec
    from milehpc.config.reward_model import RewardModelSpec
    from milehpc.rollout.scorer_process import SupervisedScorer

    monkeypatch.setenv("MILEHPC_FAULT", "scorer:3")
    faults._armed.cache_clear()
    scorer = SupervisedScorer(RewardModelSpec(path="unused", retries=0), RewardSpec(name="exact_match"), None,
                              name="reward rank 5")
    try:
        assert [o.reward for o in scorer.score(_samples(2), step=2)] == [1.0, 0.0]  # not armed for step 2
        out = scorer.score(_samples(4), step=3)
        assert [o.reward for o in scorer.score(_samples(2), step=3)] == [1.0, 0.0]  # restarted, killed only once
    finally:
        scorer.shutdown()
        faults._armed.cache_clear()
    assert scorer.restarts == 1
    assert all(o.reward is None and o.dropped and "killed by SIGKILL" in o.error for o in out)
    assert "reward rank 5: scorer failed on 4 sample(s) of step 3" in capsys.readouterr().out


# ---- the MPI job ------------------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_killed_scorer_mid_step_the_job_goes_on_and_no_sample_scores_zero(rm_folder: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from milehpc.samples.dumps import read_rollouts

    job = tmp_path / "job.toml"
    # batches of 4 = two prompts' samples: the call the fault kills leaves other parts queued behind it
    job.write_text(job_text(rm_folder, reward_model="batch_size = 4", extra="""
        [run]
        steps = 3
        loop = "one_step_off"  # batch k+1 generates (and is scored) while step k trains and checkpoints
        [resources]
        collective_timeout_s = 60
        [checkpoint]
        interval_steps = 1  # the reward rank drains and joins a checkpoint after every step
        keep = 3
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILEHPC_PROGRESS": "plain", "MILEHPC_FAULT": "scorer:1",
           "MILEHPC_HEARTBEAT_TIMEOUT": "60"}  # a loaded CI machine can delay a heartbeat
    milehpc = Path(sys.executable).with_name("milehpc")
    proc = subprocess.run([str(milehpc), "run", str(job), "--site", "local", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = records[0]
    assert (first["dist/mpi_world_size"], first["dist/trainer_world_size"]) == (4, 1)
    assert (first["dist/rollout_ranks"], first["dist/reward_ranks"]) == (2, 1)
    assert [r["step"] for r in records] == [0, 1, 2]
    by_step = {r["step"]: r for r in records}
    # step 1: the scorer died once, the batch it held was scored again, nothing dropped or failed
    assert by_step[1]["reward/restarts"] == 1 and by_step[1]["reward/rescored"] > 0
    assert all(r["reward/dropped"] == 0 and r["reward/failed"] == 0 and r["rollout/failed"] == 0 for r in records)
    assert by_step[0]["reward/restarts"] == by_step[2]["reward/restarts"] == 0
    assert all(r["rollout/samples"] == 8 for r in records)
    # the death reported by name, the restart, and batches that held both rollout ranks' samples
    out = proc.stdout
    assert "milehpc: reward rank 3 (reward engine 0): reward group of 1 rank(s), scoring for rollout engine " \
           "leader(s) [1, 2]" in out, out[-3000:]
    assert re.search(r"reward rank 3 \(reward engine 0\): scorer failed on \d+ sample\(s\) of step 1: engine process "
                     r"\d+ died during score \(killed by SIGKILL\); restarting it and scoring them again", out), out[-3000:]
    summary = re.search(r"reward rank 3 \(reward engine 0\): scored (\d+) sample\(s\) in (\d+) call\(s\), (\d+) of "
                        r"them across rollout ranks; 1 scorer restart\(s\)", out)
    assert summary is not None, out[-3000:]
    # 3 steps x 8 samples, each answered once; some calls gathered both leaders' parts
    assert int(summary[1]) == 24 and int(summary[3]) >= 1  # each sample scored once (its retry not counted twice)
    # item 4: the checkpoints after each step hold every rank's shard, the reward rank's too (its pending work was
    # drained: the leaders' batches were fully scored before they joined; nothing scored twice, above)
    for step in (1, 2, 3):
        manifest = json.loads((tmp_path / "run" / "checkpoints" / f"step-{step:08d}" / "manifest.json").read_text())
        assert manifest["step"] == step and manifest["world_size"] == 4
    assert (tmp_path / "run" / "checkpoints" / "step-00000003" / "rank-00003.pt").is_file()
    # every sample's reward is the RM's own logit on its chat-template text: none is a made-up 0
    tok = AutoTokenizer.from_pretrained(rm_folder)
    model = AutoModelForSequenceClassification.from_pretrained(rm_folder).eval()
    eps = torch.finfo(torch.float32).eps
    for step in (0, 1, 2):
        samples, _ = read_rollouts(tmp_path / "run", step)
        assert len(samples) == 8
        for s in samples:
            text = tok.apply_chat_template([{"role": "user", "content": s.prompt_text},
                                            {"role": "assistant", "content": s.response_text}], tokenize=False)
            with torch.no_grad():
                want = model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
            # fp32 rounding of a 2-layer, 32-wide forward pass, padded in a batch vs alone (as in
            # tests/test_reward_model_scorers.py)
            got = s.reward["score"] if isinstance(s.reward, dict) else s.reward
            assert got == pytest.approx(want, abs=64 * eps * max(1.0, abs(want))), (step, s.index)
            assert not math.isclose(want, 0.0, abs_tol=1e-6)  # so an invented 0 could not pass for it

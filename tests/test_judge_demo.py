"""The CPU example of a generative judge (issue 35 item 5): examples/sort_judge.py trains a tiny causal LM from the
sorting task itself to write a verdict ("...=1" right, "...=0" wrong) that the ``judge`` reward parses; here it is
trained once (a smaller step budget than the example's), its greedy verdicts checked on held-out right answers and
near misses, and a real 2-step mpirun job (``milehpc run --site local``) runs it on a ``[reward_model] kind =
"generative"`` reward rank of its own: every dumped sample's reward is the judge's parsed verdict, none failed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_model import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
STEPS = 1000  # the test's training budget (the example trains 1500 steps)
TEMPLATE = "{prompt}{response}:"


def sort_judge():
    if "sort_judge" in sys.modules:
        return sys.modules["sort_judge"]
    spec = importlib.util.spec_from_file_location("sort_judge", ROOT / "examples" / "sort_judge.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sort_judge"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def judge(tmp_path_factory) -> tuple[Path, dict[str, float]]:
    """The judge trained here (seed 0, STEPS steps) and its held-out accuracies."""
    out = tmp_path_factory.mktemp("judge")
    return out, sort_judge().train(out, steps=STEPS, seed=0, log=lambda line: None, held_out=128)


@pytest.mark.slow(minutes=0.5)
def test_judge_verdicts_on_held_out_right_answers_and_near_misses(judge) -> None:
    _, acc = judge
    print(f"judge after {STEPS} steps: {acc}")
    # Measured at STEPS, 128 answers per kind: seed 0 right 1.0, changed 0.83, the other kinds 0.97-1.0; seed 1 right
    # 1.0, changed 0.95, the others 0.99-1.0. The bars sit ~3 standard errors (0.03 at 128) below the worst seed.
    assert acc["right"] >= 0.95, acc
    assert acc["changed"] >= 0.75, acc  # the near misses still sorted: only the prompt's digits tell them wrong
    assert min(acc[k] for k in ("order", "dropped", "added", "echo", "junk")) >= 0.9, acc


@pytest.mark.mpi
def test_judge_on_a_reward_rank_scores_every_sample_with_its_parsed_verdict(judge, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from milehpc.samples.dumps import read_rollouts

    folder, _ = judge
    sj = sort_judge()
    job = tmp_path / "job.toml"
    job.write_text(textwrap.dedent(f"""
        name = "judge-ranks"
        [data]
        source = "task:sort"
        params = {{ min_len = 3, max_len = 3 }}
        [rollout]
        prompts_per_step = 4
        n_samples = 2
        max_new_tokens = 4
        temperature = 1.0
        [trainer]
        micro_batch_size = 8
        [reward]
        name = "judge"
        params = {{ path = "{folder}", template = "{TEMPLATE}", answer_pattern = '{sj.ANSWER_PATTERN}', retries = 0 }}
        [reward_model]
        path = "{folder}"
        kind = "generative"
        [run]
        steps = 2
        [resources]
        collective_timeout_s = 60
    """) + TINY_MODEL)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILEHPC_PROGRESS": "plain", "MILEHPC_HEARTBEAT_TIMEOUT": "60"}
    milehpc = Path(sys.executable).with_name("milehpc")
    proc = subprocess.run([str(milehpc), "run", str(job), "--site", "local", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert (records[0]["dist/mpi_world_size"], records[0]["dist/reward_ranks"]) == (3, 1)
    assert all(r["reward/failed"] == 0 and r["rollout/failed"] == 0 and r["rollout/samples"] == 8 for r in records)
    # Every sample's reward is the verdict the judge writes for it greedily, parsed: asked again here.
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    verdicts = []
    for step in (0, 1):
        samples, _ = read_rollouts(tmp_path / "run", step)
        assert len(samples) == 8
        prompts = [TEMPLATE.format(prompt=s.prompt_text, response=s.response_text) for s in samples]
        for s, answer in zip(samples, sj.greedy_answers(model, tok, prompts), strict=True):
            want = float(sj.verdict(answer))
            assert isinstance(s.reward, dict) and s.reward["judge_retries"] == 0.0, (step, s.index, s.reward)
            assert s.reward["judge_answer"] == s.reward["score"] == want, (step, s.index, s.reward, answer)
            verdicts.append(want)
    print(f"judge verdicts on the reward rank: {verdicts}")

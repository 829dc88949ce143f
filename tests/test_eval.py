"""Evaluation on held-out prompts (issue 16 item 3): the pass@k estimator and the per-source aggregation against
hand-worked values, the [eval] table's checks, and a local run with run.eval_every that logs eval/* to the JSONL
file and TensorBoard while training exactly as without it. The mpirun half (one-step-off loop, separate ranks,
`milehpc eval` on its checkpoint) is in tests/test_loop_mpi.py, in a launch that was there already."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from milehpc.config.load import job_from_dict
from milehpc.errors import ConfigError
from milehpc.rollout.evaluate import PromptResult, eval_metrics, merge_results, pass_at_k

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
        "max_position_embeddings": 64}


def write_val(path: Path, n: int = 10) -> Path:
    """Held-out prompts of two data sources (sort and reverse), both scored with partial credit."""
    rng = random.Random(7)
    rows = []
    for i in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 3)))
        if i % 2:
            rows.append({"prompt": f"sort:{digits}=", "label": "".join(sorted(digits)), "data_source": "sorting"})
        else:
            rows.append({"prompt": f"rev:{digits}=", "label": digits[::-1], "data_source": "reversing"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- the maths ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("n", "c", "k", "want"), [
    (5, 2, 1, 2 / 5),              # pass@1 = c / n
    (5, 2, 2, 1 - 3 / 10),         # 1 - C(3,2)/C(5,2)
    (4, 1, 3, 1 - 1 / 4),          # 1 - C(3,3)/C(4,3)
    (10, 3, 5, 1 - 21 / 252),      # 1 - C(7,5)/C(10,5)
    (5, 0, 3, 0.0),
    (3, 2, 2, 1.0),                # n - c < k: some k-subset always holds a correct answer
    (4, 4, 4, 1.0),
])
def test_pass_at_k_is_the_unbiased_estimator(n: int, c: int, k: int, want: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="n=3 c=4 k=1"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="k=4"):
        pass_at_k(3, 1, 4)


def test_metrics_per_source_and_overall_by_hand() -> None:
    results = [
        PromptResult(0, "math", greedy=1.0, sampled=[1.0, 0.0, 0.0, 1.0]),   # pass@1 0.5, pass@2 1-1/6
        PromptResult(1, "math", greedy=0.2, sampled=[0.0, 0.0, 0.0, 0.0]),   # 0, 0
        PromptResult(2, "code", greedy=0.5, sampled=[0.5, 1.0, 1.0, 1.0]),   # threshold 0.5: all correct
    ]
    m = eval_metrics(results, threshold=0.5, ks=[1, 2])
    assert m["eval/math/prompts"] == 2 and m["eval/code/prompts"] == 1 and m["eval/prompts"] == 3
    assert m["eval/math/acc"] == 0.5 and m["eval/code/acc"] == 1.0 and m["eval/acc"] == pytest.approx(2 / 3)
    assert m["eval/math/pass@1"] == pytest.approx(0.25)
    assert m["eval/math/pass@2"] == pytest.approx((1 - 1 / 6) / 2)
    assert m["eval/code/pass@1"] == 1.0 and m["eval/code/pass@2"] == 1.0
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)          # every prompt alike, not every source
    assert m["eval/pass@2"] == pytest.approx((1 - 1 / 6 + 0 + 1) / 3)
    assert m["eval/math/reward_mean"] == pytest.approx(0.6)               # the greedy answers' rewards
    assert m["eval/reward_mean"] == pytest.approx(1.7 / 3)
    # Without greedy answers: no acc, and the mean reward is the sampled answers'.
    sampled_only = eval_metrics([PromptResult(0, "math", sampled=[1.0, 0.0])], threshold=1.0, ks=[1])
    assert "eval/acc" not in sampled_only and sampled_only["eval/reward_mean"] == 0.5
    assert sampled_only["eval/pass@1"] == 0.5


def test_results_of_several_engines_merge_in_stream_order_once() -> None:
    a = [PromptResult(2, "s", 1.0), PromptResult(0, "s", 0.0)]
    b = [PromptResult(1, "s", 0.5), PromptResult(0, "s", 1.0)]  # 0 again: two ranks of one engine
    merged = merge_results([a, b])
    assert [(r.position, r.greedy) for r in merged] == [(0, 0.0), (1, 0.5), (2, 1.0)]


# ---- the [eval] table ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("table", "field", "text"), [
    ({"n_samples": 4, "pass_k": [1, 8]}, "eval.pass_k", "expected each k between 1 and n_samples (4), got 8"),
    ({"n_samples": 4, "pass_k": [0]}, "eval.pass_k", "got 0"),
    ({"greedy": False}, "eval.n_samples", "expected greedy = true or n_samples > 0"),
    ({"n_samples": 2, "temperature": 0.0}, "eval.temperature", "expected temperature > 0"),
])
def test_eval_table_refuses_what_cannot_be_evaluated(table: dict, field: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        job_from_dict({"name": "e", "eval": table}, file="job.toml")
    msg = str(info.value)
    assert msg.startswith(f"job.toml: {field}: ") and text in msg and "\n" not in msg, msg


# ---- in the loop ----------------------------------------------------------------------------------------------

def eval_job(val: Path, **run: int) -> dict:
    return {"name": "ev", "model": dict(TINY),
            "rollout": {"prompts_per_step": 4, "n_samples": 4, "max_new_tokens": 5, "temperature": 1.0},
            "trainer": {"micro_batch_size": 8, "sft_warmup_steps": 3, "sft_lr": 3e-3},
            "data": {"source": "task:sort", "params": {"min_len": 2, "max_len": 3}, "val_source": str(val)},
            "reward": {"by_source": {"sorting": "position_match", "reversing": "position_match"}},
            "eval": {"batch_size": 4, "n_samples": 3, "pass_k": [1, 3], "correct_threshold": 0.5},
            "run": {"steps": 3, **run}}


def test_local_loop_logs_eval_metrics_and_trains_exactly_as_without(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from milehpc.runtime.loop import run_local

    val = write_val(tmp_path / "val.jsonl")
    with_eval = run_local(job_from_dict(eval_job(val, eval_every=2)), tmp_path / "on")
    without = run_local(job_from_dict(eval_job(val, eval_every=0)), tmp_path / "off")
    # Training is bit for bit the same: the evaluation samples from its own seeds, never the engine's stream.
    for on, off in zip(with_eval, without, strict=True):
        trained = {k: v for k, v in off.items() if not k.startswith(("time/", "perf/"))}
        assert trained and {k: on[k] for k in trained} == trained
        assert not any(k.startswith("eval/") for k in off)
    # Every 2 steps (step 1) and after the last one (step 2).
    assert [h["step"] for h in with_eval if "eval/acc" in h] == [1, 2]
    assert [h["eval/weight_version"] for h in with_eval if "eval/acc" in h] == [2, 3]  # each step's new weights
    last = with_eval[-1]
    for prefix in ("eval/", "eval/sorting/", "eval/reversing/"):
        assert {prefix + k for k in ("acc", "pass@1", "pass@3", "reward_mean", "prompts")} <= set(last)
    assert last["eval/prompts"] == 10 and last["eval/sorting/prompts"] == 5
    assert 0 < last["eval/reward_mean"] < 1  # partial credit: the warmed-up model gets some characters right
    assert last["eval/pass@1"] <= last["eval/pass@3"]
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "on" / "metrics.jsonl").read_text().splitlines())}
    assert [s for s, r in records.items() if "eval/acc" in r] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "on" / "evals").iterdir()) == ["step_00000001.jsonl",
                                                                             "step_00000002.jsonl"]
    assert not (tmp_path / "off" / "evals").exists()
    assert records[2]["eval/sorting/pass@3"] == last["eval/sorting/pass@3"]
    events = EventAccumulator(str(tmp_path / "on" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tb = {e.step: e.value for e in events.Scalars("eval/reversing/reward_mean")}
    assert tb == pytest.approx({1: with_eval[1]["eval/reversing/reward_mean"], 2: last["eval/reversing/reward_mean"]})


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict[str, float]]]:
    """A local run of 2 steps, evaluated and checkpointed after each: (run dir, validation file, metrics history).
    Its reward differs within every group and its lr is high, so each step changes the greedy answers."""
    from milehpc.config.schema import to_dict
    from milehpc.runtime.loop import run_local

    tmp_path = tmp_path_factory.mktemp("checkpointed")
    val = write_val(tmp_path / "val.jsonl", n=6)
    spec = {**eval_job(val, eval_every=1, steps=2), "checkpoint": {"interval_steps": 1},
            "reward": {"name": "ckpt_reshard_entries:token_reward"}}
    spec["trainer"]["lr"] = 3e-2
    job = job_from_dict(spec)
    run = tmp_path / "run"
    history = run_local(job, run, checkpointing=True)
    (run / "job.json").write_text(json.dumps(to_dict(job)))  # what `milehpc submit` writes
    return run, val, history


def test_local_loop_writes_each_evaluations_greedy_answers(
        checkpointed: tuple[Path, Path, list[dict[str, float]]]) -> None:
    """RUN_DIR/evals/step_NNNNNNNN.jsonl: per prompt, in stream order, the greedy answer the engine gives with the
    weights evaluated (checkpoint N + 1's), one prompt at a time — the same ids, text and reward."""
    from milehpc.export.run import policy_weights
    from milehpc.export.source import load_source
    from milehpc.rollout.engine import SamplingParams
    from milehpc.rollout.reference import build_engine

    run, val, history = checkpointed
    assert sorted(p.name for p in (run / "evals").iterdir()) == ["step_00000000.jsonl", "step_00000001.jsonl"]
    prompts = [json.loads(line) for line in val.read_text().splitlines()]
    answers: list[list[int]] = []
    for step in (0, 1):
        rows = [json.loads(line) for line in (run / "evals" / f"step_{step:08d}.jsonl").read_text().splitlines()]
        source = load_source(run, step + 1)  # checkpoint N: the weights the loop evaluated at metrics step N - 1
        assert {r["step"] for r in rows} == {step}
        assert {r["weight_version"] for r in rows} == {source.weight_version} == {history[step]["eval/weight_version"]}
        assert [r["position"] for r in rows] == list(range(6))
        assert [(r["prompt"], r["data_source"]) for r in rows] == [(p["prompt"], p["data_source"]) for p in prompts]
        engine = build_engine(source.job)
        engine.update_weights(policy_weights(source).items(), source.weight_version)
        sp = SamplingParams(temperature=0.0, max_new_tokens=source.job.rollout.max_new_tokens, n=1)
        for r in rows:
            want, = engine.generate([engine.tokenizer.encode_prompt(r["prompt"])], sp)
            assert (r["response_ids"], r["response"]) == (want.response_ids, want.response_text), r
            assert len(r["sampled_rewards"]) == 3 and r["reward"] == (sum(want.response_ids) % 5) / 4
        assert sum(r["reward"] for r in rows) / 6 == pytest.approx(history[step]["eval/reward_mean"])
        answers.append([r["response_ids"] for r in rows])
    assert answers[0] != answers[1]  # the two steps' weights answer differently: the file is not one step's twice


# ---- `milehpc eval` after the fact ----------------------------------------------------------------------------

def test_milehpc_eval_of_each_checkpoint_gives_the_loop_numbers(
        checkpointed: tuple[Path, Path, list[dict[str, float]]]) -> None:
    from click.testing import CliRunner

    from milehpc.cli import cli

    run, val, history = checkpointed
    runner = CliRunner()
    for step in (1, 2):  # checkpoint N holds the weights the loop evaluated at metrics step N - 1
        res = runner.invoke(cli, ["eval", str(run), "--step", str(step), "--data", str(val), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["metrics"] == {k: v for k, v in history[step - 1].items()
                                                     if k.startswith("eval/")}
    saved = json.loads((run / "eval" / "step_1.json").read_text())
    assert saved["metric_step"] == 0 and len(saved["results"]) == 6 and saved["eval"]["n_samples"] == 3
    # Options override [eval] for this evaluation only; the table names each data source.
    res = runner.invoke(cli, ["eval", str(run), "--data", str(val), "--n", "4", "--k", "2", "--no-greedy", "--force"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == f"checkpoint step 2 (metrics step 1) on {val}:"
    assert [line.split()[0] for line in lines[2:5]] == ["reversing", "sorting", "all"]
    assert "pass@2" in lines[4] and "pass@1" not in lines[4] and lines[4].split()[2] == "-"  # no greedy: no acc
    bad = runner.invoke(cli, ["eval", str(run), "--data", str(val), "--step", "7"])
    assert bad.exit_code == 2 and "--step: expected one of the run's checkpoint steps (1, 2), got 7" in bad.output
    bad = runner.invoke(cli, ["eval", str(run), "--data", str(val), "--k", "5", "--force"])
    assert bad.exit_code == 2 and "eval.pass_k: expected each k between 1 and n_samples (3), got 5" in bad.output
    # A generated task has no end (the loop's rule refuses it too): one line, not an evaluation that never ends.
    bad = runner.invoke(cli, ["eval", str(run), "--data", "task:sort", "--force"])
    assert bad.exit_code == 2 and "--max-prompts: " in bad.output and "expected" in bad.output, bad.output

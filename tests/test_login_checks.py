"""Issue 32 items 3, 4, 6, 8 on the login node, through the real CLI and ``prepare`` (no MPI, no Slurm): one model
shape from a checkpoint's config.json, inputs checked before the queue, Slurm time formats / partition limits /
required accounts / CPU placement / the checkpoint lead, and the smaller CLI items. The refusals themselves (one
line, exit 2) are corpus cases (tests/corpus/jobs, tests/corpus/sites); here is what must be ACCEPTED, and what the
script and the JSON then say."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from required import require_module

from milehpc.cli import cli
from milehpc.config import slurm_time
from milehpc.render.rundir import prepare

ROOT = Path(__file__).resolve().parent.parent
VALID_JOB = ROOT / "tests" / "corpus" / "valid-job.toml"
# A Qwen3-8B-style config.json (its real shape: 36 layers, 32 heads, 8 KV heads): the repro.
QWEN3_8B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 12288, "max_position_embeddings": 40960, "vocab_size": 151936,
            "tie_word_embeddings": False}


def _cli(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, list(args), env=env)


def _ok(result) -> str:
    assert result.exit_code == 0, result.output
    return result.stdout


# ---- item 6: Slurm time, partition limit, account, placement, checkpoint lead ----------------------------------

@pytest.mark.parametrize(("text", "secs"), [
    ("90", 90 * 60), ("0:75", 75), ("2:30", 150), ("02:00:00", 7200), ("100:00:00", 360000), ("1-12", 129600),
    ("1-2:3", 93780), ("2-00:00:00", 172800), ("1-0:0:5", 86405), ("UNLIMITED", None), ("INFINITE", None)])
def test_every_sbatch_time_form_parses(text: str, secs: int | None) -> None:
    assert slurm_time.seconds(text) == secs


def test_toml_time_of_day_and_minutes_become_slurm_strings() -> None:
    assert slurm_time.coerce(datetime.time(2, 0)) == "02:00:00"
    assert slurm_time.coerce(90) == "90"
    assert slurm_time.coerce(True) is True  # a bool is not minutes: the type check refuses it


def test_unquoted_time_and_long_hours_render(tmp_path: Path) -> None:
    """`--set resources.time=02:00:00` is a TOML time of day; 100:00:00 is valid Slurm (a partition that allows it)."""
    out = _ok(_cli("submit", str(VALID_JOB), "--site", "local-slurm", "--dry-run", "--run-dir", str(tmp_path / "r"),
                   "--set", "resources.time=00:45:00"))
    assert "#SBATCH --time=00:45:00" in out
    out = _ok(_cli("submit", str(VALID_JOB), "--site", "dgx-h100-like", "--dry-run", "--run-dir", str(tmp_path / "r"),
                   "--set", "resources.time=100:00:00", "--set", "site.time_limit='5-00:00:00'"))
    assert "#SBATCH --time=100:00:00" in out


def test_default_time_is_capped_by_a_shorter_partition(tmp_path: Path) -> None:
    prep = prepare(str(VALID_JOB), "perlmutter-like", ("resources.partition='debug'",), run_dir=str(tmp_path))
    assert "#SBATCH --time=00:30:00" in prep.script


def test_threads_follow_the_cores_per_gpu_unless_the_job_says(tmp_path: Path) -> None:
    script = prepare(str(VALID_JOB), "frontier-like", (), run_dir=str(tmp_path)).script
    assert "export OMP_NUM_THREADS=7\n" in script  # cpus_per_task: 56 usable cores / 8 GCDs
    script = prepare(str(VALID_JOB), "frontier-like", ("env.OMP_NUM_THREADS='4'",), run_dir=str(tmp_path)).script
    assert "export OMP_NUM_THREADS=4\n" in script and "OMP_NUM_THREADS=7" not in script


def test_dgx_binds_cores_and_asks_for_the_whole_node(tmp_path: Path) -> None:
    script = prepare(str(VALID_JOB), "dgx-h100-like", (), run_dir=str(tmp_path)).script
    assert "#SBATCH --exclusive\n#SBATCH --mem=0\n" in script
    assert "--cpu-bind=cores" in script and "--cpu-bind=none" not in script


def test_signal_lead_passes_with_room_for_the_checkpoint(tmp_path: Path) -> None:
    """The corpus case (7B-sized, 120 s) is refused; the same job with the lead it asks for passes."""
    case = ROOT / "tests" / "corpus" / "jobs" / "signal-lead-shorter-than-checkpoint.toml"
    res = _cli("plan", str(case), "--site", "dgx-h100-like", "--force")
    need = int(res.stderr.split("expected at least ")[1].split(" s")[0])
    assert 120 < need < 3600, res.stderr  # ~98 GB at 1 GiB/s, twice
    _ok(_cli("plan", str(case), "--site", "dgx-h100-like", "--force", "--set", f"checkpoint.signal_lead_s={need}"))


# ---- item 3: one model shape --------------------------------------------------------------------------------

@pytest.fixture
def qwen3_8b(tmp_path: Path) -> Path:
    folder = tmp_path / "Qwen3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_8B))
    return folder


def _bare_job(tmp_path: Path) -> str:
    """A job that leaves the [model] shape fields at their defaults (a folder's shape is then used)."""
    job = tmp_path / "job.toml"
    job.write_text('name = "shape"\n')
    return str(job)


def test_layout_is_checked_against_the_folders_shape(qwen3_8b: Path, tmp_path: Path) -> None:
    """TP=8 and PP=4 fit Qwen3-8B (32 heads, 8 KV heads, 36 layers); the [model] table's defaults (4 heads, 2 layers)
    refused both before."""
    job = _bare_job(tmp_path)
    base = ("--site", "dgx-h100-like", "--force", "--set", f"model.path='{qwen3_8b}'",
            "--set", "checkpoint.signal_lead_s=3600")
    _ok(_cli("plan", job, *base, "--set", "trainer.tp=8"))
    _ok(_cli("plan", job, *base, "--set", "trainer.pp=4"))
    res = _cli("plan", job, *base, "--set", "trainer.pp=5")
    assert res.exit_code == 2 and "divide the model's 36 layers" in res.stderr and "config.json" in res.stderr
    _ok(_cli("plan", job, *base, "--set", "trainer.pp=4", "--set", "model.num_layers=36"))  # agrees: fine


def test_experts_come_from_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**QWEN3_8B, "model_type": "qwen3_moe", "num_experts": 6,
                                                    "num_experts_per_tok": 2, "moe_intermediate_size": 64}))
    base = ("--site", "dgx-h100-like", "--force", "--set", f"model.path='{folder}'", "--set",
            "checkpoint.signal_lead_s=3600", "--set", "trainer.backend='megatron'",
            "--set", "trainer.dp=4", "--set", "rollout.gpus_per_engine=1")
    job = _bare_job(tmp_path)
    res = _cli("plan", job, *base, "--set", "trainer.ep=4")
    assert res.exit_code == 2 and "trainer.ep: expected trainer.ep to divide the 6 experts" in res.stderr, res.output
    _ok(_cli("plan", job, *base, "--set", "trainer.ep=2"))


# ---- item 4: inputs before the queue ------------------------------------------------------------------------

def test_parquet_prompt_field_is_read_from_the_first_rows(tmp_path: Path) -> None:
    import pyarrow as pa  # a dependency of milehpc itself (Parquet prompt files): no skip
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["1+1?"], "answer": ["2"]}), path)
    base = ("--site", "local", "--set", f"data.source='{path}'")
    res = _cli("plan", str(VALID_JOB), *base)
    assert res.exit_code == 2 and "expected the prompt field data.prompt_key = 'prompt'" in res.stderr
    assert "its keys: answer, question" in res.stderr
    _ok(_cli("plan", str(VALID_JOB), *base, "--set", "data.prompt_key='question'"))


def test_compute_only_input_under_the_sites_nvme_is_not_looked_for(tmp_path: Path) -> None:
    _ok(_cli("plan", str(VALID_JOB), "--site", "frontier-like", "--set", "data.source='/mnt/bb/${USER}/p.jsonl'",
             "--set", "resources.compute_only_inputs=['data.source']"))


def test_a_dotted_hub_id_is_named_as_one() -> None:
    res = _cli("plan", str(VALID_JOB), "--site", "local", "--set", "model.path='Qwen/Qwen2.5-7B-Instruct'")
    assert res.exit_code == 2 and "huggingface-cli download Qwen/Qwen2.5-7B-Instruct --local-dir" in res.stderr
    res = _cli("plan", str(VALID_JOB), "--site", "local", "--set", "data.source='data/train.jsonl'")
    assert res.exit_code == 2 and "'data/train.jsonl' not found on this node" in res.stderr, res.output


def test_module_function_reward_that_imports_passes(tmp_path: Path) -> None:
    _ok(_cli("plan", str(VALID_JOB), "--site", "local", "--set", "reward.name='json:dumps'"))


def test_a_reward_on_the_jobs_own_pythonpath_imports_on_the_login_node(tmp_path: Path) -> None:
    """The ranks import a module:function reward with the job's [env] PYTHONPATH in front: so does the check."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "login_check_reward.py").write_text("def score(samples):\n    return [0.0 for _ in samples]\n")
    args = ("plan", str(VALID_JOB), "--site", "local", "--set", "reward.name='login_check_reward:score'")
    _ok(_cli(*args, "--set", f"env.PYTHONPATH='{lib}'"))
    assert str(lib) not in sys.path  # the login process's own path is left as it was
    sys.modules.pop("login_check_reward")  # a fresh login process has not imported it
    res = _cli(*args, "--set", f"env.PYTHONPATH='{tmp_path / 'elsewhere'}'")
    assert res.exit_code == 2 and "No module named 'login_check_reward'" in res.stderr, res.output


def test_a_reward_models_folder_is_looked_for_before_the_job_queues(tmp_path: Path) -> None:
    """A judge's (or reward model's) folder, here a part of ``combine``, is read by the rollout ranks: one line
    naming its field here, not after the queue."""
    judge = tmp_path / "judge"
    judge.mkdir()
    rewards = f"[{{name = 'format'}}, {{name = 'judge', gate = 'format', params = {{path = '{judge}'}}}}]"
    args = ("plan", str(VALID_JOB), "--site", "local", "--set", "reward.name='combine'",
            "--set", f"reward.params={{rewards = {rewards}}}")
    res = _cli(*args)
    assert res.exit_code == 2 and res.stderr.strip().endswith(
        f"reward.params.rewards[1].params.path: expected a checkpoint folder with a config.json, got '{judge}'"), \
        res.output
    (judge / "config.json").write_text("{}")
    _ok(_cli(*args))


def test_relative_inputs_reach_the_ranks_as_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The login check reads relative inputs from here; the ranks run in the run directory: job.json must hold the
    paths the check looked at (a prompt file, a judge folder inside ``combine``, a PYTHONPATH entry), while absolute
    paths, task sources and compute-node-only inputs stay as written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "abc"}\n')
    (tmp_path / "judge").mkdir()
    (tmp_path / "judge" / "config.json").write_text("{}")
    (tmp_path / "lib").mkdir()
    rewards = "[{name = 'format'}, {name = 'judge', gate = 'format', params = {path = 'judge'}}]"
    prep = prepare(str(VALID_JOB), "local", ("data.source='data/train.jsonl'", "reward.name='combine'",
                                             f"reward.params={{rewards = {rewards}}}",
                                             "env.PYTHONPATH='lib:/opt/site-lib'"), run_dir=str(tmp_path / "run"))
    assert prep.job.data.source == str(tmp_path / "data" / "train.jsonl")
    assert prep.job.reward.params["rewards"][1]["params"]["path"] == str(tmp_path / "judge")
    assert prep.job.env["PYTHONPATH"] == f"{tmp_path / 'lib'}:/opt/site-lib"
    assert prepare(str(VALID_JOB), "local", (), run_dir=str(tmp_path / "run")).job.data.source == "task:sort"


# ---- item 8: the smaller CLI items ----------------------------------------------------------------------------

def test_status_without_jobs_is_no_error(tmp_path: Path) -> None:
    env = {"MILEHPC_STATE_DIR": str(tmp_path / "state")}
    res = _cli("status", env=env)
    assert res.exit_code == 0 and "no milehpc jobs recorded yet" in res.stdout, res.output
    assert json.loads(_ok(_cli("status", "--json", env=env))) == []


def test_logs_and_status_take_a_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from milehpc.scheduler.records import add_record

    monkeypatch.setenv("MILEHPC_STATE_DIR", str(tmp_path / "state"))
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "plan.json").write_text("{}")
    add_record("local-99999999", "x", "local", str(run))
    out = _ok(_cli("logs", str(run), "--path"))
    assert out.strip().startswith(str(run.resolve())), out
    res = _cli("status", str(run), "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)[0]["job_id"] == "local-99999999", res.output
    res = _cli("logs", str(tmp_path))  # a folder that is no run directory: one line, as `stop` says it
    assert res.exit_code == 2 and "not a milehpc run directory" in res.stderr


def test_plan_json_sizes_are_numbers() -> None:
    data = json.loads(_ok(_cli("plan", str(VALID_JOB), "--site", "dgx-h100-like", "--json")))
    rows = data["memory"]
    assert rows and all(isinstance(r["bytes"], int) for r in rows)
    totals = [r for r in rows if r["item"] == "total"]
    assert totals and all(isinstance(r["budget_bytes"], int) for r in totals)
    for total in totals:  # a total is the sum of its rank's counted items
        counted = [r["bytes"] for r in rows if r["rank"] == total["rank"] and r["item"] != "total" and r["counted"]]
        assert total["bytes"] == sum(counted)


def test_spec_lists_the_job_fields() -> None:
    out = _ok(_cli("spec"))
    for name in ("name:", "trainer.lr:", "resources.time:", "trainer.lora.adapters.NAME.source:", "data.prompt_key:"):
        assert any(line.startswith(name) for line in out.splitlines()), name
    rows = json.loads(_ok(_cli("spec", "checkpoint", "--json")))
    assert {r["name"] for r in rows} >= {"checkpoint.signal_lead_s", "checkpoint.keep"}
    res = _cli("spec", "trainr")
    assert res.exit_code == 2 and "did you mean 'trainer'?" in res.stderr


def test_plot_writes_one_png_per_matching_run(tmp_path: Path) -> None:
    require_module("matplotlib")  # the dev extra: CI (MILEHPC_REQUIRE_ALL=1) fails rather than skips without it
    runs = [tmp_path / f"x-{i}" for i in range(2)]
    for run in runs:
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": s, "rollout/reward_mean": s / 4})
                                                   + "\n" for s in range(4)))
    out = _ok(_cli("plot", *map(str, runs)))
    assert out.split() == [str(run / "reward.png") for run in runs]
    assert all((run / "reward.png").stat().st_size > 0 for run in runs)
    res = _cli("plot", *map(str, runs), "-o", str(tmp_path / "one.png"))
    assert res.exit_code == 2 and "expected one RUN_DIR with -o" in res.stderr

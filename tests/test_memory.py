"""The memory estimate (milehpc.memory, issue 20): checked against the real bytes of the tiny models on the CPU (the
torch trainer of examples/cpu-demo*.toml in this process, Megatron-core at TP=2 under mpirun), shown by `plan` and
`doctor`, and refusing on the login node a layout whose ranks cannot fit their devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from memory_measure import measure_torch_trainer

from milehpc import memory
from milehpc.cli import cli
from milehpc.config.load import load_job

ROOT = Path(__file__).resolve().parents[1]
FRONTIER = ROOT / "examples" / "frontier-grpo.toml"
# Activations: the estimate counts the tensors autograd keeps (memory.activation_elements); within 3% of the
# bytes measured. Parameters, gradients (torch) and optimizer state: exact.
ACTIVATION_TOLERANCE = 0.03


def test_the_toy_vocabulary_size_is_the_toy_tokenizers() -> None:
    from milehpc.data.tokenizer import build_tokenizer

    assert build_tokenizer("toy").vocab_size == memory.TOY_VOCAB_SIZE


@pytest.mark.parametrize("example", ["cpu-demo.toml", "cpu-demo-small.toml"])
def test_estimate_matches_the_torch_trainer_on_the_cpu(example: str) -> None:
    job = load_job(ROOT / "examples" / example)
    got = measure_torch_trainer(job)
    est = memory.estimate_trainer_bytes(job)
    assert got["prompt_tokens"] == memory.prompt_tokens(job)[0]
    assert (est["params"], est["grads"], est["optimizer"]) == (got["params"], got["grads"], got["optimizer"])
    assert abs(est["activations"] - got["activations"]) <= ACTIVATION_TOLERANCE * got["activations"], (est, got)


@pytest.mark.mpi
@pytest.mark.slow
def test_estimate_matches_megatron_at_tp2(tmp_path: Path) -> None:
    """Parameters and optimizer state exact per rank (fp32; bf16 with the distributed optimizer); the gradient
    buffer within the distributed optimizer's padding."""
    out = tmp_path / "out.json"
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}
    cmd = [str(bin_dir / "mpirun"), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2",
           sys.executable, str(ROOT / "tests" / "memory_mpi_checks.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 2
    for rank in ranks:
        for layout, res in rank.items():
            got, est = res["measured"], res["estimated"]
            assert est["params"] == got["params"], (layout, est, got)
            assert est["optimizer"] == got["optimizer"], (layout, est, got)
            assert 0 <= got["grads"] - est["grads"] <= 0.01 * got["grads"], (layout, est, got)


# ---- plan, submit, doctor -----------------------------------------------------------------------------------------

def _run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_plan_prints_the_memory_table_for_the_frontier_example() -> None:
    result = _run("plan", str(FRONTIER), "--site", "frontier-like")
    assert result.exit_code == 0, result.output
    for text in ("memory per rank", "trainer parameters", "optimizer state", "KV cache", "fits"):
        assert text in result.stdout, result.stdout
    data = json.loads(_run("plan", str(FRONTIER), "--site", "frontier-like", "--json").stdout)
    total = next(r for r in data["memory"] if r["rank"] == "trainer" and r["item"] == "total")
    assert total["note"].startswith("fits") and "of 64.0 GiB" in total["note"]


@pytest.mark.parametrize("command", ["plan", "submit"])
def test_a_layout_that_cannot_fit_is_refused_with_the_change_that_fits(command: str, tmp_path: Path) -> None:
    args = [command, str(FRONTIER), "--site", "frontier-like", "--set", "trainer.tp=1"]
    if command == "submit":
        args += ["--dry-run", "--run-dir", str(tmp_path / "run")]
    result = _run(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    assert lines[0].startswith(f"milehpc: error: {FRONTIER} (with --set): trainer: expected a trainer rank to fit "
                               "64.0 GiB (device), got an estimated"), lines[0]
    assert "the largest item trainer gradients" in lines[0] and "set trainer.tp = 2 (" in lines[0], lines[0]
    forced = _run(*args, "--force")
    assert forced.exit_code == 0, forced.output
    assert not (tmp_path / "run").exists()


def test_the_suggestion_is_the_smallest_single_change() -> None:
    from milehpc.render.rundir import prepare

    def line(*sets: str) -> str:
        prep = prepare(str(FRONTIER), "frontier-like", sets, run_dir="/nonexistent")
        with pytest.raises(Exception) as info:
            memory.for_job(prep.job, prep.plan, prep.partition, file="f")
        return str(info.value)

    assert "set trainer.distributed_optimizer = true" in line("trainer.tp=2", "trainer.distributed_optimizer=false",
                                                              "trainer.micro_batch_size=1")
    assert "set trainer.micro_batch_size = " in line("trainer.tp=4", "trainer.micro_batch_size=16")
    kv = line("rollout.prompts_per_step=100000")
    assert "rollout: expected a rollout rank to fit 56.3 GiB (0.88 of the device)" in kv and "KV cache" in kv


def test_doctor_reports_the_estimate() -> None:
    from milehpc.doctor import FAIL, OK, Doctor

    found = [f for f in Doctor("frontier-like", str(FRONTIER), env={}).run() if f.check == "memory"]
    assert [f.level for f in found] == [OK, OK], found
    bad = [f for f in Doctor("local", str(ROOT / "examples" / "cpu-demo.toml"), env={}).run() if f.check == "memory"]
    assert all(f.level == OK and "host memory is not checked" in f.message for f in bad), bad
    assert FAIL not in [f.level for f in found]


def test_colocated_ranks_count_the_larger_side() -> None:
    from milehpc.render.rundir import prepare

    # an NVIDIA site: colocated SGLang is refused on AMD partitions (torch_memory_saver's wheel is CUDA-only)
    prep = prepare(str(FRONTIER), "dgx-h100-like", ("resources.use=[]", "resources.colocate=true",
                                                    "rollout.engines=4", "rollout.gpus_per_engine=4",
                                                    "resources.nodes=2", "run.loop=sync"), run_dir="/nonexistent")
    est = memory.for_job(prep.job, prep.plan, prep.partition, file=None, force=True)
    (rank,) = est.ranks
    assert rank.role == "trainer" and any("colocated" in n for n in est.notes)


def test_a_colocated_engine_that_overflows_its_fraction_is_refused_behind_a_larger_trainer() -> None:
    """The engine's budget is mem_fraction_static (0.5 colocated) of the device: ~41.6 GiB of engine does not fit
    39.8 GiB (an 80 GB H100) although the ~43.5 GiB trainer side is the larger one and fits the whole device."""
    from milehpc.render.rundir import prepare

    prep = prepare(str(FRONTIER), "dgx-h100-like", ("resources.use=[]", "resources.colocate=true",
                                                    "rollout.engines=4", "rollout.gpus_per_engine=4",
                                                    "resources.nodes=2", "run.loop=sync", "trainer.micro_batch_size=8",
                                                    "rollout.prompts_per_step=928"), run_dir="/nonexistent")
    est = memory.for_job(prep.job, prep.plan, prep.partition, file=None, force=True)
    (rank,) = est.ranks
    assert rank.role == "rollout" and not rank.fits, (rank.role, rank.total, rank.budget)
    with pytest.raises(Exception, match="expected a rollout rank to fit 39.8 GiB"):
        memory.for_job(prep.job, prep.plan, prep.partition, file=None)


def test_a_colocated_engine_that_never_offloads_is_counted_beside_its_trainer() -> None:
    """Issue 30: the estimate is the rank's peak. SGLang is released at start-up and while the trainer steps (each
    side alone, above); the reference engine stays resident, so a ~43 GiB trainer and a ~46 GiB engine, each of which
    fits an 80 GB H100 alone, do not fit it together."""
    from milehpc.render.rundir import prepare

    overrides = ("resources.use=[]", "resources.colocate=true", "rollout.engines=4", "rollout.gpus_per_engine=4",
                 "resources.nodes=2", "run.loop=sync", "trainer.micro_batch_size=8", "rollout.prompts_per_step=1024",
                 "rollout.engine=reference")
    prep = prepare(str(FRONTIER), "dgx-h100-like", overrides, run_dir="/nonexistent")
    est = memory.for_job(prep.job, prep.plan, prep.partition, file=None, force=True)
    (rank,) = est.ranks
    names = [i.name for i in rank.items]
    assert rank.role == "colocated" and "trainer parameters" in names and "KV cache" in names, names
    assert rank.budget == int(79.6 * memory.GIB) and not rank.fits
    trainer = sum(i.bytes for i in rank.items if i.name not in ("engine weights", "KV cache"))
    assert trainer < rank.budget and rank.total - trainer < rank.budget  # each side alone would fit
    with pytest.raises(Exception, match="resources.colocate: expected a colocated rank to fit 79.6 GiB"):
        memory.for_job(prep.job, prep.plan, prep.partition, file=None)


def test_a_sweep_value_that_cannot_fit_is_refused(tmp_path: Path) -> None:
    result = _run("submit", str(FRONTIER), "--site", "frontier-like", "--dry-run", "--run-dir", str(tmp_path / "s"),
                  "--sweep", "trainer.tp=4,1")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "(with --sweep trainer.tp=1): trainer: expected a trainer rank to fit" in result.stderr
    assert not (tmp_path / "s").exists()


def test_a_broken_checkpoint_config_falls_back_to_the_model_table(tmp_path: Path) -> None:
    """plan runs on the login node: a config.json it cannot parse is a note (the ranks report it), not a traceback."""
    (tmp_path / "config.json").write_text("{not json")
    job = load_job(ROOT / "examples" / "cpu-demo.toml", [f'model.path="{tmp_path}"'])
    shape, notes = memory.model_shape(job)
    assert shape.hidden == job.model.hidden_size and any("not readable JSON" in n for n in notes), notes


def test_a_lora_run_counts_gradients_and_optimizer_state_of_the_adapter_alone() -> None:
    """[trainer.lora] with its default targets (every linear layer): the estimate's adapter, gradient and Adam bytes
    are the live peft trainer's, exactly; the frozen base has neither (counting it would refuse layouts that fit)."""
    from milehpc.config.load import job_from_dict
    from milehpc.config.schema import to_dict

    data = to_dict(load_job(ROOT / "examples" / "cpu-demo-small.toml"))
    data["trainer"]["lora"] = {"rank": 4}
    job = job_from_dict(data)
    got = measure_torch_trainer(job)
    est = memory.estimate_trainer_bytes(job)
    items = {i.name: i.bytes for i in memory.trainer_items(job, memory.model_shape(job)[0])[0]}
    assert got["params"] == est["params"] + items["LoRA adapter"]  # the base, and the adapter beside it
    assert (est["grads"], est["optimizer"]) == (got["grads"], got["optimizer"])
    assert est["grads"] == items["LoRA adapter"] < est["params"] // 10

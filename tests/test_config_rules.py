"""The job rules that span several tables (milehpc.config.rules): every rule refuses a job that breaks it in one
line naming the file and the field, a nearby valid job passes all of them, every rule has a corpus file, and the
rules run wherever a job is accepted (plan, render, submit, run, submit --resume, submit --sweep)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_config_corpus import header

from milehpc.cli import cli
from milehpc.config import rules
from milehpc.config.load import job_from_dict, load_job
from milehpc.errors import ConfigError

CORPUS = Path(__file__).parent / "corpus"
VALID_JOB = CORPUS / "valid-job.toml"
FILE = "job.toml"
UNSUPPORTED_FAMILY = CORPUS / "models" / "gpt-neox"  # a config.json whose model_type milehpc does not train

MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64}

# rule name -> (tables of a job that breaks it, tables of a nearby job that passes every rule, field named)
CASES: dict[str, tuple[dict, dict, str]] = {
    "trainer_options_fit_the_trainer": (
        {"trainer": {"options": {"fsdp": "yes"}}},
        {"trainer": {"options": {"fsdp": True}}}, "trainer.options.fsdp"),
    "engine_options_fit_the_engine": (
        {"rollout": {"engine": "sglang", "options": {"weight_bucket_mb": "big"}}},
        {"rollout": {"engine": "sglang", "options": {"weight_bucket_mb": 256}}}, "rollout.options.weight_bucket_mb"),
    "generator_params_fit_the_generator": (
        {"rollout": {"generator": "toy_retry", "generator_params": {"max_turns": "two"}}},
        {"rollout": {"generator": "toy_retry", "generator_params": {"max_turns": 2}}},
        "rollout.generator_params.max_turns"),
    "task_params_fit_the_task": (
        {"data": {"source": "task:sort", "params": {"min_len": "12"}}},
        {"data": {"source": "task:sort", "params": {"min_len": 5, "max_len": 12}}}, "data.params.min_len"),
    "reward_params_fit_the_reward": (
        {"reward": {"name": "math_answer", "params": {"tolerance": -1.0}}},
        {"reward": {"name": "math_answer", "params": {"tolerance": 0.01}}}, "reward.params.tolerance"),
    "algorithm_params_fit_the_plugins": (
        {"algorithm": {"loss": "ppo_clip", "loss_params": {"clip_ratio_c": 0.5}}},
        {"algorithm": {"loss": "ppo_clip", "loss_params": {"clip_ratio_c": 0.0}}}, "algorithm.loss_params.clip_ratio_c"),
    "overlong_buffer_fits_the_response": (
        {"rollout": {"max_new_tokens": 8}, "algorithm": {"overlong_buffer": 8}},
        {"rollout": {"max_new_tokens": 8}, "algorithm": {"overlong_buffer": 7}}, "algorithm.overlong_buffer"),
    "colocated_runs_sync": (
        {"resources": {"colocate": True}, "run": {"loop": "one_step_off"}},
        {"resources": {"colocate": True}, "run": {"loop": "sync"}}, "run.loop"),
    "stale_samples_need_a_correction": (
        {"run": {"loop": "async", "stale_policy": "correct"}, "algorithm": {"off_policy_correction": "none"}},
        {"run": {"loop": "async", "stale_policy": "correct"}, "algorithm": {"off_policy_correction": "tis"}},
        "run.stale_policy"),
    "partial_rollouts_keep_their_stale_samples": (
        {"run": {"loop": "async"}, "rollout": {"partial_rollout": True}},
        {"run": {"loop": "async", "stale_policy": "correct"}, "rollout": {"partial_rollout": True},
         "algorithm": {"off_policy_correction": "tis"}}, "run.stale_policy"),
    "partial_rollouts_need_the_builtin_generation": (
        {"rollout": {"generator": "toy_retry", "partial_rollout": True}},
        {"rollout": {"generator": "toy_retry", "partial_rollout": False}}, "rollout.partial_rollout"),
    "elastic_rollout_fits_the_loop": (
        {"resources": {"elastic_rollout": True}, "rollout": {"partial_rollout": True}},
        {"resources": {"elastic_rollout": True}}, "rollout.partial_rollout"),
    "model_family_is_supported": (
        {"model": {"path": str(UNSUPPORTED_FAMILY)}},
        {"model": {"path": str(CORPUS / "models" / "qwen3")}}, "model.path"),
    # SGLang serves Qwen2.5-VL; its CPU scheduler dies on a Qwen3-VL image prompt (README's VL section)
    "vision_models_roll_out_on_engines_that_take_images": (
        {"model": {"path": str(CORPUS / "models" / "qwen3_vl")}, "rollout": {"engine": "sglang"}},
        {"model": {"path": str(CORPUS / "models" / "qwen2_5_vl")}, "rollout": {"engine": "sglang"}},
        "rollout.engine"),
    "random_moe_has_an_moe_family": (
        {"model": {"arch": "llama", "num_experts": 4}},
        {"model": {"arch": "qwen3", "num_experts": 4}}, "model.arch"),
    "torch_trainer_has_no_fp8": (
        {"trainer": {"precision": "fp8"}, "model": {"dtype": "bfloat16"}},
        {"trainer": {"precision": "fp8", "backend": "megatron"}, "model": {"dtype": "bfloat16"}},
        "trainer.precision"),
    "reduced_precision_needs_bfloat16_weights": (
        {"trainer": {"precision": "bf16"}, "model": {"dtype": "float32"}},
        {"trainer": {"precision": "bf16"}, "model": {"dtype": "bfloat16"}}, "model.dtype"),
    "megatron_kl_reference_is_the_initial_policy": (
        {"trainer": {"backend": "megatron", "sft_warmup_steps": 2}, "algorithm": {"kl_coef": 0.01}},
        {"trainer": {"backend": "megatron", "sft_warmup_steps": 0}, "algorithm": {"kl_coef": 0.01}},
        "trainer.sft_warmup_steps"),
    "megatron_moe_needs_tp_1": (
        {"trainer": {"backend": "megatron", "tp": 2}, "model": {"num_experts": 4}},
        {"trainer": {"backend": "megatron", "tp": 1, "dp": 2, "ep": 2}, "model": {"num_experts": 4}}, "trainer.tp"),
    "megatron_ep_divides_the_experts": (
        {"trainer": {"backend": "megatron", "dp": 2, "ep": 2}, "model": {"num_experts": 3}},
        {"trainer": {"backend": "megatron", "dp": 2, "ep": 2}, "model": {"num_experts": 4}}, "trainer.ep"),
    "mini_batches_divide_the_batch": (
        {"trainer": {"mini_batch_size": 48}}, {"trainer": {"mini_batch_size": 32}}, "trainer.mini_batch_size"),
    "megatron_features_fit_the_layout": (
        {"trainer": {"backend": "megatron", "sequence_parallel": True}},
        {"trainer": {"backend": "megatron", "tp": 2, "sequence_parallel": True, "recompute": "selective"}},
        "trainer.tp"),
    "fsdp_trains_the_policy_alone": (
        {"trainer": {"dp": 2, "options": {"fsdp": True}}, "algorithm": {"kl_coef": 0.1}},
        {"trainer": {"dp": 1, "options": {"fsdp": True}}, "algorithm": {"kl_coef": 0.1}}, "trainer.options.fsdp"),
    "distillation_needs_a_teacher": (
        {"algorithm": {"advantage": "distill"}},
        {"algorithm": {"advantage": "distill"}, "trainer": {"options": {"teacher_path": "/ckpt/teacher"}}},
        "trainer.options.teacher_path"),
    "sglang_stop_strings_need_a_tokenizer": (
        {"rollout": {"engine": "sglang", "stop": ["\n\n"]}},
        {"rollout": {"engine": "sglang", "stop": ["\n\n"]}, "model": {"tokenizer": "/ckpt/tokenizer"}},
        "rollout.stop"),
    "vllm_serves_the_job": (
        {"rollout": {"engine": "vllm", "top_p": 0.9}},
        {"rollout": {"engine": "vllm", "top_p": 1.0}}, "rollout.top_p"),
    "routing_replay_needs_moe": (
        {"rollout": {"engine": "sglang", "options": {"return_routed_experts": True}}},
        {"rollout": {"engine": "sglang", "options": {"return_routed_experts": True}}, "model": {"num_experts": 4}},
        "rollout.options.return_routed_experts"),
    "lora_fits_the_trainer": (
        {"trainer": {"backend": "megatron", "pp": 2, "lora": {"rank": 8}}},
        {"trainer": {"backend": "megatron", "tp": 2, "lora": {"rank": 8}}}, "trainer.pp"),
    "lora_rolls_out_where_adapters_load": (
        {"rollout": {"engine": "sglang"}, "trainer": {"lora": {"rank": 8, "modules_to_save": ["lm_head"]}}},
        {"rollout": {"engine": "sglang"}, "trainer": {"lora": {"rank": 8}}}, "trainer.lora.modules_to_save"),
    "evaluation_needs_validation_prompts": (
        {"run": {"eval_every": 5}, "data": {"val_source": "task:sort"}},
        {"run": {"eval_every": 5}, "data": {"val_source": "task:sort"}, "eval": {"max_prompts": 64}},
        "eval.max_prompts"),
    "evaluation_sees_synced_weights": (
        {"run": {"eval_every": 3, "update_weights_interval": 2}, "data": {"val_source": "val.jsonl"}},
        {"run": {"eval_every": 4, "update_weights_interval": 2}, "data": {"val_source": "val.jsonl"}},
        "run.eval_every"),
}


def job(tables: dict):
    data: dict = {"name": "r", "model": dict(MODEL)}
    for key, value in tables.items():
        data[key] = {**data.get(key, {}), **value}
    return job_from_dict(data, file=FILE)


RULE_NAMES = [rule.__name__ for rule in rules.RULES]


def test_every_rule_has_a_case() -> None:
    assert sorted(CASES) == sorted(RULE_NAMES), "add a (broken, valid, field) case for each rule in RULES"
    assert len(set(RULE_NAMES)) == len(RULE_NAMES)


@pytest.mark.parametrize("rule", rules.RULES, ids=RULE_NAMES)
def test_rule_refuses_a_job_that_breaks_it_and_passes_a_nearby_one(rule) -> None:
    broken, valid, field = CASES[rule.__name__]
    with pytest.raises(ConfigError) as info:
        rule(job(broken), FILE)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{FILE}: {field}: "), msg
    assert "expected" in msg and "got" in msg, f"say what was expected and what was got: {msg}"
    # The whole set refuses it too, with that rule's line (no earlier rule hides it).
    with pytest.raises(ConfigError) as whole:
        rules.check_job_rules(job(broken), file=FILE)
    assert str(whole.value) == msg
    rules.check_job_rules(job(valid), file=FILE)


@pytest.mark.parametrize("rule", rules.RULES, ids=RULE_NAMES)
def test_rule_docstring_names_the_fields_it_crosses(rule) -> None:
    doc = rule.__doc__ or ""
    assert len(set(re.findall(r"\b[a-z_]+\.[a-z_.]+\b", doc))) >= 2 or "×" in doc, rule.__name__


# ---- every rule has a corpus file, and that file is refused by that rule ----------------------------------------

RULE_CORPUS = {path: header(path) for path in sorted((CORPUS / "jobs").glob("rule-*.toml"))}


def test_every_rule_has_a_corpus_file() -> None:
    named = {name for head in RULE_CORPUS.values() for name in head.get("rule", [])}
    missing = sorted(set(RULE_NAMES) - named)
    assert not missing, f"add tests/corpus/jobs/rule-<what>.toml with '# rule: NAME' for: {missing}"
    unknown = sorted(named - set(RULE_NAMES))
    assert not unknown, f"corpus files name rules that do not exist: {unknown}"
    for path, head in RULE_CORPUS.items():
        assert head.get("rule"), f"{path.name}: a rule-*.toml names its rule ('# rule: NAME')"


@pytest.mark.parametrize("path", sorted(RULE_CORPUS), ids=lambda p: p.stem)
def test_corpus_file_is_refused_by_the_rule_it_names(path: Path) -> None:
    head = RULE_CORPUS[path]
    spec = load_job(path, head.get("set", []))
    by_name = {rule.__name__: rule for rule in rules.RULES}
    with pytest.raises(ConfigError) as whole:
        rules.check_job_rules(spec, file=str(path))
    for name in head["rule"]:
        with pytest.raises(ConfigError) as info:
            by_name[name](spec, str(path))
        assert str(info.value) == str(whole.value) and head["expect"][0] in str(info.value)


# ---- the rules run wherever a job is accepted ---------------------------------------------------------------------

ISSUE_EXAMPLES = {
    "async-correct-none": (["run.loop=async", "run.stale_policy=correct", "algorithm.off_policy_correction=none"],
                           "run.stale_policy: stale_policy = 'correct'"),
    "colocate-one-step-off": (["resources.colocate=true", "run.loop=one_step_off", "trainer.dp=1"],
                              "run.loop: expected 'sync' with resources.colocate = true"),
}


def _one_line(result, expect: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("example", sorted(ISSUE_EXAMPLES))
@pytest.mark.parametrize("command", ["plan", "render", "submit", "run"])
def test_every_command_refuses_a_rule_breaking_job(command: str, example: str, tmp_path: Path) -> None:
    sets, expect = ISSUE_EXAMPLES[example]
    args = [command, str(VALID_JOB), "--site", "local", *[a for s in sets for a in ("--set", s)]]
    if command in ("submit", "run"):
        args += ["--run-dir", str(tmp_path / "run")]
    if command == "submit":
        args.append("--dry-run")
    _one_line(CliRunner().invoke(cli, args), expect)
    assert not (tmp_path / "run").exists()


def test_submit_resume_with_set_runs_the_rules(tmp_path: Path) -> None:
    from milehpc.render.rundir import prepare, write_run_dir

    rdir = write_run_dir(prepare(str(VALID_JOB), "local", run_dir=str(tmp_path / "run")))
    before = sorted(p.name for p in rdir.iterdir())
    sets, expect = ISSUE_EXAMPLES["async-correct-none"]
    result = CliRunner().invoke(cli, ["submit", "--resume", str(rdir), "--site", "local", "--dry-run",
                                      *[a for s in sets for a in ("--set", s)]])
    _one_line(result, expect)
    assert str(rdir / "job.json") in result.stderr
    assert sorted(p.name for p in rdir.iterdir()) == before


def test_submit_sweep_runs_the_rules_for_every_value(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["submit", str(VALID_JOB), "--site", "local-slurm", "--dry-run",
                                      "--run-dir", str(tmp_path / "sweep"), "--set", "run.loop=async",
                                      "--sweep", "run.stale_policy=drop,correct"])
    _one_line(result, "run.stale_policy: stale_policy = 'correct'")
    assert not (tmp_path / "sweep").exists()


def test_vision_families_roll_out_where_their_images_are_served() -> None:
    """The reference engine serves every vision family; SGLang Qwen2.5-VL alone (Qwen3-VL refused with the measured
    reason, which names the other engine); vLLM none."""
    from milehpc.config.families import VISION_FAMILIES

    assert sorted(rules.VISION_ENGINES["reference"]) == sorted(VISION_FAMILIES)
    rule = rules.vision_models_roll_out_on_engines_that_take_images
    rule(job({"model": {"path": str(CORPUS / "models" / "qwen2_5_vl")}, "rollout": {"engine": "sglang"}}), FILE)
    for family, engine, able, why in (
            ("qwen3_vl", "sglang", "'reference'", r"CPU scheduler dies on a Qwen3-VL image prompt"),
            ("qwen2_5_vl", "vllm", "'reference' or 'sglang'", r"vllm 0\.32\.0's Qwen2\.5-VL class fails at import")):
        with pytest.raises(ConfigError, match=rf"rollout.engine: expected rollout.engine = {able} for a {family} "
                                              rf"model \(images in the prompts; .*{why}.*\), got '{engine}'"):
            rule(job({"model": {"path": str(CORPUS / "models" / family)}, "rollout": {"engine": engine}}), FILE)


def test_megatron_takes_critic_and_teacher_estimators() -> None:
    """Issue 17 item 1: the Megatron trainer has a critic (GAE) and a teacher (distillation), so the job rules
    accept them there; distillation still needs its teacher_path, as with the torch trainer."""
    rules.check_job_rules(job({"trainer": {"backend": "megatron"}, "algorithm": {"advantage": "gae"}}), file=FILE)
    rules.check_job_rules(job({"trainer": {"backend": "megatron", "options": {"teacher_path": "/ckpt/teacher"}},
                               "algorithm": {"advantage": "distill"}}), file=FILE)
    with pytest.raises(ConfigError, match="trainer.options.teacher_path: on-policy distillation"):
        rules.check_job_rules(job({"trainer": {"backend": "megatron"}, "algorithm": {"advantage": "distill"}}),
                              file=FILE)

"""Job rules that span several tables of the job spec. They run on the login node — in ``submit``, ``plan``,
``render`` and ``run`` (:func:`milehpc.render.rundir.prepare`) — with the same one-line errors (file, field, what
was expected; exit code 2) as every single-field check, so a job that can only fail never waits in the queue. The
ranks do not check them again.

A rule may read the plugin registry (:func:`milehpc.plugins.lookup`: the registered dataclasses, never their
implementations) and lower layers; nothing here imports torch, an engine or a trainer (nor any module above
``config``: tests/test_import_layers.py). What only the job can know (an installed package, a checkpoint's
``config.json``, a field of SGLang's ``ServerArgs``) stays where the job runs.

Every rule has a case in ``tests/test_config_rules.py`` and a file in ``tests/corpus/jobs/`` whose header names it
(``# rule: <function name>``); a rule added to :data:`RULES` without them fails the tests.

:data:`SITE_RULES` hold the job against the partition it runs on: what that partition's GPUs or the container
shipped for them cannot run (tests/test_rocm_site_rules.py), its time limit and a required account
(tests/test_site_limits.py), and the rollout engines its container image holds (tests/test_site_engines.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec
    from milehpc.config.site import Partition
    from milehpc.plugin_types import AdvantageEstimator

Rule = Callable[["JobSpec", "str | None"], None]

# Engines that compute in model.dtype (HF transformers modules; the process variant wraps the same engine).
REFERENCE_ENGINES = ("reference", "reference_process")


# ---- helpers (login-safe: the registry's dataclasses and check_params, nothing heavy) -------------------------

def _estimator(job: JobSpec, file: str | None) -> AdvantageEstimator | None:
    """The registered advantage estimator (None while no estimator plugin is registered at all)."""
    from milehpc import plugins

    if not plugins.registry("advantage"):
        return None
    return plugins.lookup("advantage", job.algorithm.advantage, file=file, field="algorithm.advantage")


def _plugin_params(kind: str, name: str, params: dict[str, Any], file: str | None, *, field: str,
                   prefix: str) -> dict[str, Any]:
    """``params`` checked against the schema the plugin ``name`` declares (milehpc.plugin_types.Registered):
    an unknown key, a wrong type, a value out of range is one line naming ``prefix.key``."""
    from milehpc import plugins
    from milehpc.config.schema import check_params

    spec = plugins.lookup(kind, name, file=file, field=field)
    return check_params(spec, params, file=file, prefix=prefix)


def _trainer_options(job: JobSpec, file: str | None) -> dict[str, Any]:
    """``trainer.options`` over the trainer plugin's defaults (an unknown key or a wrong type is one line)."""
    return _plugin_params("trainer", job.trainer.backend, job.trainer.options, file, field="trainer.backend",
                          prefix="trainer.options")


# ---- the loop ----------------------------------------------------------------------------------------------

def colocated_runs_sync(job: JobSpec, file: str | None) -> None:
    """resources.colocate × run.loop: one process per GPU cannot overlap generation and training."""
    if job.resources.colocate and job.run.loop != "sync":
        raise ConfigError(f"expected 'sync' with resources.colocate = true (one process cannot overlap generation "
                          f"and training), got {job.run.loop!r}", file=file, field="run.loop")


def stale_samples_need_a_correction(job: JobSpec, file: str | None) -> None:
    """run.loop × run.stale_policy × algorithm.off_policy_correction."""
    if job.run.loop == "async" and job.run.stale_policy == "correct" and job.algorithm.off_policy_correction == "none":
        raise ConfigError("stale_policy = 'correct' keeps stale samples for importance correction: expected "
                          "algorithm.off_policy_correction = 'tis' or 'mis', got 'none'", file=file,
                          field="run.stale_policy")


def partial_rollouts_keep_their_stale_samples(job: JobSpec, file: str | None) -> None:
    """run.loop × rollout.partial_rollout × run.stale_policy: a sample continued over several batches keeps the
    version of its first chunk, so its staleness reaches max_staleness + chunks - 1 — past the window by
    construction — and the async drop policy would drop every group with a continued sample (the long answers)."""
    ro = job.rollout
    if not (job.run.loop == "async" and ro.partial_rollout and job.run.stale_policy == "drop"):
        return
    chunk = int(ro.options.get("partial_chunk", 0)) or max(1, ro.max_new_tokens // 2)
    chunks = -(-ro.max_new_tokens // chunk)
    if chunks > 1:
        raise ConfigError(f"partial rollouts continue a sample over up to {chunks} batches, so its staleness reaches "
                          f"max_staleness + {chunks - 1} and stale_policy = 'drop' would drop it: expected "
                          f"stale_policy = 'correct' (with algorithm.off_policy_correction) or partial_rollout = "
                          f"false, got 'drop'", file=file, field="run.stale_policy")


# Engines an elastic engine process has run (runtime.elastic: the plugin's factory in a world of one, weights by a
# group of two; tests/test_elastic_engines.py). "reference_process" supervises a child in place, which an elastic
# engine leaves to the trainer; vLLM's factory and update path are the same calls but have not run elastic yet.
ELASTIC_ENGINES = ("reference", "sglang")


def elastic_rollout_fits_the_loop(job: JobSpec, file: str | None) -> None:
    """resources.elastic_rollout × the loop: trainer rank 0 hands out each step's prompts one by one (the
    runtime.elastic package) and any engine may generate any of them, with a seed of the prompt's own. What that
    needs: separate groups, the sync loop, one prompt in -> one group out (no over-sampling, dynamic filter, partial
    rollouts or generator), an engine of one process (reference, or SGLang taking the weights through its own update
    path: runtime.elastic.weights) and one pipeline stage.
    spare_nodes: only an elastic job starts engines on them."""
    res, ro = job.resources, job.rollout
    if not res.elastic_rollout:
        if res.spare_nodes:
            raise ConfigError(f"expected resources.spare_nodes = 0 without elastic_rollout (nothing would start on "
                              f"them), got {res.spare_nodes}", file=file, field="resources.spare_nodes")
        return
    checks = [
        ("resources.colocate", not res.colocate, "false (colocated ranks are both trainer and engine)", "true"),
        ("run.loop", job.run.loop == "sync", "'sync'", repr(job.run.loop)),
        ("rollout.engine", ro.engine in ELASTIC_ENGINES, " or ".join(map(repr, ELASTIC_ENGINES)), repr(ro.engine)),
        ("rollout.gpus_per_engine", ro.gpus_per_engine == 1, "1 (one process per engine)", str(ro.gpus_per_engine)),
        ("rollout.partial_rollout", not ro.partial_rollout, "false (a prompt is generated whole by one engine)",
         "true"),
        ("rollout.dynamic_filter", not ro.dynamic_filter, "false (each prompt gives one group)", "true"),
        ("rollout.over_sample", ro.over_sample == 1.0, "1.0 (each prompt gives one group)", str(ro.over_sample)),
        ("rollout.generator", not ro.generator, "unset (the built-in generation, seeded per prompt)",
         repr(ro.generator)),
        ("trainer.pp", job.trainer.pp == 1, "1 (one weight source)", str(job.trainer.pp)),
        ("run.eval_every", job.run.eval_every == 0, "0 (no in-loop evaluation)", str(job.run.eval_every)),
        ("trainer.lora", job.trainer.lora is None, "unset", "a [trainer.lora] table"),
        ("reward_model.path", not job.reward_model.enabled,
         "unset (the elastic engines score their own groups; no [reward_model] group)", repr(job.reward_model.path)),
    ]
    for field, ok, expected, got in checks:
        if not ok:
            raise ConfigError(f"expected {expected} with resources.elastic_rollout = true, got {got}", file=file,
                              field=field)


def partial_rollouts_need_the_builtin_generation(job: JobSpec, file: str | None) -> None:
    """rollout.partial_rollout × rollout.generator: a custom generator owns its turns; it cannot be cut and
    continued."""
    if job.rollout.generator and job.rollout.partial_rollout:
        raise ConfigError(f"expected partial_rollout = false with a custom generator "
                          f"(rollout.generator = {job.rollout.generator!r}), got true", file=file,
                          field="rollout.partial_rollout")


def generator_params_fit_the_generator(job: JobSpec, file: str | None) -> None:
    """rollout.generator × rollout.generator_params (× the generator plugin's declared params)."""
    if job.rollout.generator:
        _plugin_params("generator", job.rollout.generator, job.rollout.generator_params, file,
                       field="rollout.generator", prefix="rollout.generator_params")


def task_params_fit_the_task(job: JobSpec, file: str | None) -> None:
    """data.source × data.params (× the task plugin's declared schema; a file source takes no params)."""
    source = job.data.source
    if source.startswith("task:"):
        _plugin_params("task", source.removeprefix("task:"), job.data.params, file, field="data.source",
                       prefix="data.params")
    elif job.data.params:
        raise ConfigError(f"a JSONL source takes no parameters: expected data.params = {{}} with data.source = "
                          f"{source!r}, got {sorted(job.data.params)}", file=file, field="data.params")


def _reward_name(job: JobSpec, file: str | None) -> str:
    """reward.name, or the reward a task source names when it is empty ("" when there is none)."""
    if job.reward.name or not job.data.source.startswith("task:"):
        return job.reward.name
    from milehpc import plugins

    return plugins.lookup("task", job.data.source.removeprefix("task:"), file=file, field="data.source").reward


def reward_params_fit_the_reward(job: JobSpec, file: str | None) -> None:
    """reward.name (or data.source's own reward) × reward.params (× the reward plugin's declared schema; a
    ``module:function`` reward's signature is checked where it is imported, inside the job)."""
    name = _reward_name(job, file)
    if name and ":" not in name:
        _plugin_params("reward", name, job.reward.params, file, field="reward.name", prefix="reward.params")


def algorithm_params_fit_the_plugins(job: JobSpec, file: str | None) -> None:
    """algorithm.advantage × algorithm.advantage_params, algorithm.loss × algorithm.loss_params (× each plugin's
    declared schema)."""
    from milehpc import plugins

    if not plugins.registry("advantage"):
        return
    alg = job.algorithm
    _plugin_params("advantage", alg.advantage, alg.advantage_params, file, field="algorithm.advantage",
                   prefix="algorithm.advantage_params")
    _plugin_params("loss", alg.loss, alg.loss_params, file, field="algorithm.loss", prefix="algorithm.loss_params")


def overlong_buffer_fits_the_response(job: JobSpec, file: str | None) -> None:
    """algorithm.overlong_buffer × rollout.max_new_tokens: DAPO's soft penalty ramps over the last
    overlong_buffer tokens before the maximal length, so the buffer must leave some length unpenalised."""
    buffer, most = job.algorithm.overlong_buffer, job.rollout.max_new_tokens
    if buffer >= most:
        raise ConfigError(f"expected overlong_buffer below rollout.max_new_tokens ({most}; the penalty ramps over "
                          f"the last overlong_buffer tokens), got {buffer}", file=file,
                          field="algorithm.overlong_buffer")


# ---- evaluation ------------------------------------------------------------------------------------------------

def evaluation_needs_validation_prompts(job: JobSpec, file: str | None) -> None:
    """run.eval_every × data.val_source × trainer.lora.adapters.*.val_source × eval.max_prompts: the in-loop
    evaluation runs on the held-out prompts, a finite number of them; several adapters each name their own."""
    every = job.run.eval_every
    if every <= 0:
        return
    adapters = job.trainer.lora.adapters if job.trainer.lora is not None else {}
    sources = {f"trainer.lora.adapters.{n}.val_source": a.val_source for n, a in adapters.items() if a.val_source}
    if adapters and job.data.val_source:
        raise ConfigError("with several adapters each adapter names its held-out prompts "
                          "(trainer.lora.adapters.NAME.val_source): expected data.val_source = '', got "
                          f"{job.data.val_source!r}", file=file, field="data.val_source")
    if adapters and not sources:
        raise ConfigError(f"run.eval_every = {every} evaluates on held-out prompts: expected "
                          f"trainer.lora.adapters.NAME.val_source for at least one of {', '.join(adapters)}, got none",
                          file=file, field=f"trainer.lora.adapters.{next(iter(adapters))}.val_source")
    if not adapters:
        if not job.data.val_source:
            raise ConfigError(f"run.eval_every = {every} evaluates on held-out prompts: expected data.val_source = "
                              "a file or 'task:NAME', got none", file=file, field="data.val_source")
        sources = {"data.val_source": job.data.val_source}
    for field, source in sources.items():
        if source.startswith("task:") and job.eval.max_prompts == 0:
            raise ConfigError(f"a generated validation task ({field} = {source!r}) has no end: expected "
                              "eval.max_prompts > 0, got 0", file=file, field="eval.max_prompts")


def evaluation_sees_synced_weights(job: JobSpec, file: str | None) -> None:
    """run.eval_every × run.update_weights_interval: an evaluation runs on the engines with the weights of its
    step, so that step must be one whose weights are synced anyway (an extra sync would change the rollouts)."""
    every, interval = job.run.eval_every, job.run.update_weights_interval
    if every > 0 and every % interval:
        raise ConfigError(f"expected a multiple of run.update_weights_interval ({interval}; the engines see the "
                          f"weights of those steps only), got {every}", file=file, field="run.eval_every")


# ---- plugin options --------------------------------------------------------------------------------------------

def trainer_options_fit_the_trainer(job: JobSpec, file: str | None) -> None:
    """trainer.backend × trainer.options (× the trainer plugin's declared options)."""
    _trainer_options(job, file)


def engine_options_fit_the_engine(job: JobSpec, file: str | None) -> None:
    """rollout.engine × rollout.options (× the engine plugin's declared options: unknown keys, types, and its own
    full check, e.g. SGLang's speculative decoding and reserved server args)."""
    from milehpc import plugins
    from milehpc.plugin_types import load_ref

    _plugin_params("engine", job.rollout.engine, job.rollout.options, file, field="rollout.engine",
                   prefix="rollout.options")
    spec = plugins.lookup("engine", job.rollout.engine, file=file, field="rollout.engine")
    if spec.check_options is not None:
        load_ref(spec.check_options)(job.rollout.options, file=file)


# ---- the model -------------------------------------------------------------------------------------------------

def model_family_is_supported(job: JobSpec, file: str | None) -> None:
    """model.path × model.arch × trainer.backend: a checkpoint folder's config.json names its family
    (``model_type``; ``arch`` is then unused), which must be one milehpc trains and serves, and one the Megatron
    trainer can express with trainer.backend = 'megatron' (milehpc.config.families). A folder this node cannot read
    is checked by the ranks when they load it."""
    from milehpc.config.families import check_family, check_megatron_family, folder_model_type

    if job.model.path and (model_type := folder_model_type(job.model.path)) is not None:
        check_family(model_type, file=file, field="model.path")
        if job.trainer.backend == "megatron":
            check_megatron_family(model_type, file=file)


# The engines that take image prompts and the vision families each serves. Why the others are refused, as measured
# here (README's VL section): sglang 0.5.23's CPU engine serves Qwen2.5-VL (logprobs = transformers' within 5e-7 in
# float32, 14-pixel patches) but its scheduler dies on a Qwen3-VL image prompt; vllm 0.32.0's Qwen2.5-VL class does
# not import in its environment (torchvision missing).
VISION_ENGINES: dict[str, tuple[str, ...]] = {
    "reference": ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"),  # every vision family (a test keeps them equal)
    "sglang": ("qwen2_5_vl",),
}
_SGLANG_QWEN3_VL = ("sglang 0.5.23's CPU scheduler dies on a Qwen3-VL image prompt (srt/managers/mm_schedule.py:428, "
                    "measured; cause not found)")
VISION_REFUSALS = {
    ("sglang", "qwen3_vl"): _SGLANG_QWEN3_VL,
    ("sglang", "qwen3_vl_moe"): _SGLANG_QWEN3_VL,
    "vllm": "vllm 0.32.0's Qwen2.5-VL class fails at import (vllm/model_executor/models/qwen2_vl.py imports "
            "transformers' Qwen2-VL image processor, which needs torchvision, absent from the vllm environment), and "
            "milehpc's vllm adapter sends token ids alone (no multi_modal_data) and syncs no vision tower",
}


def vision_models_roll_out_on_engines_that_take_images(job: JobSpec, file: str | None) -> None:
    """model.path × rollout.engine × rollout.generator × trainer.dp × model.freeze_vision: a vision-language
    checkpoint (milehpc.config.families VISION_FAMILIES) rolls out on an engine that feeds its family's images
    through the model (VISION_ENGINES), with no generator, on one trainer rank (the Megatron trainer is refused by
    model_family_is_supported); freeze_vision needs such a model."""
    from milehpc.config.families import VISION_FAMILIES, folder_model_type

    model_type = folder_model_type(job.model.path) if job.model.path else None
    engine = job.rollout.engine
    if model_type in VISION_FAMILIES and model_type not in VISION_ENGINES.get(engine, ()):
        why = VISION_REFUSALS.get((engine, model_type)) or VISION_REFUSALS.get(engine, "it takes no images")
        able = [name for name, families in VISION_ENGINES.items() if model_type in families]
        raise ConfigError(f"expected rollout.engine = {' or '.join(map(repr, able))} for a {model_type} model "
                          f"(images in the prompts; {why}), got {engine!r}", file=file, field="rollout.engine")
    if model_type in VISION_FAMILIES and job.rollout.generator:
        # A generator (multi-turn, tools, agents) re-renders its history as text and token ids: the image parts and
        # their pixels would be lost after the first turn.
        raise ConfigError(f"expected no rollout.generator for a vision-language model ({model_type}: multi-turn and "
                          f"tool generators do not carry image parts in their history), got "
                          f"{job.rollout.generator!r}", file=file, field="rollout.generator")
    if model_type in VISION_FAMILIES and job.trainer.dp > 1:
        # The trainer runs the embedding and the vision tower outside the DDP/FSDP wrapper's forward
        # (milehpc.models_vl): with more than one data-parallel rank their gradients would not be reduced.
        raise ConfigError(f"expected trainer.dp = 1 for a vision-language model ({model_type}; data-parallel VL "
                          f"training is not built yet), got {job.trainer.dp}", file=file, field="trainer.dp")
    if job.model.freeze_vision and model_type is not None and model_type not in VISION_FAMILIES:
        raise ConfigError(f"expected model.freeze_vision = false for a {model_type} model (it has no vision tower), "
                          "got true", file=file, field="model.freeze_vision")


def random_moe_has_an_moe_family(job: JobSpec, file: str | None) -> None:
    """model.num_experts × model.arch × model.path: a mixture of experts built from the [model] table is the MoE
    sibling of ``arch`` (Qwen2-MoE, Qwen3-MoE); a checkpoint's own config.json names its family."""
    from milehpc.config.families import random_model_type

    m = job.model
    if m.num_experts > 0 and not m.path:
        random_model_type(m.arch, m.num_experts, file=file)


# ---- precision -------------------------------------------------------------------------------------------------

def torch_trainer_has_no_fp8(job: JobSpec, file: str | None) -> None:
    """trainer.backend × trainer.precision: FP8 GEMMs (transformer-engine) are the megatron trainer's; the torch
    trainer would train in model.dtype and say nothing."""
    if job.trainer.backend == "torch" and job.trainer.precision == "fp8":
        raise ConfigError("expected 'fp32' or 'bf16' with trainer.backend = 'torch' (FP8 training needs "
                          "trainer.backend = 'megatron'), got 'fp8'", file=file, field="trainer.precision")


def reduced_precision_needs_bfloat16_weights(job: JobSpec, file: str | None) -> None:
    """trainer.precision × model.dtype × trainer.backend × rollout.engine: the torch trainer and the reference
    engines compute in model.dtype, so bf16/fp8 there needs bfloat16 weights (else the job trains or samples in
    another number format than it asked for, and rollout and trainer logprobs disagree)."""
    if job.trainer.precision == "fp32" or job.model.dtype == "bfloat16":
        return
    who = ("trainer.backend = 'torch'" if job.trainer.backend == "torch" else
           f"rollout.engine = {job.rollout.engine!r}" if job.rollout.engine in REFERENCE_ENGINES else None)
    if who:
        raise ConfigError(f"{who} computes in model.dtype: expected 'bfloat16' with trainer.precision = "
                          f"{job.trainer.precision!r}, got {job.model.dtype!r}", file=file, field="model.dtype")


# ---- trainers --------------------------------------------------------------------------------------------------

def megatron_kl_reference_is_the_initial_policy(job: JobSpec, file: str | None) -> None:
    """trainer.backend × algorithm.kl_coef × trainer.sft_warmup_steps: the Megatron trainer's KL reference is the
    initial policy, rebuilt from its source on resume (not checkpointed), so it cannot be a warmed-up policy."""
    tr = job.trainer
    if tr.backend == "megatron" and job.algorithm.kl_coef > 0 and tr.sft_warmup_steps > 0:
        raise ConfigError(f"expected sft_warmup_steps = 0 with a KL reference (algorithm.kl_coef = "
                          f"{job.algorithm.kl_coef:g}) and trainer.backend = 'megatron' (its reference is the initial "
                          f"policy; trainer.backend = 'torch' freezes the warmed-up one), got {tr.sft_warmup_steps}",
                          file=file, field="trainer.sft_warmup_steps")


def _experts(job: JobSpec, file: str | None) -> int:
    """The model's experts: a checkpoint folder's config.json when given (milehpc.config.shape), else the table's."""
    from milehpc.config.shape import model_shape

    return model_shape(job, file=file).num_experts


def megatron_moe_needs_tp_1(job: JobSpec, file: str | None) -> None:
    """trainer.backend × model.num_experts (or model.path's config.json) × trainer.tp: Megatron trains MoE with TP
    only together with sequence parallelism (transformer-engine/Apex)."""
    if job.trainer.backend == "megatron" and job.trainer.tp > 1 and (n := _experts(job, file)) > 0:
        raise ConfigError(f"expected trainer.tp = 1 for a mixture of experts (model.num_experts = "
                          f"{n}; split experts with trainer.ep), got {job.trainer.tp}",
                          file=file, field="trainer.tp")


def megatron_ep_divides_the_experts(job: JobSpec, file: str | None) -> None:
    """trainer.backend × trainer.ep × model.num_experts (or model.path's config.json): every expert-parallel rank
    holds as many experts."""
    ep = job.trainer.ep
    if job.trainer.backend == "megatron" and (n := _experts(job, file)) > 0 and n % ep:
        raise ConfigError(f"expected trainer.ep to divide the {n} experts (model.num_experts), got {ep}",
                          file=file, field="trainer.ep")


def fsdp_trains_the_policy_alone(job: JobSpec, file: str | None) -> None:
    """trainer.options.fsdp × trainer.dp × algorithm.kl_coef × algorithm.advantage (needs_critic), torch trainer:
    FSDP2 shards the policy over several trainer ranks; a reference or critic model would need the same."""
    if job.trainer.backend != "torch" or job.trainer.ranks == 1 or not _trainer_options(job, file)["fsdp"]:
        return
    est = _estimator(job, file)
    if job.algorithm.kl_coef > 0 or (est is not None and est.needs_critic):
        what = (f"algorithm.kl_coef = {job.algorithm.kl_coef:g}" if job.algorithm.kl_coef > 0 else
                f"algorithm.advantage = {job.algorithm.advantage!r} (a critic)")
        raise ConfigError(f"trainer.options.fsdp supports the policy alone: expected no KL reference (kl_coef = 0) "
                          f"and no critic on {job.trainer.ranks} trainer ranks, got {what}", file=file,
                          field="trainer.options.fsdp")


def distillation_needs_a_teacher(job: JobSpec, file: str | None) -> None:
    """algorithm.advantage (needs_teacher) × trainer.options.teacher_path, torch and megatron trainers."""
    if job.trainer.backend not in ("torch", "megatron"):
        return
    est = _estimator(job, file)
    if est is not None and est.needs_teacher and not _trainer_options(job, file)["teacher_path"]:
        raise ConfigError(f"on-policy distillation (algorithm.advantage = {job.algorithm.advantage!r}) needs a "
                          f"teacher: expected trainer.options.teacher_path = a local HF checkpoint folder, got none",
                          file=file, field="trainer.options.teacher_path")


def mini_batches_divide_the_batch(job: JobSpec, file: str | None) -> None:
    """trainer.mini_batch_size × rollout.prompts_per_step × rollout.n_samples: the rollout batch splits into whole
    mini-batches of samples (verl and slime refuse an uneven split alike)."""
    mbs, batch = job.trainer.mini_batch_size, job.rollout.prompts_per_step * job.rollout.n_samples
    if mbs and (mbs > batch or batch % mbs):
        raise ConfigError(f"expected a divisor of the rollout batch (rollout.prompts_per_step x n_samples = {batch} "
                          f"samples), got {mbs}", file=file, field="trainer.mini_batch_size")


def megatron_features_fit_the_layout(job: JobSpec, file: str | None) -> None:
    """trainer.recompute / sequence_parallel / cp / vpp × trainer.backend × trainer.tp × trainer.pp ×
    model.num_layers × model.num_experts × trainer.lora × algorithm.kl_coef × algorithm.advantage: Megatron's memory
    features
    (milehpc.train.megatron.model). Context parallelism is refused: megatron-core 0.16.1's local DotProductAttention
    asserts context_parallel_size == 1 ("only supported by TEDotProductAttention") and milehpc's trainer does not split
    sequences over CP ranks. Virtual pipeline stages (milehpc.train.megatron.chunks) split the layers evenly over
    pp * vpp chunks and train a dense policy alone (the reference, critic, teacher, LoRA and routing replay hold one
    model chunk per rank)."""
    tr = job.trainer
    features = [(tr.recompute != "none", "trainer.recompute", repr(tr.recompute)),
                (tr.sequence_parallel, "trainer.sequence_parallel", "true"),
                (tr.cp > 1, "trainer.cp", str(tr.cp)), (tr.vpp > 1, "trainer.vpp", str(tr.vpp))]
    if tr.backend != "megatron":
        for on, field, got in features:
            if on:
                raise ConfigError(f"a Megatron feature: expected trainer.backend = 'megatron', got {tr.backend!r} with "
                                  f"{field} = {got}", file=file, field=field)
        return
    if tr.cp > 1:
        raise ConfigError(f"expected 1: context parallelism needs transformer-engine's attention (megatron-core's "
                          f"local DotProductAttention asserts context_parallel_size == 1) and sequences split over CP "
                          f"ranks, which milehpc's trainer does not do yet; got {tr.cp}", file=file, field="trainer.cp")
    if tr.vpp > 1:
        _virtual_stages_fit(job, file)
    if tr.sequence_parallel and tr.tp == 1:
        raise ConfigError("sequence parallelism splits the sequence over the TP group: expected trainer.tp > 1 with "
                          "trainer.sequence_parallel = true, got 1", file=file, field="trainer.tp")
    if tr.sequence_parallel and tr.lora is not None:
        raise ConfigError("expected trainer.sequence_parallel = false with [trainer.lora] (the adapters' TP layers "
                          "take the whole sequence), got true", file=file, field="trainer.sequence_parallel")


def _virtual_stages_fit(job: JobSpec, file: str | None) -> None:
    tr, est = job.trainer, _estimator(job, file)
    layers = job.model.num_layers
    extra = [(job.model.num_experts > 0, f"model.num_experts = {job.model.num_experts}"),
             (tr.lora is not None, "[trainer.lora]"),
             (job.algorithm.kl_coef > 0, "a KL reference (algorithm.kl_coef > 0)"),
             (est is not None and est.needs_critic, f"a critic (algorithm.advantage = {job.algorithm.advantage!r})"),
             (est is not None and est.needs_teacher, f"a teacher (algorithm.advantage = {job.algorithm.advantage!r})")]
    if tr.pp == 1:
        raise ConfigError(f"virtual pipeline stages interleave the PP stages: expected trainer.pp > 1 with "
                          f"trainer.vpp = {tr.vpp}, got 1", file=file, field="trainer.pp")
    if not job.model.path and layers % (tr.pp * tr.vpp):
        raise ConfigError(f"expected trainer.pp x vpp ({tr.pp * tr.vpp}) to divide model.num_layers ({layers}), got "
                          f"vpp = {tr.vpp}", file=file, field="trainer.vpp")
    for on, what in extra:
        if on:
            raise ConfigError(f"virtual pipeline stages train a dense policy alone: expected trainer.vpp = 1 with "
                              f"{what}, got {tr.vpp}", file=file, field="trainer.vpp")


# ---- SGLang --------------------------------------------------------------------------------------------------

def sglang_stop_strings_need_a_tokenizer(job: JobSpec, file: str | None) -> None:
    """rollout.engine × rollout.stop × model.tokenizer: SGLang matches stop strings with its own tokenizer, which
    cannot be the toy one (token ids in and out, skip_tokenizer_init)."""
    if job.rollout.engine == "sglang" and job.rollout.stop and job.model.tokenizer == "toy":
        raise ConfigError("stop strings need a tokenizer SGLang can load: expected model.tokenizer = a tokenizer "
                          f"folder (or stop token ids), got 'toy' with stop = {job.rollout.stop!r}", file=file,
                          field="rollout.stop")


def vllm_serves_the_job(job: JobSpec, file: str | None) -> None:
    """rollout.engine = 'vllm' × rollout.top_k/top_p × rollout.gpus_per_engine × trainer.lora: what the vLLM engine
    does not serve yet (milehpc.config.vllm_options.check_job)."""
    from milehpc.config.vllm_options import check_job

    check_job(job, file)


def routing_replay_needs_moe(job: JobSpec, file: str | None) -> None:
    """rollout.engine × rollout.options.return_routed_experts × model.num_experts: SGLang returns routed experts
    of an MoE model only (unset = on for MoE models)."""
    if (job.rollout.engine == "sglang" and job.rollout.options.get("return_routed_experts") is True
            and _experts(job, file) == 0):
        raise ConfigError("routing replay needs an MoE model: expected model.num_experts > 0 with "
                          "return_routed_experts = true, got 0", file=file,
                          field="rollout.options.return_routed_experts")


# ---- LoRA ----------------------------------------------------------------------------------------------------

def lora_fits_the_trainer(job: JobSpec, file: str | None) -> None:
    """trainer.lora × trainer.backend × trainer.options × trainer.pp × trainer.distributed_optimizer ×
    trainer.precision × model.num_experts: the torch trainer's peft adapters train under DDP (peft under FSDP2
    sharding is not built); the Megatron trainer's TP-sharded adapters (milehpc.train.megatron.lora) train a dense
    model at any TP x DP on the local layer spec — no pipeline stages, distributed optimizer, transformer-engine
    layers, adapter dropout or modules_to_save yet. Several adapters (trainer.lora.adapters) train on the torch
    trainer, at any DP without FSDP (milehpc.train.multi_lora: one optimizer per adapter, gradients all-reduced per
    adapter; Megatron is not built for them)."""
    spec, tr = job.trainer.lora, job.trainer
    if spec is None:
        return
    if spec.adapters and tr.backend != "torch":
        raise ConfigError(f"several adapters train on the torch trainer (each adapter steps its own optimizer; "
                          f"Megatron is not built for them): expected trainer.backend = 'torch', got "
                          f"{tr.backend!r}", file=file, field="trainer.backend")
    if tr.backend == "torch":
        if tr.ranks > 1 and _trainer_options(job, file)["fsdp"]:
            raise ConfigError("[trainer.lora] trains under DDP: expected trainer.options.fsdp = false with several "
                              "trainer ranks, got true", file=file, field="trainer.options.fsdp")
        return
    if tr.backend != "megatron":
        raise ConfigError(f"[trainer.lora] trains with the torch or the megatron trainer: expected trainer.backend in "
                          f"'torch', 'megatron', got {tr.backend!r}", file=file, field="trainer.backend")
    why = "with [trainer.lora] on the megatron trainer"
    te = _trainer_options(job, file)["transformer_engine"]
    refused = [
        (tr.pp > 1, "trainer.pp", f"expected trainer.pp = 1 {why} (adapters over pipeline stages are not built), "
                                  f"got {tr.pp}"),
        (tr.distributed_optimizer, "trainer.distributed_optimizer",
         f"expected trainer.distributed_optimizer = false {why} (the adapter's optimizer state is small and "
         "checkpointed per rank), got true"),
        (_experts(job, file) > 0, "model.num_experts",
         f"expected a dense model {why} (adapters on experts are not built), got model.num_experts = "
         f"{_experts(job, file)}"),
        (tr.precision == "fp8" or te is True, "trainer.precision" if tr.precision == "fp8" else
         "trainer.options.transformer_engine",
         f"expected the local layer spec {why} (transformer-engine fuses the input norm into the adapted layers), "
         f"got {'precision fp8' if tr.precision == 'fp8' else 'transformer_engine = true'}"),
        (spec.dropout > 0, "trainer.lora.dropout", f"expected trainer.lora.dropout = 0 {why} (adapter dropout "
                                                   f"under TP is not built), got {spec.dropout}"),
        (bool(spec.modules_to_save), "trainer.lora.modules_to_save",
         f"expected no modules_to_save {why} (adapters only), got {spec.modules_to_save!r}"),
    ]
    for broken, field, message in refused:
        if broken:
            raise ConfigError(message, file=file, field=field)


# The module kinds SGLang's LoRA adapts on the dense HF families milehpc builds (``SUPPORTED_LORA_TARGET_MODULES`` of
# sglang 0.5.23 that these models have as nn.Linear; milehpc.rollout.sglang_lora starts the engine with all of them).
SGLANG_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Engines that load a synced adapter through their LoRA API (by rule name -> how messages name them).
LORA_API_ENGINES = {"sglang": "SGLang", "vllm": "vLLM"}


def lora_rolls_out_where_adapters_load(job: JobSpec, file: str | None) -> None:
    """trainer.lora × rollout.engine × trainer.lora.modules_to_save × trainer.lora.target_modules × model.num_experts:
    the reference engine merges any synced adapter; SGLang loads adapter matrices through its LoRA API (milehpc.
    rollout.sglang_lora) — on a dense model, not modules trained in full, and only on the module kinds it has LoRA
    layers for (a pattern with wildcards in its last part is resolved on the ranks and checked there). Several
    adapters (trainer.lora.adapters × rollout.* × algorithm.advantage × reward.by_source): :func:`_adapters_roll_out`."""
    spec = job.trainer.lora
    if spec is not None and spec.adapters:
        _adapters_roll_out(job, file)
    if spec is None or job.rollout.engine in REFERENCE_ENGINES:
        return
    if job.rollout.engine not in LORA_API_ENGINES:
        raise ConfigError(f"[trainer.lora] syncs adapters that the reference, SGLang or vLLM engine loads: expected "
                          f"rollout.engine in {', '.join(map(repr, (*REFERENCE_ENGINES, *LORA_API_ENGINES)))}, got "
                          f"{job.rollout.engine!r}", file=file, field="rollout.engine")
    # vLLM loads the adapter as a LoRARequest (milehpc.rollout.vllm_worker), translated as for SGLang: the same limits.
    engine = LORA_API_ENGINES[job.rollout.engine]
    if (experts := _experts(job, file)) > 0:
        raise ConfigError(f"expected a dense model with [trainer.lora] on rollout.engine = {job.rollout.engine!r} "
                          f"({engine}'s expert adapters need GPU kernels), got model.num_experts = {experts}",
                          file=file, field="model.num_experts")
    if spec.modules_to_save:
        raise ConfigError(f"{engine}'s LoRA API loads adapters only: expected no modules_to_save with rollout.engine "
                          f"= {job.rollout.engine!r}, got {spec.modules_to_save!r}", file=file,
                          field="trainer.lora.modules_to_save")
    kinds = {p.rsplit(".", 1)[-1] for p in spec.target_modules}
    literal = {k for k in kinds if not any(c in k for c in "*?[")}
    unknown = sorted(literal - set(SGLANG_LORA_MODULES))
    qkv = literal & {"q_proj", "k_proj", "v_proj"}
    if unknown or (qkv and len(literal) == len(kinds) and not {"q_proj", "v_proj"} <= qkv):
        got = f"{unknown}" if unknown else f"{sorted(qkv)} without {sorted({'q_proj', 'v_proj'} - qkv)}"
        raise ConfigError(f"expected modules {engine}'s LoRA adapts ({', '.join(SGLANG_LORA_MODULES)}; q_proj and "
                          f"v_proj together, {engine} stacks q/k/v), got {got}", file=file,
                          field="trainer.lora.target_modules")


def _adapters_roll_out(job: JobSpec, file: str | None) -> None:
    """Several adapters: the reference engine generates each adapter's prompts with that adapter merged (SGLang with
    each adapter loaded by name: milehpc.rollout.sglang_lora; what it refuses for one adapter it refuses here), in plain
    generation rounds (no partial rollouts or custom generators: a continuation would not know its adapter); each
    adapter's source, params and reward fit their plugins, every adapter gets at least one prompt per step and every
    engine an equal part of a step (milehpc.data.adapters); no critic (it would be shared by the adapters)."""
    from milehpc.config.job import adapter_prompts, reward_route

    spec, ro = job.trainer.lora, job.rollout
    assert spec is not None
    refused = [
        (ro.engine not in ("reference", "sglang"), "rollout.engine",
         f"expected rollout.engine = 'reference' or 'sglang' with several adapters (the reference engine merges each "
         f"adapter for its prompts, SGLang loads each under its own name), got {ro.engine!r}"),
        (ro.partial_rollout, "rollout.partial_rollout", "expected rollout.partial_rollout = false with several "
                                                        "adapters, got true"),
        (ro.generator is not None, "rollout.generator", f"expected no rollout.generator with several adapters (the "
                                                        f"built-in generation routes them), got {ro.generator!r}"),
        (bool(job.reward.by_source), "reward.by_source", "expected no reward.by_source with several adapters (each "
                                                         "adapter names its reward), got a table"),
        (ro.prompts_per_step % ro.engines != 0, "rollout.prompts_per_step",
         f"expected rollout.prompts_per_step to be a multiple of rollout.engines ({ro.engines}) with several adapters "
         f"(each engine's share of a step then holds every adapter's share), got {ro.prompts_per_step}"),
    ]
    est = _estimator(job, file)
    if est is not None and est.needs_critic:
        refused.append((True, "algorithm.advantage",
                        f"expected an estimator without a critic with several adapters (one critic of the base would "
                        f"be trained on every adapter's returns), got {job.algorithm.advantage!r}"))
    for broken, field, message in refused:
        if broken:
            raise ConfigError(message, file=file, field=field)
    quotas = adapter_prompts(spec, ro.prompts_per_step)
    total = sum(quotas.values())
    for name, adapter in spec.adapters.items():
        where = f"trainer.lora.adapters.{name}"
        if quotas[name] < 1 or total > ro.prompts_per_step or (total < ro.prompts_per_step and all(
                a.prompts_per_step is not None for a in spec.adapters.values())):
            raise ConfigError(f"expected the adapters' prompts_per_step to share rollout.prompts_per_step "
                              f"({ro.prompts_per_step}) with at least 1 each, got {quotas}", file=file,
                              field=f"{where}.prompts_per_step")
        task = ""
        if adapter.source.startswith("task:"):
            _plugin_params("task", adapter.source.removeprefix("task:"), adapter.params, file,
                           field=f"{where}.source", prefix=f"{where}.params")
            from milehpc import plugins

            if plugins.registry("task"):
                task = plugins.lookup("task", adapter.source.removeprefix("task:"), file=file,
                                      field=f"{where}.source").reward
        elif adapter.params:
            raise ConfigError(f"a file source takes no parameters: expected {where}.params = {{}}, got "
                              f"{sorted(adapter.params)}", file=file, field=f"{where}.params")
        name_, params = reward_route(adapter.reward) if adapter.reward != "" else ("", {})
        reward = name_ or task or job.reward.name
        if not reward:
            raise ConfigError("expected a reward: the source has none of its own and reward.name is empty", file=file,
                              field=f"{where}.reward")
        if ":" not in reward:
            _plugin_params("reward", reward, params if name_ else ({} if task else job.reward.params), file,
                           field=f"{where}.reward", prefix=f"{where}.reward.params")


# Options first (later rules read them); the first rule broken is the one reported.
RULES: tuple[Rule, ...] = (
    trainer_options_fit_the_trainer, engine_options_fit_the_engine, generator_params_fit_the_generator,
    task_params_fit_the_task, reward_params_fit_the_reward, algorithm_params_fit_the_plugins,
    overlong_buffer_fits_the_response, colocated_runs_sync, stale_samples_need_a_correction, partial_rollouts_keep_their_stale_samples,
    partial_rollouts_need_the_builtin_generation, elastic_rollout_fits_the_loop,
    model_family_is_supported, vision_models_roll_out_on_engines_that_take_images, random_moe_has_an_moe_family, torch_trainer_has_no_fp8, reduced_precision_needs_bfloat16_weights,
    megatron_kl_reference_is_the_initial_policy, megatron_moe_needs_tp_1,
    megatron_ep_divides_the_experts, mini_batches_divide_the_batch, megatron_features_fit_the_layout,
    fsdp_trains_the_policy_alone, distillation_needs_a_teacher,
    sglang_stop_strings_need_a_tokenizer, vllm_serves_the_job, routing_replay_needs_moe, lora_fits_the_trainer,
    lora_rolls_out_where_adapters_load, evaluation_needs_validation_prompts, evaluation_sees_synced_weights,
)


def check_job_rules(job: JobSpec, *, file: str | None = None) -> None:
    """Every cross-table rule; the first one broken is one :class:`ConfigError`."""
    for rule in RULES:
        rule(job, file)


def check_single_process(job: JobSpec, *, file: str | None = None) -> None:
    """The in-process runner (:func:`milehpc.runtime.loop.run_local`): the job rules, and the sync loop only."""
    check_job_rules(job, file=file)
    if job.run.loop != "sync":
        raise ConfigError(f"expected run.loop = 'sync' for a single-process run, got {job.run.loop!r}", file=file,
                          field="run.loop")


# ---- the job on the site's devices -----------------------------------------------------------------------------
SiteRule = Callable[["JobSpec", "Partition", "str | None"], None]
ROCM_CONTAINER = "containers/milehpc-rocm.def"


def _cuda_capability(arch: str) -> int | None:
    """``sm_90`` -> 90 (compute capability 9.0); None for an arch that is not an NVIDIA ``sm_NN``."""
    import re

    m = re.fullmatch(r"sm_(\d+)[a-z]?", arch)
    return int(m.group(1)) if m else None


def mxfp8_needs_sm100(job: JobSpec, partition: Partition, file: str | None) -> None:
    """trainer.fp8_recipe × devices.arch: transformer-engine runs MXFP8BlockScaling only on compute capability
    >= 10.0 (``transformer_engine/pytorch/fp8.py`` ``check_mxfp8_support``); on a Hopper it fails at the first
    FP8 GEMM, after the job has queued and loaded."""
    if job.trainer.precision != "fp8" or job.trainer.fp8_recipe != "mxfp8" or partition.devices.vendor != "nvidia":
        return
    cc = _cuda_capability(partition.devices.arch)
    if cc is not None and cc < 100:
        raise ConfigError(f"expected an fp8_recipe for devices.arch = {partition.devices.arch!r} of the site "
                          "partition ('delayed', 'tensorwise' or 'blockwise'; mxfp8 needs compute capability >= 10.0, "
                          "sm_100), got 'mxfp8'", file=file, field="trainer.fp8_recipe")


def amd_has_no_transformer_engine(job: JobSpec, partition: Partition, file: str | None) -> None:
    """devices.vendor × trainer.precision × trainer.options.transformer_engine: transformer-engine on PyPI is
    CUDA-only and the ROCm container has none, so FP8 (TE's GEMMs) or an explicit TE spec cannot build there;
    bf16 Megatron takes the local spec (milehpc.train.megatron.model.te_spec_choice)."""
    if partition.devices.vendor != "amd" or job.trainer.backend != "megatron":
        return
    if job.trainer.precision == "fp8":
        raise ConfigError(f"expected 'bf16' or 'fp32' on an AMD partition (FP8 needs transformer-engine, which "
                          f"{ROCM_CONTAINER} does not have), got 'fp8'", file=file, field="trainer.precision")
    if _trainer_options(job, file)["transformer_engine"]:
        raise ConfigError(f"expected false or unset on an AMD partition ({ROCM_CONTAINER} has no "
                          "transformer-engine; bf16 runs on the local layer spec), got true", file=file,
                          field="trainer.options.transformer_engine")


def amd_has_no_colocation(job: JobSpec, partition: Partition, file: str | None) -> None:
    """devices.vendor × resources.colocate × rollout.engine: a colocated SGLang engine pauses the trainer with
    torch_memory_saver, whose 0.0.10 wheel holds CUDA builds only (every ``.so`` needs libcuda.so.1 and libcudart;
    ROCm needs a hipcc build from the sdist, which no shipped container makes), so the first pause would fail on the
    node. The reference engine offloads nothing (:func:`milehpc.runtime.offload.for_job`) and may colocate."""
    if partition.devices.vendor == "amd" and job.resources.colocate and job.rollout.engine == "sglang":
        raise ConfigError("expected false on an AMD partition (torch_memory_saver's wheel is CUDA-only and "
                          f"{ROCM_CONTAINER} builds none for HIP: run the trainer and the engines on their own "
                          "GPUs) for rollout.engine = 'sglang', got true", file=file, field="resources.colocate")


def engine_is_in_the_container(job: JobSpec, partition: Partition, file: str | None) -> None:
    """rollout.engine × the partition's containers.RUNTIME.engines (the job runs in an image): an engine the site's
    image does not hold fails on the node, at the first import, after the job has queued. A site that declares no
    list is not checked; a job that brings an image with other engines restates the list in its [site] table."""
    from milehpc.config.job import named_rewards
    from milehpc.config.reward_model import judge_engines

    runtime = job.container.runtime
    platform = partition.containers.get(runtime)
    if not job.container.image or platform is None or not platform.engines:
        return
    # A generative judge's engine too (issue 35: it runs in the same image, on the reward or rollout ranks).
    for field, engine in [("rollout.engine", job.rollout.engine), *judge_engines(named_rewards(job.reward))]:
        if engine not in platform.engines:
            raise ConfigError(f"expected an engine the site's {runtime} image has (site field containers.{runtime}."
                              f"engines = {', '.join(platform.engines)}; an image with other engines: restate the "
                              f"list in the job's [site.containers.{runtime}] engines), got {engine!r}", file=file,
                              field=field)


def time_fits_the_partition(job: JobSpec, partition: Partition, file: str | None) -> None:
    """resources.time × the partition's time_limit: sbatch refuses (or the job pends forever with
    PartitionTimeLimit) a job asking for more time than its partition gives."""
    from milehpc.config.slurm_time import describe, job_time, seconds

    asked = job_time(job.resources.time, partition.time_limit)
    want, limit = seconds(asked), seconds(partition.time_limit)
    if limit is not None and (want is None or want > limit):
        def shown(text: str, secs: int | None) -> str:  # the value as written, and in D-HH:MM:SS when that differs
            return text if describe(secs) == text else f"{text} ({describe(secs)})"

        raise ConfigError(f"expected at most the site partition's time_limit {shown(partition.time_limit, limit)}, "
                          f"got {shown(asked, want)}", file=file, field="resources.time")


def required_account_is_set(job: JobSpec, partition: Partition, file: str | None) -> None:
    """access.account_required × access.account (the job's [site.access]): the site refuses a job without one."""
    access = partition.access
    if partition.scheduler == "slurm" and access.account_required and not access.account:
        raise ConfigError("the site requires an account: expected [site.access] account = \"NAME\" in the job (or "
                          "--set site.access.account=NAME), got none", file=file, field="site.access.account")


def elastic_rollout_needs_slurm_steps(job: JobSpec, partition: Partition, file: str | None) -> None:
    """resources.elastic_rollout × the partition's scheduler/launcher: the rollout nodes run as srun steps of
    their own (the local scheduler starts them as plain processes beside mpirun)."""
    if job.resources.elastic_rollout and partition.scheduler == "slurm" and partition.launcher.kind != "srun":
        raise ConfigError(f"expected launcher.kind = 'srun' for resources.elastic_rollout (each rollout node is a job "
                          f"step of its own), got {partition.launcher.kind!r}", file=file,
                          field="resources.elastic_rollout")


SITE_RULES: tuple[SiteRule, ...] = (mxfp8_needs_sm100, amd_has_no_transformer_engine, amd_has_no_colocation,
                                    engine_is_in_the_container, time_fits_the_partition, required_account_is_set,
                                    elastic_rollout_needs_slurm_steps)


def check_site_rules(job: JobSpec, partition: Partition, *, file: str | None = None) -> None:
    """The job against its partition's devices (login node, with the job rules); the first broken is one line."""
    for rule in SITE_RULES:
        rule(job, partition, file)

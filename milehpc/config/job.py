"""The job spec: one TOML file that says what to train, how, where and for how long."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from milehpc.config.families import RANDOM_ARCHS
from milehpc.config.reward_model import RewardModelSpec, check_reward_group
from milehpc.config.schema import opt
from milehpc.config.slurm_time import TIME, TIME_EXPECT
from milehpc.config.slurm_time import coerce as slurm_time
from milehpc.errors import ConfigError
from milehpc.plugin_types import schema_defaults

NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
ENV_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
ADAPTER_NAME = r"[A-Za-z][A-Za-z0-9_]{0,31}"
# peft keeps each adapter under its name in torch ModuleDicts, which refuse a key that is already an attribute of the
# dict ("attribute 'train' already exists" on the ranks, after the allocation): such names are refused at load.
# tests/test_lora_multi.py checks this covers the installed torch's nn.ModuleDict (with transformers and peft loaded).
ADAPTER_RESERVED = frozenset((
    "T_destination", "add_module", "apply", "bfloat16", "buffers", "call_super_init", "children", "clear", "compile",
    "cpu", "cuda", "double", "dump_patches", "eval", "extra_repr", "float", "forward", "get_buffer",
    "get_extra_state", "get_parameter", "get_submodule", "half", "ipu", "items", "keys", "load_state_dict", "modules",
    "mtia", "named_buffers", "named_children", "named_modules", "named_parameters", "parameters", "pop",
    "register_backward_hook", "register_buffer", "register_forward_hook", "register_forward_pre_hook",
    "register_full_backward_hook", "register_full_backward_pre_hook", "register_module", "register_parameter",
    "register_state_dict_post_hook", "register_state_dict_pre_hook", "requires_grad_", "set_extra_state",
    "set_submodule", "share_memory", "state_dict", "to", "to_empty", "train", "training", "type", "update", "values",
    "xpu", "zero_grad", "default", "smart_apply",  # the last: transformers adds it to every torch module
))


@dataclass
class ModelSpec:
    arch: Literal[RANDOM_ARCHS] = opt("qwen2", help="family of a random model built from this table (a local "
                                      "folder's config.json names its own: model_type)")
    path: str | None = opt(None, help="local HF checkpoint folder; unset = build a random model from this table")
    tokenizer: str = opt("toy", help="'toy' (the task's character vocabulary) or a local tokenizer folder")
    hidden_size: int = opt(128, min=8)
    num_layers: int = opt(2, min=1)
    num_heads: int = opt(4, min=1)
    num_kv_heads: int = opt(2, min=1)
    intermediate_size: int = opt(256, min=1)
    max_position_embeddings: int = opt(256, min=8)
    vocab_size: int | None = opt(None, min=1, help="unset = the tokenizer's size")
    num_experts: int = opt(0, min=0, help="> 0 makes the MLP a mixture of experts")
    moe_top_k: int = opt(2, min=1)
    tie_word_embeddings: bool = opt(False)
    dtype: Literal["float32", "bfloat16", "float16"] = opt("float32")
    freeze_vision: bool = opt(False, help="a vision-language model: train the LM alone (the vision tower stays as "
                              "loaded and the weight sync sends the LM only)")

    def validate(self, *, file: str | None, prefix: str) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"expected num_heads ({self.num_heads}) to be a multiple of num_kv_heads, got {self.num_kv_heads}",
                file=file, field=f"{prefix}.num_kv_heads",
            )
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"expected hidden_size ({self.hidden_size}) to be a multiple of num_heads, got {self.num_heads}",
                file=file, field=f"{prefix}.num_heads",
            )

@dataclass
class RolloutLoopOptions:
    """``rollout.options`` the loop itself reads, whatever the engine. Engines that let a job set them declare this
    as their plugin schema (milehpc.builtin.engines)."""

    partial_chunk: int = opt(0, min=0, help="partial rollout: tokens per chunk; 0 = half of max_new_tokens")
    max_filter_rounds: int = opt(4, min=1, help="dynamic filter: generation rounds per step to fill the batch")
    # The SGLang engine's own options declare the same name and default (milehpc.config.sglang_options).
    weight_bucket_mb: int = opt(512, min=1, help="bucket size of the weight sync to the rollout ranks")


ROLLOUT_LOOP_OPTIONS = schema_defaults(RolloutLoopOptions)


def sync_bucket_bytes(job: JobSpec) -> int:
    """The weight sync's bucket size, ``rollout.options.weight_bucket_mb`` (every engine; issue 33: the trainer cuts
    the buckets for SGLang, vLLM and the reference engines alike)."""
    return int({**ROLLOUT_LOOP_OPTIONS, **job.rollout.options}["weight_bucket_mb"]) << 20


@dataclass
class RolloutSpec:
    engine: str = opt("reference", pattern=NAME, expect="an engine name", help="rollout engine plugin")
    engines: int = opt(1, min=1, help="number of engine instances")
    gpus_per_engine: int = opt(1, min=1, help="GPUs (ranks) per engine; on CPU sites, ranks per engine")
    generator: str | None = opt(None, help="custom generation plugin (multi-turn / agentic)")
    generator_params: dict[str, Any] = opt({})
    prompts_per_step: int = opt(16, min=1)
    n_samples: int = opt(8, min=1, help="samples per prompt (the group size)")
    temperature: float = opt(1.0, min=0.0)
    top_p: float = opt(1.0, min=0.0, max=1.0)
    top_k: int = opt(0, min=0, help="0 = off")
    max_new_tokens: int = opt(16, min=1)
    stop: list[str] = opt([], help="stop strings")
    over_sample: float = opt(1.0, min=1.0, help="generate this many times the groups needed (dynamic filter)")
    dynamic_filter: bool = opt(False, help="drop groups whose rewards are all equal")
    partial_rollout: bool = opt(False, help="carry unfinished samples to the next step")
    options: dict[str, Any] = opt({}, help="engine-specific options (e.g. SGLang server args, speculative decoding)")


@dataclass
class AdapterSpec:
    """``[trainer.lora.adapters.NAME]``: one of several adapters trained in one job on one base (multi-LoRA), with its
    own prompts, reward and optimizer; rank, alpha, dropout and target modules are ``[trainer.lora]``'s."""

    source: str = opt(help="this adapter's prompts: 'task:NAME' or a local file (as data.source; the other [data] "
                           "settings apply)")
    params: dict[str, Any] = opt({}, help="the task's parameters (as data.params)")
    reward: Any = opt("", help="a reward name or a table {name, params}; empty = the source task's own reward, "
                               "else reward.name")
    lr: float | None = opt(None, min=0.0, help="this adapter's peak LR; unset = trainer.lr")
    weight_decay: float | None = opt(None, min=0.0, help="unset = trainer.weight_decay")
    prompts_per_step: int | None = opt(None, min=1, help="this adapter's prompts per step; unset = an even share of "
                                                         "what the other adapters leave of rollout.prompts_per_step")
    val_source: str = opt("", help="this adapter's held-out prompts (as data.val_source), answered with it every "
                                   "run.eval_every steps; empty = this adapter is not evaluated")

    def validate(self, *, file: str | None, prefix: str) -> None:
        name, params = reward_route(self.reward) if self.reward != "" else ("", {})
        if (self.reward != "" and not name) or not isinstance(params, dict):
            raise ConfigError(f"expected a reward name or a table {{name, params}}, got {self.reward!r}", file=file,
                              field=f"{prefix}.reward")


@dataclass
class LoraSpec:
    """``[trainer.lora]``: train low-rank adapters (``peft``) on a frozen base instead of the whole model."""

    rank: int = opt(8, min=1, help="adapter rank r")
    alpha: float = opt(16.0, min=0.0, help="scaling numerator: the update is (alpha / rank) * B @ A")
    dropout: float = opt(0.0, min=0.0, max=1.0, help="dropout on the adapter's input (training only)")
    target_modules: list[str] = opt(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        help="linear layers that get adapters: fnmatch patterns of module names; a pattern without '.' also "
             "matches the last part of a name ('q_proj' matches model.layers.0.self_attn.q_proj)")
    modules_to_save: list[str] = opt([], help="modules trained in full and synced with the adapter (e.g. lm_head)")
    adapters: dict[str, AdapterSpec] = opt({}, help="multi-LoRA: several named adapters, each with its own prompts, "
                                                    "reward and optimizer ([trainer.lora.adapters.NAME]); "
                                                    "empty = one adapter on [data]")

    def __post_init__(self) -> None:
        # The adapters in name order, whatever the TOML's: their seeds, shares of a step and stepping order follow
        # it, so reordering the tables (e.g. between a run and its resume) changes nothing.
        self.adapters = dict(sorted(self.adapters.items()))

    def validate(self, *, file: str | None, prefix: str) -> None:
        if not self.target_modules:
            raise ConfigError("expected at least one module name pattern, got []", file=file,
                              field=f"{prefix}.target_modules")
        for name in self.adapters:
            # The name travels in tensor names (module.lora_A.NAME.weight) and becomes an export folder.
            if not re.fullmatch(ADAPTER_NAME, name) or name in ADAPTER_RESERVED:
                raise ConfigError(f"expected an adapter name of letters, digits and '_', not 'default' (peft's name of "
                                  f"a lone adapter) or a torch module attribute, got {name!r}", file=file,
                                  field=f"{prefix}.adapters.{name}")
        if len(self.adapters) == 1:
            raise ConfigError(f"expected two or more adapters (one adapter: [trainer.lora] on [data] alone), got "
                              f"{list(self.adapters)}", file=file, field=f"{prefix}.adapters")


def adapter_prompts(spec: LoraSpec, prompts_per_step: int) -> dict[str, int]:
    """Each adapter's prompts per step: its own ``prompts_per_step``, or an even share (the first ones take the
    remainder) of what those leave of ``prompts_per_step``; a share below 1 is 0 (the job rules refuse it)."""
    fixed = {n: a.prompts_per_step for n, a in spec.adapters.items() if a.prompts_per_step is not None}
    rest = [n for n in spec.adapters if n not in fixed]
    left = prompts_per_step - sum(fixed.values())
    share, extra = divmod(max(left, 0), len(rest)) if rest else (0, 0)
    return {n: fixed[n] if n in fixed else share + (rest.index(n) < extra) for n in spec.adapters}


@dataclass
class TrainerSpec:
    backend: str = opt("torch", pattern=NAME, expect="a trainer name")
    tp: int = opt(1, min=1, help="tensor parallel size")
    pp: int = opt(1, min=1, help="pipeline parallel size")
    dp: int = opt(1, min=1, help="data parallel size; trainer ranks = tp * pp * dp")
    ep: int = opt(1, min=1, help="expert parallel size (MoE)")
    micro_batch_size: int = opt(8, min=1)
    # Issue 33: batching like verl/slime, and Megatron's memory features (milehpc.train.micro_batches; rules in
    # milehpc.config.rules).
    mini_batch_size: int = opt(0, min=0, help="samples per optimizer step, over all DP ranks (verl's "
                                              "ppo_mini_batch_size x n, slime's global batch size): several steps per "
                                              "rollout batch; 0 = the whole batch, one step")
    max_tokens_per_micro_batch: int = opt(0, min=0, help="micro-batches by token budget: sequences (prompt + "
                                                         "response tokens) packed up to it (verl's "
                                                         "ppo_max_token_len_per_gpu); 0 = micro_batch_size rows")
    recompute: Literal["none", "full", "selective"] = opt("none", help="megatron: activation recomputation "
                                                                       "(full: every layer; selective: core attention)")
    sequence_parallel: bool = opt(False, help="megatron: sequence parallelism over the TP group (needs tp > 1)")
    cp: int = opt(1, min=1, help="megatron: context parallel size (refused: needs transformer-engine attention)")
    vpp: int = opt(1, min=1, help="megatron: virtual pipeline stages per PP rank (interleaved 1F1B; needs pp > 1, "
                                  "a dense policy alone)")
    lr: float = opt(1e-4, min=0.0)
    min_lr: float = opt(0.0, min=0.0)
    lr_schedule: Literal["constant", "cosine", "linear"] = opt("constant")
    warmup_steps: int = opt(0, min=0)
    weight_decay: float = opt(0.0, min=0.0)
    adam_beta1: float = opt(0.9, min=0.0, max=1.0)
    adam_beta2: float = opt(0.999, min=0.0, max=1.0)
    adam_eps: float = opt(1e-8, min=0.0)
    clip_grad: float = opt(1.0, min=0.0, help="0 = no clipping")
    distributed_optimizer: bool = opt(False)
    precision: Literal["fp32", "bf16", "fp8"] = opt("fp32", help="bf16/fp8 use transformer-engine on GPUs")
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = opt("delayed")
    sft_warmup_steps: int = opt(0, min=0, help="supervised steps on the task's labels before RL")
    sft_lr: float | None = opt(None, min=0.0)
    options: dict[str, Any] = opt({})
    lora: LoraSpec | None = opt(None, help="[trainer.lora]: train adapters only (torch or megatron trainer, reference engine)")

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass
class AlgorithmSpec:
    advantage: str = opt("grpo", pattern=NAME, expect="an advantage estimator name")
    advantage_params: dict[str, Any] = opt({})
    loss: str = opt("ppo_clip", pattern=NAME, expect="a policy loss name")
    loss_params: dict[str, Any] = opt({})
    loss_agg_mode: Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = opt("token-mean")
    kl_coef: float = opt(0.0, min=0.0)
    kl_type: Literal["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"] = opt(
        "k3", help="verl's names: k1 = kl, k2 = mse, k3 = low_var_kl, abs = |log p - log q|")
    kl_in_reward: bool = opt(False)
    entropy_coef: float = opt(0.0)
    off_policy_correction: Literal["none", "tis", "mis"] = opt("none")
    off_policy_level: Literal["token", "sequence"] = opt("token")
    off_policy_cap: float = opt(2.0, min=1.0)
    off_policy_lower: float = opt(0.0, min=0.0, help="mis: ratios below this are rejected too (verl's rejection "
                                                     "sampling uses 1 / off_policy_cap); 0 = no lower bound")
    ppo_epochs: int = opt(1, min=1)
    gamma: float = opt(1.0, min=0.0, max=1.0)
    lam: float = opt(1.0, min=0.0, max=1.0)
    value_clip: float = opt(0.5, min=0.0, help="critic value-loss clip range (0 = off)")
    value_coef: float = opt(1.0, min=0.0, help="weight of the critic's value loss when it shares the step")
    loss_agg_horizon: int = opt(0, min=0, help="seq-mean-token-sum-norm divisor; 0 = rollout.max_new_tokens")
    overlong_buffer: int = opt(0, min=0, help="DAPO soft overlong punishment: the last this many tokens before "
                                              "rollout.max_new_tokens ramp the reward down to -overlong_penalty; 0 = off")
    overlong_penalty: float = opt(1.0, min=0.0, help="the soft overlong penalty at rollout.max_new_tokens")
    overlong_filter: bool = opt(False, help="DAPO overlong filtering: truncated samples (they hit max_new_tokens) "
                                            "train on nothing, yet join their group's statistics")

    def validate(self, *, file: str | None, prefix: str) -> None:
        if self.off_policy_lower and self.off_policy_correction != "mis":
            raise ConfigError(f"off_policy_lower is the lower bound of 'mis': expected 0 with off_policy_correction "
                              f"= {self.off_policy_correction!r}, got {self.off_policy_lower:g}", file=file,
                              field=f"{prefix}.off_policy_lower")
        if self.off_policy_lower >= self.off_policy_cap:
            raise ConfigError(f"expected a value below off_policy_cap ({self.off_policy_cap:g}), got "
                              f"{self.off_policy_lower:g}", file=file, field=f"{prefix}.off_policy_lower")


@dataclass
class RewardSpec:
    name: str = opt("", help="reward plugin name or 'module:function'; empty = the task's own reward")
    params: dict[str, Any] = opt({})
    timeout_s: float = opt(60.0, min=0.0, help="per call of an async reward; 0 = no limit")
    max_concurrency: int = opt(64, min=1, help="async reward calls in flight at once")
    by_source: dict[str, Any] = opt({}, help="data_source -> reward for that source's samples: a name, or "
                                             "{name, params}; other sources get reward.name")

    def validate(self, *, file: str | None, prefix: str) -> None:
        from milehpc import plugins
        from milehpc.config.schema import check_params

        for source, route in self.by_source.items():
            where = f"{prefix}.by_source.{source}"
            name, params = reward_route(route)
            if not name or not isinstance(params, dict):
                raise ConfigError(f"expected a reward name or a table {{name, params}}, got {route!r}", file=file,
                                  field=where)
            if ":" not in name and plugins.registry("reward"):  # module:function: checked where it is imported
                spec = plugins.lookup("reward", name, file=file, field=where)
                check_params(spec, params, file=file, prefix=f"{where}.params")


def reward_route(route: Any) -> tuple[str, Any]:
    """``reward.by_source`` entry → (reward name, params); ("", None) when it is neither form."""
    if isinstance(route, str):
        return route, {}
    if isinstance(route, dict) and isinstance(route.get("name"), str) and set(route) <= {"name", "params"}:
        return route["name"], route.get("params", {})
    return "", None


def named_rewards(reward: RewardSpec) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(field, name, params) of every reward ``[reward]`` names: its own, ``by_source``'s, and ``combine``'s parts."""
    tops = [("reward", reward.name, reward.params)]
    tops += [(f"reward.by_source.{s}", *reward_route(r)) for s, r in reward.by_source.items()]
    for field, name, params in tops:
        yield field, name, params or {}
        if name == "combine":
            for i, part in enumerate((params or {}).get("rewards", [])):
                if isinstance(part, dict):
                    yield f"{field}.params.rewards[{i}]", str(part.get("name", "")), part.get("params") or {}


@dataclass
class DataSpec:
    source: str = opt("task:sort", help="'task:NAME' (a generated task), or a local .jsonl / .parquet file or "
                                        "datasets.save_to_disk folder (verl's and slime's layouts read as they are)")
    val_source: str | None = opt(None, help="held-out validation prompts (same forms as source), evaluated every "
                                         "run.eval_every steps with the [eval] settings")
    params: dict[str, Any] = opt({}, help="the task's parameters")
    prompt_key: str = opt("prompt", pattern=r"[^.\s]+(\.[^.\s]+)*", expect="a field name or dotted path",
                          help="the prompt's field: text or chat messages [{role, content}]")
    label_key: str = opt("label", pattern=r"[^.\s]+(\.[^.\s]+)*", expect="a field name or dotted path",
                         help="the answer's field (dotted path); 'label' falls back to verl's reward_model.ground_truth")
    chat_template: bool = opt(False, help="text prompts through the tokenizer's chat template too (messages always)")
    max_prompt_tokens: int = opt(0, min=0, help="drop longer prompts at the start (counts reported); 0 = keep all")
    shuffle: bool = opt(True)
    seed: int = opt(0)


@dataclass
class EvalSpec:
    """``[eval]``: how ``data.val_source`` is evaluated every ``run.eval_every`` steps and by ``milehpc eval`` (its
    own sampling and seed: training draws nothing from it)."""

    greedy: bool = opt(True, help="one greedy answer per prompt (temperature 0): eval/acc")
    n_samples: int = opt(0, min=0, help="sampled answers per prompt for pass@k; 0 = none")
    pass_k: list[int] = opt([1], help="the k of each pass@k reported (each 1 <= k <= n_samples)")
    temperature: float = opt(1.0, min=0.0, help="sampled answers: temperature (> 0)")
    top_p: float = opt(1.0, min=0.0, max=1.0)
    top_k: int = opt(0, min=0, help="0 = off")
    max_new_tokens: int = opt(0, min=0, help="0 = rollout.max_new_tokens")
    batch_size: int = opt(32, min=1, help="prompts per engine call (the in-loop and the offline eval batch alike)")
    max_prompts: int = opt(0, min=0, help="evaluate the first this many validation prompts; 0 = all")
    correct_threshold: float = opt(1.0, help="an answer is correct when its reward reaches this")
    seed: int = opt(0, help="seed of the sampled answers (batch b draws from seed + b)")

    def validate(self, *, file: str | None, prefix: str) -> None:
        if not self.greedy and self.n_samples == 0:
            raise ConfigError("expected greedy = true or n_samples > 0 (nothing to evaluate), got neither", file=file,
                              field=f"{prefix}.n_samples")
        if self.n_samples:
            bad = [k for k in self.pass_k if not 1 <= k <= self.n_samples]
            if bad:
                raise ConfigError(f"expected each k between 1 and n_samples ({self.n_samples}), got {bad[0]}",
                                  file=file, field=f"{prefix}.pass_k")
            if self.temperature == 0:
                raise ConfigError(f"expected temperature > 0 for {self.n_samples} sampled answers (temperature 0 "
                                  "gives the greedy one n times), got 0", file=file, field=f"{prefix}.temperature")


@dataclass
class ResourcesSpec:
    nodes: int | None = opt(None, min=1, help="unset = as many as the plan needs")
    time: str | None = opt(None, pattern=TIME, expect=TIME_EXPECT, coerce=slurm_time,
                           help="wall time as sbatch --time takes it, at most the site partition's time_limit; "
                                "unset = 01:00:00, or the partition's limit when that is shorter")
    partition: str | None = opt(None, pattern=NAME, expect="a partition name of the site")
    colocate: bool = opt(False, help="every rank is both trainer and rollout (shares GPUs)")
    elastic_rollout: bool = opt(False, help="each rollout node runs as a job step of its own that joins the trainer "
                                            "over TCP: a rollout node that dies costs its engines, not the job")
    spare_nodes: int = opt(0, min=0, help="nodes allocated beyond the layout (elastic_rollout): a rollout step that "
                                          "fails is started again on one of them")
    collective_timeout_s: float = opt(600.0, min=1.0)
    startup_timeout_s: float = opt(1800.0, min=1.0, help="how long the ranks wait for the slowest one to build its "
                                                      "engine and trainer (model loading, engine start-up)")
    use: list[str] = opt([], pattern=NAME, expect="a named resource of the site (e.g. nvme)",
                         help="named site resources to request, e.g. ['nvme'] on frontier-like")
    mail_user: str | None = opt(None, pattern=r"[A-Za-z0-9_.+-]+@[A-Za-z0-9.-]+", expect="an e-mail address")
    compute_only_inputs: list[str] = opt([], pattern=r"[A-Za-z0-9_.]+", expect="a job-spec field like data.source",
                                         help="fields whose paths exist on the compute nodes only (under the site's "
                                              "compute_only_paths, e.g. node-local NVMe): not looked for on the login "
                                              "node")


@dataclass
class ContainerSpec:
    image: str | None = opt(None, help="path of the .sif image; unset = no container")
    runtime: str = opt("apptainer", pattern=NAME, expect="a container runtime name")
    binds: list[str] = opt([])
    auto_binds: bool = opt(True, help="bind every path the job reads or writes (model, data, checkpoints, caches...) "
                                      "into the container; off = container.binds and the site's binds must cover them")
    env: dict[str, str] = opt({})
    flags: list[str] = opt([])


@dataclass
class CheckpointSpec:
    dir: str | None = opt(None, help="unset = RUN_DIR/checkpoints")
    interval_steps: int = opt(0, min=0, help="0 = only at the end and on signal")
    interval_minutes: float = opt(0.0, min=0.0)
    keep: int = opt(2, min=1)
    max_restarts: int = opt(3, min=0)
    signal_lead_s: int = opt(120, min=10, help="seconds before the time limit at which Slurm signals the job")
    resume: bool = opt(True)


@dataclass
class SandboxSpec:
    backend: str | None = opt(None, pattern=NAME, expect="a sandbox name",
                              help="sandbox for model-written programs (code rewards, tools); unset = the site's")
    image: str | None = opt(None, help="container image for the apptainer sandbox; unset = the site's")
    allow_unsandboxed: bool = opt(False, help="let backend = 'none' run model output on the host, unconfined")
    workers: int = opt(0, min=0, help="sandboxed programs running at once per rank; 0 = the rank's cores")
    params: dict[str, Any] = opt({}, help="the backend's parameters (milehpc.builtin.sandboxes)")

    def validate(self, *, file: str | None, prefix: str) -> None:
        if self.backend == "none" and not self.allow_unsandboxed:
            raise ConfigError("expected allow_unsandboxed = true to run model output without a sandbox "
                              "(backend = 'none'), got false", file=file, field=f"{prefix}.allow_unsandboxed")
        if self.backend:  # unset: the site partition's backend, checked with the site (render.rundir.prepare)
            from milehpc import plugins
            from milehpc.config.schema import check_params

            spec = plugins.lookup("sandbox", self.backend, file=file, field=f"{prefix}.backend")
            check_params(spec, self.params, file=file, prefix=f"{prefix}.params")


def wandb_mode(mode: str, network: bool, *, file: str | None = None) -> str:
    """``auto`` → online only where the site says the nodes have network, else offline; ``online`` on a site
    without network is an error (a rank would hang on, or leak to, an unreachable server)."""
    if mode == "auto":
        return "online" if network else "offline"
    if mode == "online" and not network:
        raise ConfigError("expected mode = 'offline' or 'auto': the site partition does not say its compute nodes "
                          "have network (network = true), got 'online'", file=file, field="logging.params.wandb.mode")
    return mode


@dataclass
class LoggingSpec:
    loggers: list[str] = opt(["jsonl", "tensorboard"], pattern=NAME, expect="a logger name",
                             help="metrics loggers (plugins): jsonl, tensorboard, wandb, ...")
    params: dict[str, dict[str, Any]] = opt({}, help="each logger's parameters, e.g. [logging.params.wandb]")

    def validate(self, *, file: str | None, prefix: str) -> None:
        from milehpc import plugins
        from milehpc.config.schema import check_params

        if not plugins.registry("logger"):
            return  # no plugins loaded (MILEHPC_NO_ENTRY_POINTS): checked where the loggers are built
        for name in self.loggers:
            plugins.lookup("logger", name, file=file, field=f"{prefix}.loggers")
        for name, params in self.params.items():
            if name not in self.loggers:
                raise ConfigError(f"expected parameters of a logger in {prefix}.loggers ({', '.join(self.loggers)})"
                                  f", got '{name}'", file=file, field=f"{prefix}.params.{name}")
            check_params(plugins.lookup("logger", name), params, file=file, prefix=f"{prefix}.params.{name}")


@dataclass
class RunSpec:
    steps: int = opt(100, min=1)
    loop: Literal["sync", "one_step_off", "async"] = opt("sync")
    max_staleness: int = opt(1, min=0, help="async: drop samples older than this many weight versions")
    stale_policy: Literal["drop", "correct"] = opt("drop")
    async_weights: Literal["latest", "scheduled"] = opt(
        "latest", help="async: 'latest' generates with whatever weights have arrived (fresher, timing-dependent); "
                       "'scheduled' with exactly the version max_staleness steps back (deterministic for a seed, "
                       "resumes bitwise)")
    update_weights_interval: int = opt(1, min=1)
    seed: int = opt(0)
    run_dir: str | None = opt(None, help="unset = runs/<name>")
    dir_mode: str = opt("0700", pattern=r"0?[0-7]{3}", expect="an octal mode like 0700")
    dump_rollouts: bool = opt(True)
    check_logprobs: bool = opt(False, help="after each sync compare engine and trainer logprobs")
    eval_every: int = opt(0, min=0, help="evaluate on data.val_source every this many steps and at the end "
                                         "([eval]); 0 = never")
    target_reward: float | None = opt(None, help="stop early once the mean reward reaches this")


@dataclass
class JobSpec:
    name: str = opt(pattern=NAME, expect="a job name of letters, digits, '.', '_', '-'")
    description: str = opt("")
    model: ModelSpec = opt(ModelSpec)
    rollout: RolloutSpec = opt(RolloutSpec)
    trainer: TrainerSpec = opt(TrainerSpec)
    algorithm: AlgorithmSpec = opt(AlgorithmSpec)
    reward: RewardSpec = opt(RewardSpec)
    reward_model: RewardModelSpec = opt(RewardModelSpec, help="a reward model on ranks of its own "
                                                              "(milehpc.config.reward_model)")
    data: DataSpec = opt(DataSpec)
    eval: EvalSpec = opt(EvalSpec)
    resources: ResourcesSpec = opt(ResourcesSpec)
    container: ContainerSpec = opt(ContainerSpec)
    checkpoint: CheckpointSpec = opt(CheckpointSpec)
    sandbox: SandboxSpec = opt(SandboxSpec)
    run: RunSpec = opt(RunSpec)
    logging: LoggingSpec = opt(LoggingSpec)
    env: dict[str, str] = opt({}, help="extra environment for every rank")
    site: dict[str, Any] = opt({}, help="overrides of the site's partition values (same keys as a site partition)")

    def validate(self, *, file: str | None, prefix: str) -> None:
        import re

        from milehpc.hygiene import is_secret_name

        for key, value in self.env.items():
            if not re.fullmatch(ENV_NAME, key):
                raise ConfigError(f"expected an environment variable name, got {key!r}", file=file, field="env")
            # A value here is copied into the run dir and the job script: secrets travel by environment only.
            if is_secret_name(key) and value and not value.startswith("$"):
                raise ConfigError(f"{key} looks like a secret (its name has TOKEN/KEY/SECRET/PASSWORD): do not put "
                                  f"its value in the job file; export {key} in your shell before submitting (the job "
                                  "inherits it, milehpc never writes it)", file=file, field=f"env.{key}")
        if self.resources.colocate:
            rollout = self.rollout.engines * self.rollout.gpus_per_engine
            if rollout != self.trainer.ranks:
                raise ConfigError(
                    f"colocated: expected rollout.engines * rollout.gpus_per_engine ({rollout}) to equal "
                    f"trainer.tp * trainer.pp * trainer.dp ({self.trainer.ranks})",
                    file=file, field="resources.colocate",
                )
        check_reward_group(self.reward_model, named_rewards(self.reward), reward_name=self.reward.name,
                           colocated=self.resources.colocate, file=file)

"""How much device memory each rank of a plan needs, against what the site's devices have (pure: no torch).

Per trainer rank (the most loaded pipeline stage), with ``e`` the bytes of one parameter (fp32 4, bf16/fp8 2 in the
megatron trainer; ``model.dtype`` in the torch trainer):

* **parameters** ``P_rank * e``. ``P_rank`` counts this rank's shard exactly as the trainers build it: attention
  (QKV with Qwen2's biases, output), SwiGLU MLP (or MoE experts ``/ ep`` + router + shared expert), the two RMSNorms
  per layer, ``layers / pp`` layers, the embedding on the first stage and the output layer on the last (one matrix
  when tied). Under TP the QKV/MLP matrices and the vocabulary (padded to a multiple of tp, as Megatron does) are
  split, norms and the output projection's input dimension as Megatron splits them.
* **gradients** megatron: ``P_rank * 4`` (``grad_reduce_in_fp32``; the distributed optimizer pads the buffer by a
  few hundred bytes); torch: ``P_rank * e``.
* **optimizer** Adam: two moments in fp32 (``8`` bytes per parameter), plus an fp32 master copy (``4``) when the
  parameters are bf16, plus 4 bytes per parameter tensor for Adam's step counter (torch's Adam/AdamW, which
  Megatron uses on the CPU too). With
  ``trainer.distributed_optimizer`` the moments and master copy are divided over the ``dp`` ranks (Megatron pads
  its buffers for that by at most a few KiB per bucket; not counted).
* **activations** of one micro-batch (``micro_batch_size`` sequences of ``prompt + max_new_tokens`` tokens), the
  elements autograd saves per token: ``layers * (4h + (4h + 3kv + 4f) / tp) + 2h`` in the parameters' dtype and
  ``2 V / tp`` fp32 logits (:func:`activation_elements` says which tensors). With full recomputation each layer keeps
  only its input (``h`` per token and layer) plus one layer during its recompute.
* **reference / critic / teacher** (torch trainer): the frozen KL reference and the teacher add their parameters;
  the critic (a value head on the same body) adds parameters, gradients and Adam moments.

Per rollout rank of an engine of ``g = rollout.gpus_per_engine`` ranks:

* **weights** ``P / g`` at the engine's dtype (bf16 for SGLang under bf16/fp8 training, else ``model.dtype``);
* **KV cache** for the engine's share of one step: ``ceil(prompts_per_step * over_sample / engines) * n_samples``
  sequences of ``prompt + max_new_tokens`` tokens, ``2 * layers * kv_heads_per_rank * head_dim`` values per token
  (``kv_heads_per_rank = max(1, kv_heads / g)``), at the engine dtype;
* the budget is ``mem_fraction_static`` of the device (SGLang reserves it for weights + KV cache; unset = 0.5
  colocated, else 0.88, SGLang's default for large GPUs); the reference engine may use the whole device.

The prompt length is the task's own for ``task:`` sources (the toy tokenizer is one token per character) and
:data:`ASSUMED_PROMPT_TOKENS` for a JSONL source (capped by the context). A colocated rank's peak depends on
whether its engine offloads: SGLang's is released right after it starts (before the trainer is built and warmed
up) and while the trainer steps (:mod:`milehpc.runtime.offload`), so the rank holds its trainer or its engine and each
is checked against its own budget; the reference engines never offload, so the rank holds both at once and their sum
is checked against the device. A device that is known and smaller than a
rank's total cannot hold it: ``submit`` refuses that in one line naming the largest item and the smallest single
change that fits (``--force`` submits anyway); the estimate leaves out the CUDA/ROCm context and allocator slack, so
a total above :data:`TIGHT` of the device is flagged as tight. Checked against real bytes in tests/test_memory.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec
    from milehpc.config.site import Partition
    from milehpc.plan import Plan

GIB = 1 << 30
ASSUMED_PROMPT_TOKENS = 512
# The toy tokenizer's size (milehpc.data.tokenizer.CharTokenizer; tests/test_memory.py keeps the two equal).
TOY_VOCAB_SIZE = 55
# Sizes of one element.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SGLANG_DEFAULT_FRACTION = 0.88
TIGHT = 0.9
COLOCATED = "colocated"  # the role of a rank that holds its trainer and its engine at once
# Prompt tokens of the toy tasks besides their digits: BOS, "sort:" ... "=" (BOS, "add:" a "+" b "=").
_TOY_PROMPT_EXTRA = {"sort": 7, "reverse": 6, "addition": 7}


@dataclass(frozen=True)
class Shape:
    """The model's shape as the estimate needs it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    experts: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class Item:
    name: str
    bytes: int
    note: str = ""


@dataclass
class RankMemory:
    """One rank's items against its budget (``budget`` None: the device is unknown)."""

    role: str
    items: list[Item]
    budget: int | None
    budget_note: str = ""
    extra: list[Item] = field(default_factory=list)  # shown, not counted (e.g. with recomputation)

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def fits(self) -> bool:
        return self.budget is None or self.total <= self.budget

    def largest(self) -> Item:
        return max(self.items, key=lambda i: i.bytes)


@dataclass
class Estimate:
    ranks: list[RankMemory]
    device_bytes: int | None
    notes: list[str] = field(default_factory=list)

    def overflow(self) -> RankMemory | None:
        return next((r for r in self.ranks if not r.fits), None)


# ---- the model ---------------------------------------------------------------------------------------------------

def model_shape(job: JobSpec, vocab_size: int | None = None) -> tuple[Shape, list[str]]:
    """The shape the ranks will build: a checkpoint's config.json when it is here, else the [model] table."""
    m, notes = job.model, []
    cfg: dict = {}
    config = Path(m.path).expanduser() / "config.json" if m.path else None
    if config is not None and config.is_file():
        try:
            cfg = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:  # the ranks will say more; plan goes on
            notes.append(f"{config} is not readable JSON ({err.__class__.__name__}): the [model] table's shape is "
                         "assumed")
        if not isinstance(cfg, dict):
            cfg = {}
    elif m.path:
        notes.append(f"{m.path} is not readable here: the [model] table's shape is assumed")
    vocab = vocab_size or cfg.get("vocab_size") or m.vocab_size
    if not vocab:
        if m.tokenizer == "toy":
            vocab = TOY_VOCAB_SIZE
        else:
            vocab = 32000
            notes.append("vocabulary size unknown here: 32000 assumed (set model.vocab_size)")
    experts = int(cfg.get("num_experts", m.num_experts) or 0)
    return Shape(
        hidden=int(cfg.get("hidden_size", m.hidden_size)), layers=int(cfg.get("num_hidden_layers", m.num_layers)),
        heads=int(cfg.get("num_attention_heads", m.num_heads)),
        kv_heads=int(cfg.get("num_key_value_heads", m.num_kv_heads)),
        ffn=int(cfg.get("intermediate_size", m.intermediate_size)), vocab=int(vocab),
        tied=bool(cfg.get("tie_word_embeddings", m.tie_word_embeddings)),
        qkv_bias=cfg.get("model_type", m.arch).startswith("qwen2"), experts=experts,
        moe_ffn=int(cfg.get("moe_intermediate_size", m.intermediate_size)) if experts else 0,
        shared_ffn=int(cfg.get("shared_expert_intermediate_size", m.intermediate_size)) if experts else 0,
    ), notes


def layer_params(s: Shape, *, tp: int = 1, ep: int = 1, megatron: bool = False) -> tuple[int, int]:
    """(elements, tensors) of one decoder layer on one rank. Tensors as the trainer keeps them: HF's separate
    q/k/v and gate/up/down, or Megatron's fused QKV and fc1 (each tensor has its own Adam step counter)."""
    kv = s.kv_heads * s.head_dim
    qkv_out = (s.hidden + 2 * kv) // tp
    elems = 2 * s.hidden + qkv_out * s.hidden + s.hidden * (s.hidden // tp)  # norms, QKV, output projection
    tensors = 2 + (2 if megatron else 4)
    if s.qkv_bias:
        elems += qkv_out
        tensors += 1 if megatron else 3
    mlp_tensors = 2 if megatron else 3  # fc1 (gate and up fused) + fc2, or gate, up, down
    if s.experts:
        local = s.experts // ep
        elems += local * 3 * s.hidden * s.moe_ffn // tp + s.experts * s.hidden  # experts, router
        elems += 3 * s.hidden * s.shared_ffn // tp + s.hidden  # shared expert and its gate
        tensors += mlp_tensors * (local + 1) + 2
    else:
        elems += 3 * s.hidden * s.ffn // tp
        tensors += mlp_tensors
    return elems, tensors


def stage_params(s: Shape, *, tp: int = 1, pp: int = 1, ep: int = 1, megatron: bool = False) -> tuple[int, int]:
    """(elements, tensors) on the most loaded rank: ``ceil(layers / pp)`` layers, plus the embedding and output
    layer (the first and last stage; both on a single stage) and the final norm. Megatron pads the vocabulary to a
    multiple of tp."""
    vocab = -(-s.vocab // tp) * tp if megatron else s.vocab
    per_layer, per_layer_t = layer_params(s, tp=tp, ep=ep, megatron=megatron)
    layers = -(-s.layers // pp)
    embed = vocab // tp * s.hidden
    ends = embed + (embed if not s.tied else 0) if pp == 1 else embed  # first stage: embedding; last: output layer
    ends_t = (1 if s.tied else 2) if pp == 1 else 1
    return layers * per_layer + ends + s.hidden, layers * per_layer_t + ends_t + 1


def engine_weights(s: Shape) -> int:
    """Elements of the whole model (the engine holds it split over its TP ranks)."""
    return stage_params(s)[0]


# ---- lengths -----------------------------------------------------------------------------------------------------

def prompt_tokens(job: JobSpec) -> tuple[int, str]:
    """The longest prompt in tokens, and how it was found."""
    src = job.data.source
    if src.startswith("task:") and job.model.tokenizer == "toy":
        task = src.removeprefix("task:")
        p = job.data.params
        digits = 2 * int(p.get("digits", 2)) if task == "addition" else int(p.get("max_len", 5))
        n = digits + _TOY_PROMPT_EXTRA.get(task, 8)
        return n, f"{n} prompt tokens (the task's longest)"
    cap = max(1, job.model.max_position_embeddings - job.rollout.max_new_tokens)
    return min(ASSUMED_PROMPT_TOKENS, cap), f"assumed {min(ASSUMED_PROMPT_TOKENS, cap)} prompt tokens (JSONL source)"


# ---- the trainer -------------------------------------------------------------------------------------------------

def activation_elements(s: Shape, *, tokens: int, tp: int, layers: int, recompute: bool) -> tuple[int, int]:
    """(elements in the parameters' dtype, fp32 elements) saved for the backward of one micro-batch of ``tokens``
    tokens: per layer and token ``4h`` replicated (both RMSNorms' input and output) and ``(4h + 3kv + 4f) / tp``
    split (q and k before and after RoPE, v, the fused attention's output and the output projection's input,
    SwiGLU's gate, up, silu(gate) and product); the final norm (``2h``); the logits and their log-softmax in fp32
    (``2 V / tp``). With full recomputation each layer keeps its input (``h``) plus one layer during its recompute.
    Attention is fused (SDPA/flash on CPU and GPU alike): no ``heads x seq`` probabilities are kept."""
    kv = s.kv_heads * s.head_dim
    per_layer = 4 * s.hidden + (4 * s.hidden + 3 * kv + 4 * s.ffn) // tp
    kept = layers * s.hidden + per_layer if recompute else layers * per_layer
    return tokens * (kept + 2 * s.hidden), tokens * 2 * -(-s.vocab // tp)


def lora_params(s: Shape, lora: Any) -> tuple[int, int]:
    """An upper bound on a LoRA adapter's (elements, tensors): rank ``r`` on every linear layer of every transformer
    layer (``A`` and ``B``, ``r * (in + out)`` elements; the target patterns may pick fewer), plus the modules
    trained whole (embeddings and the output layer: one ``vocab x hidden`` tensor each)."""
    kv = s.kv_heads * s.head_dim
    q = s.heads * s.head_dim
    linears = [(s.hidden, q), (s.hidden, kv), (s.hidden, kv), (q, s.hidden),
               (s.hidden, s.ffn), (s.hidden, s.ffn), (s.ffn, s.hidden)]
    adapters = s.layers * lora.rank * sum(i + o for i, o in linears)
    whole = [name for name in lora.modules_to_save if name.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head")]
    return adapters + len(whole) * s.vocab * s.hidden, 2 * len(linears) * s.layers + len(whole)


def trainer_items(job: JobSpec, s: Shape, *, needs_critic: bool = False, needs_teacher: bool = False) -> tuple[list[Item], list[Item]]:
    """The items of one trainer rank (and, not counted, the activations with full recomputation)."""
    tr = job.trainer
    megatron = tr.backend == "megatron"
    e = (2 if tr.precision in ("bf16", "fp8") else 4) if megatron else DTYPE_BYTES[job.model.dtype]
    n, tensors = stage_params(s, tp=tr.tp, pp=tr.pp, ep=tr.ep, megatron=megatron)
    share = tr.dp if tr.distributed_optimizer else 1
    master = 4 if e < 4 else 0
    what = "fp32" if e == 4 else "bf16"
    items = [Item("trainer parameters", n * e, f"{n:,} params ({what}), tp={tr.tp} pp={tr.pp} ep={tr.ep}")]
    trained, trained_tensors, note = n, tensors, ""
    if tr.lora is not None:  # the frozen base has no gradients and no optimizer state: the adapter alone has
        trained, trained_tensors = lora_params(s, tr.lora)
        items.append(Item("LoRA adapter", trained * e, f"rank {tr.lora.rank}, at most every linear layer"))
        note = f", the adapter's {trained:,} params"
    items.append(Item("trainer gradients", trained * (4 if megatron else e),
                      ("fp32 (grad_reduce_in_fp32)" if megatron else what) + note))
    opt_bytes = trained * (8 + master) // share + 4 * trained_tensors
    items.append(Item("optimizer state", opt_bytes, "Adam moments" + (" + fp32 master" if master else "")
                      + (f", distributed over dp={tr.dp}" if share > 1 else "") + note))
    seq = prompt_tokens(job)[0] + job.rollout.max_new_tokens
    tokens = tr.micro_batch_size * seq
    layers = -(-s.layers // tr.pp)
    act_e = e if megatron else DTYPE_BYTES[job.model.dtype]
    (plain, fp32), (plain_rc, fp32_rc) = (activation_elements(s, tokens=tokens, tp=tr.tp, layers=layers, recompute=rc)
                                          for rc in (False, True))
    items.append(Item("activations", plain * act_e + fp32 * 4,
                      f"micro-batch {tr.micro_batch_size} x {seq} tokens, no recomputation"))
    extra = [Item("activations (full recompute)", plain_rc * act_e + fp32_rc * 4, "each layer's input + one layer")]
    full = stage_params(s)[0]
    if job.algorithm.kl_coef > 0:
        items.append(Item("KL reference model", full * e, "frozen copy"))
    if needs_teacher:
        items.append(Item("teacher model", full * e, "frozen"))
    if needs_critic:
        critic = full - (0 if s.tied else s.vocab * s.hidden) + s.hidden + 1
        items.append(Item("critic (params, grads, Adam)", critic * (2 * e + 8), "value head on the same body"))
    return items, extra


# ---- the engines -------------------------------------------------------------------------------------------------

def engine_items(job: JobSpec, s: Shape) -> list[Item]:
    ro = job.rollout
    g = ro.gpus_per_engine
    e = 2 if ro.engine == "sglang" and job.trainer.precision != "fp32" else DTYPE_BYTES[job.model.dtype]
    weights = engine_weights(s) * e // g
    prompts = math.ceil(ro.prompts_per_step * ro.over_sample / ro.engines)
    seq = prompt_tokens(job)[0] + ro.max_new_tokens
    kv_heads = max(1, s.kv_heads // g)
    kv = prompts * ro.n_samples * seq * 2 * s.layers * kv_heads * s.head_dim * e
    return [Item("engine weights", weights, f"1/{g} of the model" if g > 1 else "the whole model"),
            Item("KV cache", kv, f"{prompts} prompts x {ro.n_samples} samples x {seq} tokens per engine")]


def engine_fraction(job: JobSpec) -> float:
    if job.rollout.engine != "sglang":
        return 1.0
    asked = job.rollout.options.get("mem_fraction_static")
    if asked is not None:
        return float(asked)
    return 0.5 if job.resources.colocate else SGLANG_DEFAULT_FRACTION


# ---- the whole plan ----------------------------------------------------------------------------------------------

def estimate(job: JobSpec, plan: Plan, partition: Partition, *, vocab_size: int | None = None,
             needs_critic: bool = False, needs_teacher: bool = False) -> Estimate:
    """Per-rank memory of ``plan`` on ``partition``'s devices (see the module doc for every formula)."""
    shape, notes = model_shape(job, vocab_size)
    gib = partition.devices.memory_gib
    device = int(gib * GIB) if gib and partition.devices.count else None
    titems, extra = trainer_items(job, shape, needs_critic=needs_critic, needs_teacher=needs_teacher)
    eitems = engine_items(job, shape)
    frac = engine_fraction(job)
    notes.append(prompt_tokens(job)[1])
    unknown = ("CPU partition: host memory, not checked" if partition.devices.vendor == "none" else
               "device memory unknown (site devices.memory_gib)")
    trainer = RankMemory("trainer", titems, device, "device" if device else unknown, extra)
    engine = RankMemory("rollout", eitems, int(device * frac) if device else None,
                        unknown if not device else f"{frac:g} of the device" if frac < 1 else "device")
    if plan.colocated and not engine_offloads(job):
        notes.append(f"colocated: the {job.rollout.engine} engine stays resident beside the trainer, so the rank "
                     "holds both")
        both = RankMemory(COLOCATED, titems + eitems, device, trainer.budget_note, extra)
        return Estimate([both], device, notes)
    if plan.colocated:
        notes.append("colocated: the engine is released at start-up (before the trainer is built) and while the "
                     "trainer steps; each side is checked against its own budget and the one that does not fit "
                     "(else the larger) is shown")
        # Not simply the larger total: the engine's budget is mem_fraction_static of the device, so a smaller
        # engine side can overflow while a larger trainer side fits.
        side = next((r for r in (trainer, engine) if not r.fits), max(trainer, engine, key=lambda r: r.total))
        return Estimate([side], device, notes)
    return Estimate([trainer, engine], device, notes)


def engine_offloads(job: JobSpec) -> bool:
    """Whether a colocated engine gives the device back to the trainer (milehpc.runtime.offload.for_job drives only
    SGLang's release/resume; the reference engines keep their weights and cache resident)."""
    return job.rollout.engine == "sglang"


def _change(job: JobSpec, table: str, key: str, value: object) -> tuple[str, JobSpec]:
    """``job`` with ``table.key = value``, and how to say so."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"{table}.{key} = {text}", replace(job, **{table: replace(getattr(job, table), **{key: value})})


def _doubling(start: int, most: int) -> list[int]:
    return [v for v in (start << k for k in range(1, 31)) if v <= most]


def _halving(start: int) -> list[int]:
    return [v for v in (start >> k for k in range(1, 31)) if v >= 1]


def suggestion(job: JobSpec, plan: Plan, partition: Partition, role: str, **needs: bool) -> str:
    """The smallest single change that makes ``role``'s ranks fit (what to set, and how much the rank then needs),
    tried in this order: trainer — the distributed optimizer, more TP, a smaller micro-batch, more PP; rollout —
    more GPUs per engine, fewer prompts per step; a colocated rank holding both — the trainer's, then the rollout's."""
    tr, ro = job.trainer, job.rollout
    per_node = partition.slots_per_node
    tries = []
    if role in ("trainer", COLOCATED):
        tries += [_change(job, "trainer", "distributed_optimizer", True)] \
            if not tr.distributed_optimizer and tr.dp > 1 and tr.backend == "megatron" else []
        tries += [_change(job, "trainer", "tp", tp) for tp in _doubling(tr.tp, per_node)
                  if job.model.num_heads % tp == 0]
        tries += [_change(job, "trainer", "micro_batch_size", m) for m in _halving(tr.micro_batch_size)]
        tries += [_change(job, "trainer", "pp", pp) for pp in _doubling(tr.pp, job.model.num_layers)]
    if role in ("rollout", COLOCATED):
        tries += [_change(job, "rollout", "gpus_per_engine", g) for g in _doubling(ro.gpus_per_engine, per_node)]
        tries += [_change(job, "rollout", "prompts_per_step", n) for n in _halving(ro.prompts_per_step)]
    for change, candidate in tries:
        est = estimate(candidate, plan, partition, **needs)
        rank = next(r for r in est.ranks if r.role == role or len(est.ranks) == 1)
        if rank.fits:
            return f"set {change} ({rank.total / GIB:.1f} GiB per rank)"
    return "no single change fits: use more GPUs per model copy (trainer.tp/pp, rollout.gpus_per_engine) or a " \
           "smaller model"


def check_fits(job: JobSpec, plan: Plan, partition: Partition, *, file: str | None, **needs: bool) -> Estimate:
    """The estimate, or one line when a rank cannot fit its device: the largest item and the smallest change."""
    est = estimate(job, plan, partition, **needs)
    bad = est.overflow()
    if bad is None:
        return est
    big = bad.largest()
    budget = bad.budget or 0
    fix = suggestion(job, plan, partition, bad.role, **needs)
    field_name = {"trainer": "trainer", COLOCATED: "resources.colocate"}.get(bad.role, "rollout")
    raise ConfigError(f"expected a {bad.role} rank to fit {budget / GIB:.1f} GiB ({bad.budget_note}), got an estimated "
                      f"{bad.total / GIB:.1f} GiB, the largest item {big.name} {big.bytes / GIB:.1f} GiB; {fix}, "
                      "or submit with --force", file=file, field=field_name)


def size(n: int) -> str:
    """Bytes as GiB (MiB below one GiB: the CPU models are small)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.2f} MiB"


def table_rows(est: Estimate) -> list[tuple[str, str, str, str]]:
    """(rank kind, item, size, note) rows for ``plan``."""
    rows = []
    for rank in est.ranks:
        for item in rank.items:
            rows.append((rank.role, item.name, size(item.bytes), item.note))
        for item in rank.extra:
            rows.append((rank.role, item.name, f"({size(item.bytes)})", item.note + "; not counted"))
        if rank.budget is None:
            verdict = rank.budget_note
        else:
            use = rank.total / rank.budget
            verdict = ("DOES NOT FIT" if use > 1 else "tight" if use > TIGHT else "fits") + \
                f" {use:.0%} of {rank.budget / GIB:.1f} GiB ({rank.budget_note})"
        rows.append((rank.role, "total", size(rank.total), verdict))
    return rows


def estimate_trainer_bytes(job: JobSpec, *, vocab_size: int | None = None) -> dict[str, int]:
    """The trainer rank's parameter, gradient and optimizer bytes by name (what the tests measure)."""
    items, _ = trainer_items(job, model_shape(job, vocab_size)[0])
    names = {"trainer parameters": "params", "trainer gradients": "grads", "optimizer state": "optimizer",
             "activations": "activations"}
    return {names[i.name]: i.bytes for i in items if i.name in names}


def estimator_needs(job: JobSpec) -> dict[str, bool]:
    """Whether the job's advantage estimator trains a critic or reads a teacher (the registry's dataclass only)."""
    from milehpc import plugins

    if not plugins.registry("advantage"):
        return {"needs_critic": False, "needs_teacher": False}
    est = plugins.lookup("advantage", job.algorithm.advantage)
    return {"needs_critic": bool(getattr(est, "needs_critic", False)),
            "needs_teacher": bool(getattr(est, "needs_teacher", False))}


def for_job(job: JobSpec, plan: Plan, partition: Partition, *, file: str | None, force: bool = False) -> Estimate:
    """The job's estimate; unless ``force``, one :class:`ConfigError` line when a rank cannot fit its device."""
    kw = estimator_needs(job)
    if force:
        return estimate(job, plan, partition, **kw)
    return check_fits(job, plan, partition, file=file, **kw)

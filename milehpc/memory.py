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

Per rollout rank of an engine of ``g = rollout.gpus_per_engine`` ranks, as the engine allocates it:

* **weights** ``P / g`` at the engine's dtype (bf16 for SGLang under bf16/fp8 training, else ``model.dtype``);
* **KV cache**, ``2 * layers * kv_heads_per_rank * head_dim`` values per token (``kv_heads_per_rank =
  max(1, kv_heads / g)``) at the engine dtype, sized the way the engine sizes it:

  - SGLang (and vLLM alike) fixes a **pool** at start-up: ``mem_fraction_static`` of the device (unset = 0.5
    colocated, else 0.88, SGLang's default for large GPUs) less the weights. Requests beyond the pool queue, so the
    step's batch size does not matter; the rank fits when the weights plus the KV of one full-length sequence fit
    that fraction (SGLang refuses to start otherwise, and refuses a request longer than its pool). On a CPU partition
    the engine's device is ``rollout.options.cpu_memory_gib`` and the pool is capped by ``max_total_tokens``
    (milehpc.rollout.sglang_engine.CPU_SERVER_ARGS, whose mem_fraction_static 0.5 applies there too).
  - the reference engine decodes its whole share of a step as one batch (one ``DynamicCache``), so it holds
    ``ceil(prompts_per_step * over_sample / engines) * n_samples`` sequences of ``prompt + max_new_tokens`` tokens at
    once, against the whole device.

The prompt length is the task's own for ``task:`` sources (the toy tokenizer is one token per character),
``data.max_prompt_tokens`` when the job sets it (longer prompts are dropped), else :data:`ASSUMED_PROMPT_TOKENS`
(capped by the context) for a file source, named by its real format. A colocated rank's peak depends on whether its
engine offloads: SGLang's is released right after it starts (before the trainer is built and warmed up) and while
the trainer steps (:mod:`milehpc.runtime.offload`), so on a GPU the rank holds its trainer or its engine and each is
checked against its own budget; the reference engines never offload, nor does SGLang on a CPU (no
torch_memory_saver), so such a rank holds both at once and their sum is checked against the device.

**CPU partitions**: the ranks of a node share its host memory, so the node's ranks together (on its most loaded
node) are checked against it: the site's ``mem_per_node_gib``, or this machine's ``MemTotal`` for a ``local``
partition (the total, not the free memory: what else runs is not the job's budget).

A device (or node) that is known and smaller than a rank's total cannot hold it: ``submit`` refuses that in one line
naming the largest item and the smallest single change that fits, checked like the job itself (schema, layout and
rules) before it is printed; ``--force`` accepts it, naming every check it overrides, and ``--force-only ROLE-memory``
overrides that role's check only. The estimate leaves out the CUDA/ROCm context and allocator slack, so a total
above :data:`TIGHT` of the device is flagged as tight. Checked against real bytes and measured peaks in
tests/test_memory.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
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
# Facts of higher layers this pure module may not import; tests/test_memory.py keeps each equal to its source:
PARQUET_SUFFIXES = (".parquet", ".pq")  # milehpc.data.readers.PARQUET_SUFFIXES
# A CPU SGLang engine's mem_fraction_static and max_total_tokens (milehpc.rollout.sglang_engine.CPU_SERVER_ARGS).
SGLANG_CPU_FRACTION = 0.5
SGLANG_CPU_MAX_TOTAL_TOKENS = 4096
# Sizes of one element.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SGLANG_DEFAULT_FRACTION = 0.88
TIGHT = 0.9
COLOCATED = "colocated"  # the role of a rank that holds its trainer and its engine at once
NODE = "node"  # a CPU node: its ranks together against its host memory
# What --force-only NAME overrides; bare --force (True, or "memory") overrides every memory check.
FORCE_CHECKS = {f"{role}-memory": role for role in ("trainer", "rollout", "reward", COLOCATED, NODE)}
MEMINFO = Path("/proc/meminfo")
CPU_NOTE = "CPU: checked with its node's ranks against the host memory (node)"
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
    vision_tower: tuple[int, ...] = ()  # a vision-language model's: its tensors' element counts (milehpc.config.vision_shape)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def vision(self) -> int:
        return sum(self.vision_tower)


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
    # What must fit the budget when less than the total: an SGLang engine's pool takes whatever its fraction leaves
    # after the weights, so it needs only the weights and one sequence's KV (``need_note`` says so).
    need: int | None = None
    need_note: str = ""

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def required(self) -> int:
        return self.total if self.need is None else self.need

    @property
    def fits(self) -> bool:
        return self.budget is None or self.required <= self.budget

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
    vision: tuple[int, ...] = ()
    if isinstance(cfg.get("vision_config"), dict) and isinstance(cfg.get("text_config"), dict):
        from milehpc.config.vision_shape import vision_tower_tensors  # numbers from the config alone

        vision = tuple(vision_tower_tensors(cfg))
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", False),  # the LM
               "model_type": cfg.get("model_type", "")}
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
        vision_tower=vision,
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
    """Elements of the whole model, vision tower included (the engine holds it split over its TP ranks)."""
    return stage_params(s)[0] + s.vision


# ---- lengths -----------------------------------------------------------------------------------------------------

def source_format(source: str) -> str:
    """The format the ranks will read ``source`` as (milehpc.data.readers decides it the same way)."""
    if source.startswith("task:"):
        return "task"
    path = Path(source).expanduser()
    if path.is_dir():
        return "datasets folder"
    return "Parquet" if path.suffix.lower() in PARQUET_SUFFIXES else "JSONL"


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
    limit = job.data.max_prompt_tokens
    if limit:  # longer prompts are dropped at the start: none is longer
        return min(limit, cap), f"{min(limit, cap)} prompt tokens (data.max_prompt_tokens)"
    n = min(ASSUMED_PROMPT_TOKENS, cap)
    return n, f"assumed {n} prompt tokens ({source_format(src)} source; data.max_prompt_tokens bounds them)"


# ---- the trainer -------------------------------------------------------------------------------------------------

def activation_elements(s: Shape, *, tokens: int, tp: int, layers: int, recompute: bool, selective: bool = False,
                        sp: bool = False) -> tuple[int, int]:
    """(elements in the parameters' dtype, fp32 elements) saved for the backward of one micro-batch of ``tokens``
    tokens: per layer and token ``4h`` replicated (both RMSNorms' input and output) and ``(4h + 3kv + 4f) / tp``
    split (q and k before and after RoPE, v, the fused attention's output and the output projection's input,
    SwiGLU's gate, up, silu(gate) and product); the final norm (``2h``); the logits and their log-softmax in fp32
    (``2 V / tp``). With full recomputation each layer keeps its input (``h``) plus one layer during its recompute.
    Attention is fused (SDPA/flash on CPU and GPU alike): no ``heads x seq`` probabilities are kept. ``selective``
    (Megatron's core-attention recomputation) drops the attention's own saved output (``h / tp``: its inputs are
    kept for the recompute, its output is the projection's input); ``sp`` (sequence parallelism) splits the
    replicated ``4h`` (the norms' tensors live on 1/tp of the sequence), Korthikanti et al. 2022, table 2."""
    kv = s.kv_heads * s.head_dim
    split = 4 * s.hidden + 3 * kv + 4 * s.ffn - (s.hidden if selective else 0)
    per_layer = (4 * s.hidden) // (tp if sp else 1) + split // tp
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


def largest_tensor(s: Shape, *, tp: int = 1, megatron: bool = False) -> int:
    """Elements of the largest parameter tensor on a rank: the (padded) embedding / output layer, or an MLP
    matrix (Megatron's fused fc1 holds gate and up)."""
    vocab = -(-s.vocab // tp) * tp if megatron else s.vocab
    ffn = max(s.ffn, s.moe_ffn, s.shared_ffn)
    return max(vocab // tp * s.hidden, (2 if megatron else 1) * ffn * s.hidden // tp)


def step_temporaries(job: JobSpec, s: Shape, *, trained: int, gpu: bool) -> Item | None:
    """Adam's step makes temporaries as large as the moments it reads (issue 33, bench/realsize.py: 1.1 GB at
    Qwen2.5-0.5B's shape, more than the activations). torch's AdamW on host tensors takes its per-tensor path:
    ``(exp_avg_sq.sqrt() / bias_correction2_sqrt)`` holds two copies of the largest tensor's second moment at once;
    on CUDA its default foreach path holds ``sqrt`` of every second moment (one copy of all of them). Megatron on a
    GPU steps with a fused Adam (transformer-engine or apex), none; on the CPU it falls back to torch's."""
    tr = job.trainer
    megatron = tr.backend == "megatron"
    moment = 4 if megatron else DTYPE_BYTES[job.model.dtype]
    if gpu and megatron:
        return None
    if gpu:
        return Item("optimizer step temporaries", trained * moment, "AdamW foreach: sqrt of every second moment")
    largest = min(trained, largest_tensor(s, tp=tr.tp, megatron=megatron))
    return Item("optimizer step temporaries", 2 * largest * moment,
                f"AdamW per tensor: two copies of the largest ({largest:,} elements)")


def trainer_items(job: JobSpec, s: Shape, *, needs_critic: bool = False, needs_teacher: bool = False,
                  gpu: bool = False) -> tuple[list[Item], list[Item]]:
    """The items of one trainer rank (and, not counted, the activations with full recomputation); ``gpu``: the
    trainer's tensors are on a GPU (Adam's step temporaries differ)."""
    tr = job.trainer
    megatron = tr.backend == "megatron"
    e = (2 if tr.precision in ("bf16", "fp8") else 4) if megatron else DTYPE_BYTES[job.model.dtype]
    n, tensors = stage_params(s, tp=tr.tp, pp=tr.pp, ep=tr.ep, megatron=megatron)
    share = tr.dp if tr.distributed_optimizer else 1
    master = 4 if e < 4 else 0
    what = "fp32" if e == 4 else "bf16"
    items = [Item("trainer parameters", n * e, f"{n:,} params ({what}), tp={tr.tp} pp={tr.pp} ep={tr.ep}")]
    trained, trained_tensors, note = n, tensors, ""
    if s.vision:  # a VL model's vision tower: trained (gradients and Adam moments below), or frozen (none)
        frozen = job.model.freeze_vision or tr.lora is not None
        items.append(Item("vision tower", s.vision * e, f"{s.vision:,} params, " + (
            "frozen: no gradients or optimizer state" if frozen else "trained: in the gradients and optimizer state")))
        if not frozen:
            trained, trained_tensors = n + s.vision, tensors + len(s.vision_tower)
    if tr.lora is not None:  # the frozen base has no gradients and no optimizer state: the adapter alone has
        trained, trained_tensors = lora_params(s, tr.lora)
        items.append(Item("LoRA adapter", trained * e, f"rank {tr.lora.rank}, at most every linear layer"))
        note = f", the adapter's {trained:,} params"
    items.append(Item("trainer gradients", trained * (4 if megatron else e),
                      ("fp32 (grad_reduce_in_fp32)" if megatron else what) + note))
    opt_bytes = trained * (8 + master) // share + 4 * trained_tensors
    items.append(Item("optimizer state", opt_bytes, "Adam moments" + (" + fp32 master" if master else "")
                      + (f", distributed over dp={tr.dp}" if share > 1 else "") + note))
    temps = step_temporaries(job, s, trained=trained // share, gpu=gpu)
    if temps is not None:
        items.append(temps)
    seq = prompt_tokens(job)[0] + job.rollout.max_new_tokens
    tokens = tr.micro_batch_size * seq
    shape = f"micro-batch {tr.micro_batch_size} x {seq} tokens"
    if tr.max_tokens_per_micro_batch:  # issue 33: sequences packed up to the budget (a longer one alone)
        tokens = max(tr.max_tokens_per_micro_batch, seq)
        shape = f"micro-batch of {tokens} tokens (trainer.max_tokens_per_micro_batch)"
    layers = -(-s.layers // tr.pp)
    act_e = e if megatron else DTYPE_BYTES[job.model.dtype]
    (plain, fp32), (plain_rc, fp32_rc) = (activation_elements(
        s, tokens=tokens, tp=tr.tp, layers=layers, recompute=rc, selective=tr.recompute == "selective" and not rc,
        sp=tr.sequence_parallel) for rc in (tr.recompute == "full", True))
    how = {"none": "no recomputation", "full": "full recomputation: each layer's input + one layer",
           "selective": "selective recomputation (core attention)"}[tr.recompute]
    items.append(Item("activations", plain * act_e + fp32 * 4,
                      f"{shape}, {how}" + (", sequence parallel" if tr.sequence_parallel else "")))
    extra = [] if tr.recompute == "full" else [Item("activations (full recompute)", plain_rc * act_e + fp32_rc * 4,
                                                    "each layer's input + one layer")]
    full = engine_weights(s)  # a frozen copy of the whole model
    if job.algorithm.kl_coef > 0:
        items.append(Item("KL reference model", full * e, "frozen copy"))
    if needs_teacher:
        items.append(Item("teacher model", full * e, "frozen"))
    if needs_critic:
        critic = full - (0 if s.tied else s.vocab * s.hidden) + s.hidden + 1
        items.append(Item("critic (params, grads, Adam)", critic * (2 * e + 8), "value head on the same body"))
    return items, extra


# ---- the engines -------------------------------------------------------------------------------------------------

def _engine_dtype_bytes(job: JobSpec) -> int:
    return 2 if job.rollout.engine == "sglang" and job.trainer.precision != "fp32" else DTYPE_BYTES[job.model.dtype]


def kv_bytes_per_token(job: JobSpec, s: Shape) -> int:
    """K and V of one token on one rank of an engine (its share of the KV heads)."""
    kv_heads = max(1, s.kv_heads // job.rollout.gpus_per_engine)
    return 2 * s.layers * kv_heads * s.head_dim * _engine_dtype_bytes(job)


def engine_fraction(job: JobSpec, partition: Partition | None = None) -> float:
    """The share of its device an engine starts with: SGLang's mem_fraction_static as milehpc passes it
    (milehpc.rollout.sglang_mapping, and CPU_SERVER_ARGS on a CPU), the whole device for the reference engine."""
    if job.rollout.engine != "sglang":
        return 1.0
    asked = job.rollout.options.get("mem_fraction_static")
    if asked is not None:
        return float(asked)
    if partition is not None and partition.devices.vendor == "none":
        return SGLANG_CPU_FRACTION
    return 0.5 if job.resources.colocate else SGLANG_DEFAULT_FRACTION


def sync_buffers(job: JobSpec) -> Item | None:
    """What a separate rollout rank holds during a weight sync beyond its engine's weights, as each engine receives
    it (issue 33, bench/realsize.py), in buckets of ``rollout.options.weight_bucket_mb``; released after the sync.
    None when nothing crosses a wire (colocated) or the adapter alone does (LoRA).

    * **SGLang**: each bucket of consecutive tensors (a bigger one alone) is received by every TP scheduler, whole,
      into a fresh flattened buffer that is loaded before the next bucket comes: the largest bucket.
    * **vLLM**: each worker receives a bucket into a fresh flat buffer and feeds it to the layerwise reload, whose
      loaders keep views of it until their layer is complete (a layer cut by a bucket boundary keeps the earlier
      buffer), then build that layer anew on the device before copying it into the old storage: two buckets and the
      largest layer (vllm ``model_loader/reload/layerwise.py``).
    * **milehpc's broadcast** (the reference engines): a tensor of at least ``min(bucket, 1 MiB)`` is sent alone and
      the in-process reference engine receives it straight into its parameter when it comes in the engine's dtype
      (:meth:`milehpc.weights.broadcast.WeightStream.receive_into`); the rest (small tensors, packed up to a bucket;
      every tensor of an engine that does not receive in place, or of a trainer whose wire dtype differs) lands in
      two reused byte buffers: the two largest such buckets.

    From the shape's tensor sizes and the bucketing rules in outline (this layer may not import the transport;
    tests/test_memory.py checks the figures against the real rules and against bytes derived from the shape)."""
    if job.resources.colocate or job.trainer.lora is not None:
        return None
    from milehpc import plugins
    from milehpc.config.families import CHECKPOINT_MOE_ENGINES
    from milehpc.config.job import sync_bucket_bytes

    engine = job.rollout.engine
    direct = plugins.lookup("engine", engine).direct_weight_sync
    s, _ = model_shape(job)
    stacked = engine not in CHECKPOINT_MOE_ENGINES
    sent = _tensor_elements(s, stacked=stacked) + ([] if job.model.freeze_vision else list(s.vision_tower))
    wire = _wire_bytes(job)
    sizes = [n * wire for n in sent]
    bucket = sync_bucket_bytes(job)
    if direct:  # consecutive tensors up to a bucket; a bigger one alone
        largest = max(max(sizes), min(sum(sizes), bucket))
        if engine != "vllm":
            return Item("weight-sync buffers", largest, "the largest bucket (during a sync)")
        second = min(largest, max(sum(sizes) - largest, 0))
        layer = max(_module_elements(s)) * _engine_dtype_bytes(job)
        return Item("weight-sync buffers", largest + second + layer,
                    "two buckets held by the layerwise reload and its largest layer rebuilt (during a sync)")
    alone = min(bucket, 1 << 20)
    in_place = engine == "reference" and wire == _engine_dtype_bytes(job)
    packed = sum(n for n in sizes if n < alone)
    chunks = [bucket] * (packed // bucket) + ([packed % bucket] if packed % bucket else [])
    buffered = chunks + ([] if in_place else [n for n in sizes if n >= alone])
    held = sorted(buffered, reverse=True)[:2]
    return Item("weight-sync buffers", sum(held),
                ("the packed small tensors, two buckets at once; the rest received in place" if in_place
                 else "the largest buckets, two at once") + " (during a sync)")


def supervisor_copy(job: JobSpec) -> Item | None:
    """An engine in a supervised child process (``reference_process``) keeps a copy of the last weights it was sent
    on its rank, to re-sync the engine after a restart (milehpc.rollout.supervisor.EngineSupervisor)."""
    if job.rollout.engine != "reference_process" or job.trainer.lora is not None:
        return None
    s, _ = model_shape(job)
    sent = sum(_tensor_elements(s, stacked=True)) + (0 if job.model.freeze_vision else s.vision)
    return Item("engine supervisor's weight copy", sent * _wire_bytes(job), "the last weights sent, kept to re-sync "
                "a restarted engine")


def _wire_bytes(job: JobSpec) -> int:
    """Bytes per element of what the sync sends: Megatron's parameters (bf16 under bf16/fp8, else fp32), the torch
    trainer's ``model.dtype`` (:func:`milehpc.weights.cost.wire_dtype`)."""
    if job.trainer.backend == "megatron":
        return 2 if job.trainer.precision in ("bf16", "fp8") else 4
    return DTYPE_BYTES[job.model.dtype]


def _module_elements(s: Shape) -> list[int]:
    """Parameter elements of each module the engine holds weights in (vLLM's fused QKV and gate/up projections)."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    qkv = (q + 2 * kv) * (h + (1 if s.qkv_bias else 0))
    mlp = [2 * s.ffn * h, s.ffn * h] if not s.experts else [s.experts * 3 * s.moe_ffn * h]
    return [s.vocab * h, qkv, q * h, *mlp]


def _tensor_elements(s: Shape, *, stacked: bool) -> list[int]:
    """Element counts of the tensors a sync sends (a tied output layer is not sent); experts ``stacked`` as
    transformers holds them, else one tensor per expert and projection (SGLang's checkpoint names)."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    layer = [q * h, kv * h, kv * h, h * q, h, h]
    if s.qkv_bias:
        layer += [q, kv, kv]
    if s.experts:
        layer.append(s.experts * h)
        layer += ([s.experts * 2 * s.moe_ffn * h, s.experts * s.moe_ffn * h] if stacked
                  else [s.moe_ffn * h] * (3 * s.experts))
        layer += [s.shared_ffn * h] * 3 + [h] if s.shared_ffn else []
    else:
        layer += [s.ffn * h] * 3
    return [s.vocab * h, *layer * s.layers, h, *([] if s.tied else [s.vocab * h])]


def engine_rank(job: JobSpec, s: Shape, partition: Partition, device: int | None) -> RankMemory:
    """One rollout rank: the engine's weights and its KV cache as the engine sizes it (see the module doc), the
    weight sync's receive buffers, and the random model's build where it peaks above all that."""
    rank = _engine_rank(job, s, partition, device)
    rank.items += [i for i in (sync_buffers(job), supervisor_copy(job)) if i is not None]
    # The reference engines build the model in the rank (its child), vLLM's rank builds it to write the folder
    # vLLM loads; SGLang initialises a random model itself.
    if partition.devices.vendor == "none" and not job.model.path and job.rollout.engine in HF_BUILDING_ENGINES:
        build = build_transient(random_build_bytes(s), rank.total)
        if build is not None:
            rank.items.append(build)
    return rank


HF_BUILDING_ENGINES = ("reference", "reference_process", "vllm")


def random_build_bytes(s: Shape) -> int:
    """What transformers holds when it has built a random model (milehpc.models.build_model, no model.path): every
    parameter in fp32 whatever ``model.dtype`` (cast after the build), and a tied output layer allocated untied
    before it is tied to the embedding (issue 33: +544 MB at Qwen2.5-0.5B's shape)."""
    return 4 * (engine_weights(s) + (s.vocab * s.hidden if s.tied else 0))


def build_transient(peak: int, resident: int) -> Item | None:
    """A rank's build peak, counted as what it adds over the rest of the rank (``resident``): the build comes
    before anything else is allocated, so the rank's peak is the larger of the two (None: the build is smaller)."""
    if peak <= resident:
        return None
    return Item("model build (transient)", peak - resident, f"{size(peak)} while the model is built, before the "
                "rest: counted as what it adds over them")


def _engine_rank(job: JobSpec, s: Shape, partition: Partition, device: int | None) -> RankMemory:
    ro = job.rollout
    g = ro.gpus_per_engine
    weights = engine_weights(s) * _engine_dtype_bytes(job) // g
    weights_item = Item("engine weights", weights, f"1/{g} of the model" if g > 1 else "the whole model")
    seq = prompt_tokens(job)[0] + ro.max_new_tokens
    per_token = kv_bytes_per_token(job, s)
    share = math.ceil(ro.prompts_per_step * ro.over_sample / ro.engines) * ro.n_samples
    frac = engine_fraction(job, partition)
    unknown = CPU_NOTE if partition.devices.vendor == "none" else "device memory unknown (site devices.memory_gib)"
    if ro.engine == "vllm":  # its explicit budget (kv_cache_memory_bytes), allocated whole when the engine starts
        from milehpc.config.vllm_options import parse_options as vllm_options

        kv = Item("KV cache", int(vllm_options(ro.options).kv_cache_gib * GIB),
                  "vLLM's, rollout.options.kv_cache_gib (allocated whole at start; requests beyond it queue)")
        return RankMemory("rollout", [weights_item, kv], device, "device" if device else unknown)
    if ro.engine != "sglang":  # the reference engine: its share decoded as one batch, every sequence resident
        kv = Item("KV cache", share * seq * per_token, f"{share} sequences x {seq} tokens decoded as one batch "
                  "(reference engine)")
        return RankMemory("rollout", [weights_item, kv], device, "device" if device else unknown)
    cap = None
    if partition.devices.vendor == "none":  # a CPU engine's device is its explicit budget (sglang_cpu_memory)
        from milehpc.config.sglang_options import parse_options

        opts = parse_options(ro.options)
        device = int(opts.cpu_memory_gib * GIB)
        cap = int(opts.server_args.get("max_total_tokens", SGLANG_CPU_MAX_TOTAL_TOKENS))
    one = seq * per_token
    need_note = f"the weights and one sequence's KV ({seq} tokens)"
    if device is None:
        kv = Item("KV pool", one, f"at least one sequence of {seq} tokens; the pool is mem_fraction_static of the "
                  "device less the weights")
        return RankMemory("rollout", [weights_item, kv], None, unknown)
    budget = int(device * frac)
    tokens = max(0, budget - weights) // per_token
    if cap is not None:
        tokens = min(tokens, cap)
    at_once = tokens // seq
    kv = Item("KV pool", tokens * per_token,
              f"{tokens:,} tokens: {at_once:,} sequences of {seq} at once" + (
                  f" (the step's {share} per engine queue)" if share > at_once else ""))
    where = "rollout.options.cpu_memory_gib" if cap is not None else "the device"
    return RankMemory("rollout", [weights_item, kv], budget, f"{frac:g} of {where}", need=weights + one,
                      need_note=need_note)


def engine_offloads(job: JobSpec, partition: Partition | None = None) -> bool:
    """Whether a colocated engine gives the device back to the trainer (milehpc.runtime.offload.for_job drives only
    SGLang's release/resume, and on a CPU SGLang runs without its memory saver: nothing is released)."""
    return job.rollout.engine == "sglang" and (partition is None or partition.devices.vendor != "none")


# ---- the reward model ([reward_model]) ---------------------------------------------------------------------------
# A reward rank's memory (the ranks of ``[reward_model]``, or beside each rollout engine with its colocate = rollout:
# :func:`colocated_reward`).
#
# The shape is the reward model's ``config.json`` when its folder is here, else the policy's ``[model]`` table (said in
# a note). Both scorers load with ``from_pretrained``'s default dtype, fp32 (4 bytes an element):
#
# * **classifier** (``reward_model``): the body and the score head (``hidden x labels``; no output layer), and one
#   forward pass of ``batch_size`` sequences (at most a step's) of ``prompt + max_new_tokens`` tokens without autograd: the widest
#   layer's working set, ``(4h + 3f)`` values per token (norm, q/k/v and the SwiGLU's gate, up and product);
# * **generative** (``judge``, counted as on the reference engine in the scorer's process; a judge on SGLang or vLLM
#   lives in that engine's own explicit budget, its engine_options): the whole causal LM (output layer
#   included), and the KV cache of ``batch_size`` judge prompts decoded as one batch (the template's own tokens are
#   not counted: :func:`milehpc.memory.prompt_tokens` does not know them).

SCORER_BYTES = 4  # fp32: from_pretrained's default dtype, which both scorers keep


def reward_shape(job: JobSpec) -> tuple[Shape, list[str]]:
    """The reward model's shape (its config.json, else the policy's [model] table) and notes."""
    rm = job.reward_model
    shape, notes = model_shape(dataclasses.replace(job, model=dataclasses.replace(job.model, path=rm.path)))
    notes = [f"reward model: {n}" for n in notes]
    if rm.kind == "classifier":  # a score head instead of the output layer: count the embedding once
        shape = dataclasses.replace(shape, tied=True)
    return shape, notes


def _labels(path: str) -> int:
    try:
        cfg = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
        return max(1, len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 1)))
    except (OSError, ValueError, TypeError, AttributeError):
        return 1


def reward_items(job: JobSpec) -> tuple[list[Item], list[str]]:
    """What one scorer process holds (see the module docstring), and notes."""
    rm = job.reward_model
    s, notes = reward_shape(job)
    seq = prompt_tokens(job)[0] + job.rollout.max_new_tokens
    ro = job.rollout
    batch = min(rm.batch_size, math.ceil(ro.prompts_per_step * ro.over_sample) * ro.n_samples)  # a step's at most
    weights = stage_params(s)[0]
    if rm.kind == "classifier":
        labels = _labels(rm.path)
        weights += s.hidden * labels
        work = batch * seq * (4 * s.hidden + 3 * s.ffn)
        return [Item("reward model weights", weights * SCORER_BYTES, f"classifier, fp32, {labels} label(s)"),
                Item("scoring forward", work * SCORER_BYTES,
                     f"{batch} sequences x {seq} tokens, the widest layer (no autograd)")], notes
    kv = 2 * s.layers * s.kv_heads * s.head_dim * SCORER_BYTES
    return [Item("reward model weights", weights * SCORER_BYTES, "generative judge, fp32, the whole model"),
            Item("judge KV cache", batch * seq * kv,
                 f"{batch} judge prompts x {seq} tokens + the template's, one batch")], notes


# Engines whose KV cache lives for one generate call (freed after it: the reference engine, also in its process).
TRANSIENT_KV_ENGINES = ("reference", "reference_process")


def colocated_reward(job: JobSpec, engine: list[Item], reward: list[Item], *, gpu: bool) -> tuple[list[Item], str]:
    """A rollout rank's items with the reward model beside its engine (``colocate = "rollout"``), and a note. The RM
    is off the device while the engine generates (milehpc.runtime.loop.colocated_reward) and the engine is idle
    while the RM scores, so on a GPU the peak is the engine's weights plus the larger of the engine's KV cache and
    the RM: **max, not sum** — where the cache is freed after each generation (the reference engine). SGLang's pool
    and vLLM's cache are allocated at start and held while the RM scores: both count. On a CPU the RM's host copy
    is its weights (nothing is freed): both count."""
    held = sum(i.bytes for i in reward)
    parts = " + ".join(f"{i.name} {size(i.bytes)}" for i in reward)
    if not gpu:
        return engine + reward, ("reward model colocated with the rollout ranks: released while the engine generates, "
                                 "but on a CPU its host copy is its weights, so the rank holds both")
    kv = next((i for i in engine if i.name == "KV cache"), None)
    if job.rollout.engine not in TRANSIENT_KV_ENGINES or kv is None:
        return engine + reward, (f"reward model colocated with the rollout ranks: released while the engine "
                                 f"generates, but the {job.rollout.engine} engine holds its KV cache while the "
                                 "reward model scores, so the rank holds both")
    both = Item("KV cache | reward model", max(kv.bytes, held),
                f"the larger: the KV cache while generating ({size(kv.bytes)}) or the reward model while scoring "
                f"({parts}); it is off the device while the engine generates")
    return [both if i is kv else i for i in engine], ("reward model colocated with the rollout ranks: off the device "
                                                      "while the engine generates (its KV cache freed before it scores)")


def reward_rank(job: JobSpec, partition: Partition, device: int | None) -> tuple[RankMemory, list[str]]:
    """A reward rank (its engine's first: the one that runs the scorer) against its device."""
    items, notes = reward_items(job)
    cpu = partition.devices.vendor == "none"
    unknown = CPU_NOTE if cpu else "device memory unknown (site devices.memory_gib)"
    return RankMemory("reward", items, device, "device" if device else unknown), notes


# ---- CPU nodes ---------------------------------------------------------------------------------------------------

def host_memory(partition: Partition) -> tuple[int | None, str]:
    """A CPU node's memory and where it came from: the site's mem_per_node_gib, else this machine's MemTotal for a
    local partition (the total: what other processes hold now is not what the job may use)."""
    if partition.mem_per_node_gib:
        return int(partition.mem_per_node_gib * GIB), "host memory, the site's mem_per_node_gib"
    if partition.scheduler == "local":
        try:
            for line in MEMINFO.read_text(encoding="ascii").splitlines():
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024, "host memory, this machine's MemTotal"
        except (OSError, ValueError, IndexError):
            pass
    return None, "host memory unknown (site mem_per_node_gib)"


def _overlap(a: int, b: int, c: int, d: int) -> int:
    return max(0, min(b, d) - max(a, c))


def node_memory(ranks: list[RankMemory], plan: Plan, partition: Partition) -> RankMemory:
    """The most loaded node's ranks together against the node's host memory."""
    host, note = host_memory(partition)
    by_role = {r.role: r for r in ranks}
    per = plan.ranks_per_node
    best: list[Item] = []
    for n in range(plan.nodes):
        lo, hi = n * per, min(plan.world_size, (n + 1) * per)
        counts = {"trainer": _overlap(lo, hi, 0, plan.trainer_ranks),
                  "rollout": _overlap(lo, hi, plan.rollout_first, plan.rollout_first + plan.rollout_ranks)}
        if COLOCATED in by_role:
            counts = {COLOCATED: hi - lo - _overlap(lo, hi, plan.reward_first, plan.reward_first + plan.reward_ranks)}
        counts["reward"] = _overlap(lo, hi, plan.reward_first, plan.reward_first + plan.reward_ranks)
        items = [Item(f"{k} {role} rank{'s' if k > 1 else ''}", k * by_role[role].total,
                      f"{k} x {size(by_role[role].total)}") for role, k in counts.items() if k and role in by_role]
        if sum(i.bytes for i in items) > sum(i.bytes for i in best):
            best = items
    return RankMemory(NODE, best or [Item("no ranks", 0)], host, note)


# ---- the whole plan ----------------------------------------------------------------------------------------------

def estimate(job: JobSpec, plan: Plan, partition: Partition, *, vocab_size: int | None = None,
             needs_critic: bool = False, needs_teacher: bool = False) -> Estimate:
    """Per-rank memory of ``plan`` on ``partition``'s devices (see the module doc for every formula); on a CPU
    partition, also its most loaded node against the node's host memory."""
    shape, notes = model_shape(job, vocab_size)
    cpu = partition.devices.vendor == "none"
    gib = partition.devices.memory_gib
    device = int(gib * GIB) if gib and partition.devices.count else None
    titems, extra = trainer_items(job, shape, needs_critic=needs_critic, needs_teacher=needs_teacher, gpu=not cpu)
    notes.append(prompt_tokens(job)[1])
    unknown = CPU_NOTE if cpu else "device memory unknown (site devices.memory_gib)"
    trainer = RankMemory("trainer", titems, device, "device" if device else unknown, extra)
    engine = engine_rank(job, shape, partition, device)
    reward = None
    if job.reward_model.enabled:  # [reward_model]: its own ranks, or the scorer beside each rollout engine
        reward, reward_notes = reward_rank(job, partition, device)
        notes += reward_notes
        if plan.reward_colocated:
            engine.items, note = colocated_reward(job, engine.items, reward.items, gpu=not cpu)
            notes.append(note)
            reward = None
    if plan.colocated and not engine_offloads(job, partition):
        notes.append(f"colocated: the {job.rollout.engine} engine stays resident beside the trainer, so the rank "
                     "holds both")
        ranks = [RankMemory(COLOCATED, titems + engine.items, device, trainer.budget_note, extra)]
    elif plan.colocated:
        notes.append("colocated: the engine is released at start-up (before the trainer is built) and while the "
                     "trainer steps; each side is checked against its own budget and the one that does not fit "
                     "(else the larger) is shown")
        # Not simply the larger total: the engine's budget is mem_fraction_static of the device, so a smaller
        # engine side can overflow while a larger trainer side fits.
        ranks = [next((r for r in (trainer, engine) if not r.fits), max(trainer, engine, key=lambda r: r.total))]
    else:
        ranks = [trainer, engine]
    if reward is not None:
        ranks.append(reward)
    if cpu:
        ranks.append(node_memory(ranks, plan, partition))
    return Estimate(ranks, device, notes)


def _candidate(job: JobSpec, plan: Plan, partition: Partition, table: str, key: str, value: object,
               ) -> tuple[JobSpec, Plan] | None:
    """``job`` with ``table.key = value`` and its plan, when the changed job passes what submit checks (schema,
    layout, the job's and the site's rules); None when it would be refused."""
    from milehpc.config.load import job_from_dict
    from milehpc.config.rules import check_job_rules, check_site_rules
    from milehpc.config.schema import to_dict
    from milehpc.errors import MilehpcError
    from milehpc.plan import make_plan

    data = to_dict(job)
    data[table][key] = value
    try:
        changed = job_from_dict(data)
        new_plan = make_plan(changed, partition, site=plan.site, partition_name=plan.partition)
        check_job_rules(changed)
        check_site_rules(changed, partition)
    except MilehpcError:
        return None
    return changed, new_plan


def _doubling(start: int, most: int) -> list[int]:
    return [v for v in (start << k for k in range(1, 31)) if v <= most]


def _halving(start: int) -> list[int]:
    return [v for v in (start >> k for k in range(1, 31)) if v >= 1]


def suggestion(job: JobSpec, plan: Plan, partition: Partition, role: str, **needs: bool) -> str:
    """The smallest single change that makes ``role``'s ranks fit (what to set, and how much the rank then needs),
    tried in this order: trainer — the distributed optimizer, more TP, a smaller micro-batch, more PP; rollout —
    more GPUs per engine, fewer prompts per step; a colocated rank holding both, or a CPU node — the trainer's, then
    the rollout's. A change is printed only when the changed job passes every check submit makes."""
    tr, ro = job.trainer, job.rollout
    per_node = partition.slots_per_node
    tries: list[tuple[str, str, object]] = []
    if role in ("trainer", COLOCATED, NODE):
        if not tr.distributed_optimizer and tr.dp > 1 and tr.backend == "megatron":
            tries.append(("trainer", "distributed_optimizer", True))
        tries += [("trainer", "tp", tp) for tp in _doubling(tr.tp, per_node)]
        tries += [("trainer", "micro_batch_size", m) for m in _halving(tr.micro_batch_size)]
        tries += [("trainer", "pp", pp) for pp in _doubling(tr.pp, 1 << 12)]
    if role in ("rollout", COLOCATED, NODE):
        tries += [("rollout", "gpus_per_engine", g) for g in _doubling(ro.gpus_per_engine, per_node)]
        tries += [("rollout", "prompts_per_step", n) for n in _halving(ro.prompts_per_step)]
    for table, key, value in tries:
        found = _candidate(job, plan, partition, table, key, value)
        if found is None:
            continue
        est = estimate(*found, partition, **needs)
        rank = next((r for r in est.ranks if r.role == role), None)
        if rank is not None and est.overflow() is None:
            text = str(value).lower() if isinstance(value, bool) else str(value)
            return f"set {table}.{key} = {text} ({_gib(rank.required)} {'per node' if role == NODE else 'per rank'})"
    return "no single change fits: use more GPUs per model copy (trainer.tp/pp, rollout.gpus_per_engine) or a " \
           "smaller model"


def _what(rank: RankMemory) -> str:
    return "the ranks of one node" if rank.role == NODE else f"a {rank.role} rank"


def _needs(rank: RankMemory) -> str:
    return _gib(rank.required) + (f" for {rank.need_note}" if rank.need is not None else "")


def check_fits(job: JobSpec, plan: Plan, partition: Partition, *, file: str | None, force: bool | str = False,
               **needs: bool) -> Estimate:
    """The estimate, or one line when a rank (or a CPU node) cannot fit: the largest item and the smallest change.
    ``force``: True (or "memory") accepts every overflow, "ROLE-memory" that role's only; each one accepted is
    named on stderr."""
    est = estimate(job, plan, partition, **needs)
    forced = set(FORCE_CHECKS.values()) if force in (True, "memory") else {FORCE_CHECKS[force]} if force else set()
    bad = [r for r in est.ranks if not r.fits]
    refused = next((r for r in bad if r.role not in forced), None)
    if refused is not None:
        big = refused.largest()
        fix = suggestion(job, plan, partition, refused.role, **needs)
        field_name = {"trainer": "trainer", COLOCATED: "resources.colocate", NODE: "resources",
                      "reward": "reward_model"}.get(refused.role, "rollout")
        raise ConfigError(f"expected {_what(refused)} to fit {(refused.budget or 0) / GIB:.1f} GiB "
                          f"({refused.budget_note}), got an estimated {_needs(refused)}, the largest item {big.name} "
                          f"{_gib(big.bytes)}; {fix}, or submit with --force-only {refused.role}-memory",
                          file=file, field=field_name)
    for rank in bad:  # every one overridden, by name: --force never switches a check off silently
        print(f"milehpc: warning: --force overrides the {rank.role}-memory check: {_what(rank)} needs an estimated "
              f"{_needs(rank)}, above {_gib(rank.budget or 0)} ({rank.budget_note})", file=sys.stderr)
    return est


def size(n: int) -> str:
    """Bytes as GiB (MiB below one GiB: the CPU models are small)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.2f} MiB"


def _gib(n: int) -> str:
    """Bytes for a one-line message: GiB to one decimal (MiB when that would read 0.0)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB // 10 else size(n)


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
            use = rank.required / rank.budget
            verdict = ("DOES NOT FIT" if use > 1 else "tight" if use > TIGHT else "fits") + \
                f" {use:.0%} of {rank.budget / GIB:.1f} GiB ({rank.budget_note})" + \
                (f": {rank.need_note}; the KV pool takes the rest" if rank.need is not None else "")
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


def job_estimate(job: JobSpec, plan: Plan, partition: Partition) -> Estimate:
    """The job's estimate, checking nothing (the table of ``plan`` and ``doctor``)."""
    return estimate(job, plan, partition, **estimator_needs(job))


def for_job(job: JobSpec, plan: Plan, partition: Partition, *, file: str | None, force: bool | str = False) -> Estimate:
    """The job's estimate; one :class:`ConfigError` line when a rank (or CPU node) cannot fit, unless ``force``
    overrides that check (:func:`check_fits`)."""
    return check_fits(job, plan, partition, file=file, force=force, **estimator_needs(job))

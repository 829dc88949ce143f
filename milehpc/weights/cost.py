"""What one weight sync costs at size, on paper: the bytes each pipeline stage's leader broadcasts, the buckets the
sync makes of them and the seconds the site's fabric needs for them. Login-safe (no torch): ``milehpc plan`` prints
it, ``python -m milehpc.weights.cost`` prints the README's table.

* **tensors**: the model's HF tensors (name, shape, dtype) as the trainers export them, in the torch trainer's order
  (the HF ``state_dict``'s; Megatron's differs within a layer, the tensors are the same: tests/megatron_checks.py),
  an MoE model's experts split per expert by :func:`milehpc.models.moe_names` itself when the engine is SGLang;
  described by :class:`TensorSpec`, which answers what the bucketing reads of a tensor. A tied ``lm_head`` is not
  sent (the engines tie it to the embedding themselves). Stage ``s`` of ``pp``
  holds layers ``[s L/pp, (s+1) L/pp)`` (Megatron's even split), the embedding on the first stage, the final norm and
  the output layer on the last.
* **buckets**: by the sync's own functions: :func:`milehpc.weights.broadcast.plan_buckets` (milehpc's broadcast:
  a tensor of at least 1 MiB is its own broadcast) or :func:`milehpc.rollout.sglang_mapping.buckets` (SGLang's update
  group), both with the 512 MiB default.
* **seconds**: every stage leader broadcasts to every rollout rank, stage after stage (the rollout ranks take the
  stages in order: :func:`milehpc.weights.sync.sync_weights`). NCCL broadcasts along a pipelined ring, so a bucket of
  ``B`` bytes takes ``B / bw + (members - 1) * latency``, with ``bw`` the slowest link the ring crosses: the node's
  injection bandwidth when the group spans nodes, else the GPU-to-GPU link (``[partitions.X.interconnect]`` of the site).
  These are peak figures: the estimate is a lower bound (the README sets it beside published timings).

Not counted: the trainer's export before the first byte moves (TP/EP all-gathers and the Megatron->HF conversion,
reported as ``time/sync_export``), the engine's load of each bucket, and the per-bucket metadata message over MPI.
The stage leader sends each tensor as the export gathers and converts it (issue 33; it used to gather its whole
stage first, 235 GB on one GPU for a 235B MoE at pp=2): beyond its shard it holds about three buckets' worth at once
(:attr:`SyncCost.held_bytes`: the bucket being filled, the one on the wire or its flat copy, the tensor being made).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from milehpc.memory import DTYPE_BYTES, Shape
from milehpc.models import moe_names
from milehpc.rollout import sglang_mapping
from milehpc.weights.broadcast import DEFAULT_BUCKET_BYTES, plan_buckets

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec
    from milehpc.config.site import Partition
    from milehpc.plan import Plan

GB = 10**9  # network figures are decimal (vendors quote GB/s and Gb/s)
QKV_BIAS = frozenset({"qwen2", "qwen2_moe", "glm4"})
QK_NORM = frozenset({"qwen3", "qwen3_moe"})
_LAYER = re.compile(r"\blayers\.(\d+)\.")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor described, not held: what the bucketing and :func:`milehpc.models.moe_names` read of a tensor
    (``numel``, ``element_size``, ``dtype``, ``shape``, indexing by an expert and a row range)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()

    def __getitem__(self, index: Any) -> TensorSpec:
        """``t[e]`` and ``t[e, a:b]`` as torch shapes them (the only indexing moe_names does)."""
        index = index if isinstance(index, tuple) else (index,)
        shape: list[int] = []
        for dim, i in enumerate(index):
            if isinstance(i, slice):
                shape.append(len(range(*i.indices(self.shape[dim]))))
            elif not isinstance(i, int):
                raise TypeError(f"TensorSpec index {i!r}")
        return TensorSpec(self.name, (*shape, *self.shape[len(index):]), self.dtype)


# ---- the model's tensors -------------------------------------------------------------------------------------------
def _layer(s: Shape, model_type: str, head_dim: int, dtype: str, i: int) -> list[TensorSpec]:
    """One decoder layer in HF ``state_dict`` order (transformers 5's in-memory names: stacked experts)."""
    h, pre = s.hidden, f"model.layers.{i}."
    q, kv = s.heads * head_dim, s.kv_heads * head_dim
    out = []
    for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out.append((f"{pre}self_attn.{proj}.weight", (rows, h)))
        if model_type in QKV_BIAS:
            out.append((f"{pre}self_attn.{proj}.bias", (rows,)))
    out.append((f"{pre}self_attn.o_proj.weight", (h, q)))
    if model_type in QK_NORM:
        out += [(f"{pre}self_attn.q_norm.weight", (head_dim,)), (f"{pre}self_attn.k_norm.weight", (head_dim,))]
    mlp = f"{pre}mlp."
    if s.experts:
        router = [(f"{mlp}gate.weight", (s.experts, h))]
        experts = [(f"{mlp}experts.gate_up_proj", (s.experts, 2 * s.moe_ffn, h)),
                   (f"{mlp}experts.down_proj", (s.experts, h, s.moe_ffn))]
        out += experts + router if model_type == "qwen3_moe" else router + experts
        if model_type == "qwen2_moe":
            f = s.shared_ffn
            out += [(f"{mlp}shared_expert.gate_proj.weight", (f, h)), (f"{mlp}shared_expert.up_proj.weight", (f, h)),
                    (f"{mlp}shared_expert.down_proj.weight", (h, f)), (f"{mlp}shared_expert_gate.weight", (1, h))]
    elif model_type == "glm4":
        out += [(f"{mlp}gate_up_proj.weight", (2 * s.ffn, h)), (f"{mlp}down_proj.weight", (h, s.ffn))]
    else:
        out += [(f"{mlp}gate_proj.weight", (s.ffn, h)), (f"{mlp}up_proj.weight", (s.ffn, h)),
                (f"{mlp}down_proj.weight", (h, s.ffn))]
    norms = ["input_layernorm", "post_attention_layernorm"]
    norms += ["post_self_attn_layernorm", "post_mlp_layernorm"] if model_type == "glm4" else []
    out += [(f"{pre}{n}.weight", (h,)) for n in norms]
    return [TensorSpec(name, shape, dtype) for name, shape in out]


def model_tensors(s: Shape, model_type: str, *, head_dim: int | None = None, dtype: str = "bfloat16",
                  moe_layout: str = "transformers") -> list[TensorSpec]:
    """The whole model's exported tensors, in order. ``head_dim``: unset = hidden / heads (Qwen3 sets its own);
    ``moe_layout``: :func:`milehpc.models.engine_moe_layout` of the engine. A tied output layer is not sent."""
    hd = head_dim or s.head_dim
    out = [TensorSpec("model.embed_tokens.weight", (s.vocab, s.hidden), dtype)]
    for i in range(s.layers):
        for t in _layer(s, model_type, hd, dtype, i):
            out += [TensorSpec(n, part.shape, dtype) for n, part in moe_names(t.name, t, model_type, moe_layout)]
    out.append(TensorSpec("model.norm.weight", (s.hidden,), dtype))
    if not s.tied:
        out.append(TensorSpec("lm_head.weight", (s.vocab, s.hidden), dtype))
    return out


def stage_tensors(tensors: Sequence[TensorSpec], layers: int, pp: int, stage: int) -> list[TensorSpec]:
    """What stage ``stage`` of ``pp`` exports: its layers (Megatron's even split; global names), the embedding on
    the first stage, the final norm and output layer on the last."""
    per = layers // pp
    out = []
    for t in tensors:
        m = _LAYER.search(t.name)
        if m:
            keep = stage * per <= int(m.group(1)) < (stage + 1) * per
        else:
            keep = stage == 0 if "embed_tokens" in t.name else stage == pp - 1
        if keep:
            out.append(t)
    return out


# ---- buckets and seconds -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fabric:
    """The site's network figures (``[partitions.X.interconnect]``): bytes per second and seconds."""

    node_bytes_s: float | None  # one node's injection bandwidth into the inter-node fabric, one direction
    gpu_link_bytes_s: float | None  # one GPU to another in the node, one direction
    latency_s: float  # per message and hop

    def bandwidth(self, nodes: int) -> float | None:
        links = [self.gpu_link_bytes_s] + ([self.node_bytes_s] if nodes > 1 else [])
        return None if any(b is None for b in links) else min(b for b in links if b is not None)


def fabric_of(partition: Partition) -> Fabric | None:
    """The partition's network figures, or None when it states none (a CPU partition: no estimate)."""
    net = partition.interconnect
    if net is None or (net.node_gb_s is None and net.gpu_link_gb_s is None):
        return None
    return Fabric(None if net.node_gb_s is None else net.node_gb_s * GB,
                  None if net.gpu_link_gb_s is None else net.gpu_link_gb_s * GB, (net.latency_us or 0.0) * 1e-6)


@dataclass(frozen=True)
class StageCost:
    stage: int
    tensors: int
    bytes: int
    buckets: int
    largest_bucket: int
    seconds: float | None


@dataclass
class SyncCost:
    stages: list[StageCost]
    members: int  # ranks of one stage's broadcast group (its leader and every rollout rank)
    nodes: int  # nodes that group spans
    bandwidth: float | None  # bytes/s of the slowest link on the ring
    direct: bool  # SGLang's update group (else milehpc's broadcast)
    notes: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.stages)

    @property
    def buckets(self) -> int:
        return sum(s.buckets for s in self.stages)

    @property
    def seconds(self) -> float | None:
        times = [s.seconds for s in self.stages]
        return None if any(t is None for t in times) else sum(t for t in times if t is not None)

    @property
    def leader_bytes(self) -> int:
        """The largest stage: the bytes its leader sends."""
        return max((s.bytes for s in self.stages), default=0)

    @property
    def held_bytes(self) -> int:
        """What a stage leader holds at once beyond its shard, streamed (see the module doc): three of its largest
        bucket (a tensor larger than the bucket size travels alone, as its own bucket)."""
        return 3 * max((s.largest_bucket for s in self.stages), default=0)

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "buckets": self.buckets, "seconds": self.seconds, "members": self.members,
                "nodes": self.nodes, "bandwidth_bytes_s": self.bandwidth, "transport": self.transport,
                "leader_bytes": self.leader_bytes, "held_bytes": self.held_bytes, "notes": self.notes,
                "stages": [vars(s) for s in self.stages]}

    @property
    def transport(self) -> str:
        return "sglang update group" if self.direct else "milehpc broadcast"


def bucket_sizes(tensors: Sequence[TensorSpec], *, direct: bool, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 ) -> list[int]:
    """The bytes of each bucket the sync sends ``tensors`` in (its own bucketing functions)."""
    if direct:
        return [sum(t.nbytes for _, t in b) for b in sglang_mapping.buckets(((t.name, t) for t in tensors),
                                                                            bucket_bytes)]
    return [b.nbytes for b in plan_buckets([(t.name, t) for t in tensors], bucket_bytes)[1]]  # type: ignore[misc]


def sync_cost(stages: Sequence[Sequence[TensorSpec]], *, direct: bool, members: int, nodes: int,
              fabric: Fabric | None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncCost:
    """The cost of sending each stage's tensors to ``members - 1`` rollout ranks on a group spanning ``nodes``."""
    bw = fabric.bandwidth(nodes) if fabric else None
    out = []
    for i, tensors in enumerate(stages):
        sizes = bucket_sizes(tensors, direct=direct, bucket_bytes=bucket_bytes)
        seconds = None
        if bw and fabric:
            seconds = sum(b / bw for b in sizes) + len(sizes) * (members - 1) * fabric.latency_s
        out.append(StageCost(i, len(tensors), sum(sizes), len(sizes), max(sizes, default=0), seconds))
    return SyncCost(out, members, nodes, bw, direct)


# ---- a job's sync --------------------------------------------------------------------------------------------------
def wire_dtype(job: JobSpec) -> str:
    """The dtype the trainer's parameters (and so the sync) have: Megatron bf16 under bf16/fp8, else the model's."""
    if job.trainer.backend == "megatron":
        return "bfloat16" if job.trainer.precision in ("bf16", "fp8") else "float32"
    return job.model.dtype


def job_tensors(job: JobSpec, *, head_dim: int | None = None) -> list[TensorSpec]:
    """The exported tensors of the job's model (a checkpoint's config.json when readable here, else [model])."""
    from milehpc import memory
    from milehpc.config.families import folder_config, random_model_type
    from milehpc.models import engine_moe_layout

    s, _ = memory.model_shape(job)
    cfg = (folder_config(job.model.path) if job.model.path else None) or {}
    model_type = cfg.get("model_type") or random_model_type(job.model.arch, s.experts)
    return model_tensors(s, model_type, head_dim=head_dim or cfg.get("head_dim"), dtype=wire_dtype(job),
                         moe_layout=engine_moe_layout(job.rollout.engine))


def group_nodes(plan: Plan) -> int:
    """Nodes one stage's group spans: its leader's (the widest: the last stage's) and the rollout ranks'."""
    source = plan.trainer_rank(0, 0, plan.pp - 1)
    nodes = {plan.node_of(r) for r in (plan.rollout_first, plan.rollout_first + plan.rollout_ranks - 1)}
    first, last = min(nodes), max(nodes)
    return last - first + 1 + (0 if first <= plan.node_of(source) <= last else 1)


def for_job(job: JobSpec, plan: Plan, partition: Partition, *, head_dim: int | None = None,
            tensors: list[TensorSpec] | None = None) -> SyncCost | None:
    """The job's sync cost per step; None when nothing crosses a wire (colocated: in place) or the adapter alone
    travels (LoRA). ``head_dim``: overrides the shape's (the README's Qwen3 sizes without a config.json here);
    ``tensors``: :func:`job_tensors` of the job, when already known."""
    from milehpc.config.job import sync_bucket_bytes
    from milehpc.weights.sync import direct_weight_sync

    if plan.colocated or job.trainer.lora is not None:
        return None
    tensors = tensors if tensors is not None else job_tensors(job, head_dim=head_dim)
    layers = len({m.group(1) for t in tensors if (m := _LAYER.search(t.name))})
    stages = [stage_tensors(tensors, layers, plan.pp, st) for st in range(plan.pp)]
    cost = sync_cost(stages, direct=direct_weight_sync(job), members=1 + plan.rollout_ranks,
                     nodes=group_nodes(plan), fabric=fabric_of(partition), bucket_bytes=sync_bucket_bytes(job))
    device = partition.devices.memory_gib
    if device and cost.held_bytes > device * (1 << 30):
        from milehpc.memory import size

        cost.notes.append(f"a stage leader holds about three of its largest buckets ({size(cost.held_bytes)}) at "
                          f"once while it sends, more than its device's {device:g} GiB")
    return cost


def summary_line(cost: SyncCost | None) -> str:
    """One line for ``milehpc plan``."""
    from milehpc.memory import size

    if cost is None:
        return "in place (colocated) or the adapter alone: nothing crosses the network"
    head = (f"{size(cost.bytes)} in {cost.buckets} bucket(s) over {len(cost.stages)} stage(s) to "
            f"{cost.members - 1} rollout rank(s) on {cost.nodes} node(s), {cost.transport}")
    if cost.seconds is None or cost.bandwidth is None:
        return head + "; no network figures: time not estimated"
    return head + f"; >= {cost.seconds:.3g} s at {cost.bandwidth / GB:,.0f} GB/s (peak)"


# ---- the README's table: published shapes on the shipped GPU sites ------------------------------------------------
# (label, [model], head_dim, {site: (trainer, rollout)}): Qwen3-8B, Llama-3-70B and Qwen3-235B-A22B as their
# config.json files on the Hugging Face hub give them; Megatron bf16 trainer, SGLang engines, separate nodes.
PAPER_MODELS: list[tuple[str, dict[str, Any], int]] = [
    ("8B (Qwen3-8B)", dict(arch="qwen3", hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                           intermediate_size=12288, vocab_size=151936), 128),
    ("70B (Llama-3-70B)", dict(arch="llama", hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                               intermediate_size=28672, vocab_size=128256), 128),
    ("235B-A22B MoE (Qwen3)", dict(arch="qwen3", hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4,
                                   intermediate_size=1536, vocab_size=151936, num_experts=128, moe_top_k=8), 128),
]
# Per model: (trainer tp, pp, dp, ep), (engines, gpus per engine), for 8-GPU nodes and for 4-GPU nodes.
PAPER_LAYOUTS: dict[int, list[tuple[tuple[int, int, int, int], tuple[int, int]]]] = {
    8: [((4, 1, 2, 1), (4, 2)), ((8, 4, 1, 1), (8, 4)), ((4, 2, 8, 8), (8, 8))],
    4: [((4, 1, 1, 1), (2, 2)), ((4, 8, 1, 1), (8, 4)), ((4, 2, 16, 16), (8, 16))],
}
PAPER_SITES = ("dgx-h100-like", "frontier-like", "perlmutter-like")


def paper_rows() -> list[dict[str, Any]]:
    """One row per model and shipped GPU site, through the real job schema, layout and site files."""
    from milehpc.config.load import job_from_dict, load_site
    from milehpc.plan import make_plan

    rows = []
    described: dict[str, list[TensorSpec]] = {}  # per model: the same on every site (Megatron bf16 to SGLang)
    for site_name in PAPER_SITES:
        site, partition = load_site(site_name)
        for (label, model, head_dim), (tr, ro) in zip(PAPER_MODELS, PAPER_LAYOUTS[partition.slots_per_node],
                                                       strict=True):
            job = job_from_dict({"name": "paper", "model": {**model, "max_position_embeddings": 4096},
                                 "trainer": dict(backend="megatron", precision="bf16", tp=tr[0], pp=tr[1], dp=tr[2],
                                                 ep=tr[3]),
                                 "rollout": dict(engine="sglang", engines=ro[0], gpus_per_engine=ro[1])})
            plan = make_plan(job, partition, site=site.name, partition_name=site.default_partition)
            tensors = described.setdefault(label, job_tensors(job, head_dim=head_dim))
            cost = for_job(job, plan, partition, tensors=tensors)
            assert cost is not None and cost.seconds is not None and cost.bandwidth is not None
            rows.append({"model": label, "site": site_name, "trainer": f"tp{tr[0]} pp{tr[1]} dp{tr[2]} ep{tr[3]}",
                         "rollout": f"{ro[0]} x TP{ro[1]}", "nodes": plan.nodes, "stage_gb": cost.leader_bytes / GB,
                         "gb": cost.bytes / GB, "buckets": cost.buckets, "gb_s": cost.bandwidth / GB,
                         "seconds": cost.seconds})
    return rows


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """:func:`paper_rows` as the README's markdown table."""
    lines = ["| model | site | trainer | rollout | nodes | GB sent | largest stage GB | buckets | peak GB/s | >= s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    return lines + [f"| {r['model']} | {r['site']} | {r['trainer']} | {r['rollout']} | {r['nodes']} | {r['gb']:.1f} | "
                    f"{r['stage_gb']:.1f} | {r['buckets']} | {r['gb_s']:.0f} | {r['seconds']:.2f} |" for r in rows]


def main() -> None:
    print("\n".join(table_lines(paper_rows())))


if __name__ == "__main__":
    main()

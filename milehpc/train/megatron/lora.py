"""LoRA for the Megatron trainer (``[trainer.lora]`` with ``trainer.backend = "megatron"``): adapters on the
decoder's linear layers, TP-sharded like the layers they adapt, over a frozen base.

**Layout: one adapter pair per HF projection.** Megatron fuses q/k/v into ``linear_qkv`` (interleaved per query
group) and gate/up into ``linear_fc1`` (``[gate_r; up_r]`` per TP rank); ``peft`` adapts ``q_proj``, ``k_proj`` and
``v_proj`` separately. One fused pair is *not* equivalent: peft's update of the fused weight is the stack
``[B_q A_q; B_k A_k; B_v A_v]`` — three independent A's, rank up to 3r — which one rank-r pair ``B A`` (every block
sharing A's row space) cannot express; a rank-3r fused pair can, but trains other parameters (cross terms
``B_q A_k``, another initialisation and learning dynamics) and could not be exported as peft's adapter. So a fused
layer holds one (A, B) per HF projection, and its update is laid out in the fused layer's own output order (the interleaved qkv groups,
the per-rank gate/up halves). The adapters are then exactly peft's: the same tensors (the same initial draws,
peft's own, see :func:`initial_adapter`), the same names on the wire and in checkpoints.

**TP sharding** (the adapter's update added to the layer's output by a forward hook; the base is untouched):

* column-parallel (``linear_qkv``, ``linear_fc1``: output split over TP): A replicated, B split along the output
  like the base weight (for qkv: whole query groups, for fc1: each of gate and up). ``h = x A^T`` is computed on
  every rank and enters the TP region through ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce
  of the gradient), so A's gradient — and the input's — is whole and the same on every TP rank.
* row-parallel (``linear_proj``, ``linear_fc2``: input split over TP): A split along the input like the base weight,
  B replicated. The partial products ``h_r = x_r A_r^T`` are summed over TP with
  ``reduce_from_tensor_model_parallel_region`` — the all-reduce the base layer does on its output, done on the
  rank-r activation instead of the full output.

Sharded adapter tensors carry Megatron's ``tensor_model_parallel`` attributes, so the gradient norm counts them
once; the base is frozen (``requires_grad = False``) before the DDP wrapper and the optimizer are built, so neither
holds it. What is built so far: dense models, TP and DP (not PP, not MoE experts, not adapter dropout, not
``modules_to_save``: the job rules refuse those, :func:`milehpc.config.rules.lora_fits_the_trainer`), on the local
(pure megatron-core) layer spec: the transformer-engine spec fuses the input RMSNorm into ``linear_qkv``/``fc1``,
whose input an outside adapter would then see un-normed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from milehpc.errors import ConfigError
from milehpc.train import lora as peft_lora

if TYPE_CHECKING:
    from milehpc.config.job import LoraSpec
    from milehpc.train.megatron.model import Arch

# Megatron linear layer (per-layer suffix) -> (HF module prefix, its HF projections in fused order, TP kind).
LINEARS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "self_attention.linear_qkv": ("self_attn.", ("q_proj", "k_proj", "v_proj"), "column"),
    "self_attention.linear_proj": ("self_attn.", ("o_proj",), "row"),
    "mlp.linear_fc1": ("mlp.", ("gate_proj", "up_proj"), "column"),
    "mlp.linear_fc2": ("mlp.", ("down_proj",), "row"),
}
_HF_TO_LINEAR = {f"{pre}{proj}": (linear, proj) for linear, (pre, projs, _) in LINEARS.items() for proj in projs}


def targets(hf_model: Any, spec: LoraSpec) -> dict[int, dict[str, list[str]]]:
    """``{layer: {Megatron linear: [HF projections]}}`` that ``spec.target_modules`` matches on the HF model (the
    torch trainer's matching, :func:`milehpc.train.lora.target_names`); a match Megatron cannot adapt is refused."""
    out: dict[int, dict[str, list[str]]] = {}
    for name in peft_lora.target_names(hf_model, spec.target_modules):
        parts = name.split(".")
        hit = _HF_TO_LINEAR.get(".".join(parts[3:])) if name.startswith("model.layers.") else None
        if hit is None:
            raise ConfigError(f"the megatron trainer adapts the decoder layers' q/k/v/o and gate/up/down projections: "
                              f"expected target_modules matching those only, got a match {name!r}",
                              field="trainer.lora.target_modules")
        linear, proj = hit
        out.setdefault(int(parts[2]), {}).setdefault(linear, []).append(proj)
    return out


def initial_adapter(hf_model: Any, spec: LoraSpec, *, seed: int) -> dict[str, torch.Tensor]:
    """The torch trainer's initial adapter (engine names, full shapes): peft itself attaches it to ``hf_model`` (which
    it wraps in place: pass a model that is not used afterwards) with the run's seed, so both trainers start from
    the same A (and B = 0)."""
    module = peft_lora.attach(hf_model, spec, seed=seed)
    return {peft_lora.engine_name(n): p.detach().clone() for n, p in peft_lora.trainable(module)}


def engine_names(layer: int, linear: str, proj: str) -> tuple[str, str]:
    """(lora_A, lora_B) wire names of one HF projection's adapter."""
    module = f"model.layers.{layer}.{LINEARS[linear][0]}{proj}"
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def peft_name(engine: str) -> str:
    """Wire name -> peft's parameter name (inverse of :func:`milehpc.train.lora.engine_name` for adapters)."""
    for part in ("lora_A", "lora_B"):
        engine = engine.replace(f".{part}.", f".{part}.{peft_lora.ADAPTER}.")
    return peft_lora.PEFT_PREFIX + engine


class Adapter(torch.nn.Module):
    """The adapters of one Megatron linear layer (one A, B pair per HF projection, this TP rank's shards), added to
    the layer's output by a forward hook."""

    def __init__(self, linear: str, projs: list[str], full: dict[str, torch.Tensor], *, layer: int, arch: Arch,
                 scaling: float, tp: int, tp_rank: int, like: torch.Tensor) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.linear, self.kind, self.scaling, self.arch, self.tp = linear, LINEARS[linear][2], scaling, arch, tp
        self.projs = [p for p in LINEARS[linear][1] if p in projs]  # fused order
        self.names = {p: engine_names(layer, linear, p) for p in self.projs}
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        # Column: B split along its output (dim 0); row: A along its input (dim 1). The other one is replicated.
        self.split = ("lora_B", 0) if self.kind == "column" else ("lora_A", 1)
        for proj in self.projs:
            for which, name in zip(("lora_A", "lora_B"), self.names[proj], strict=True):
                t = full[name]
                if which == self.split[0]:
                    t = t.chunk(tp, dim=self.split[1])[tp_rank]
                p = torch.nn.Parameter(t.to(device=like.device, dtype=like.dtype).contiguous().clone())
                set_tensor_model_parallel_attributes(p, which == self.split[0] and tp > 1, self.split[1], 1)
                getattr(self, which)[proj] = p
        # Local output rows of each projection of the fused layer (a projection without an adapter adds zeros).
        g, d = arch.num_kv_heads // tp, arch.head_dim
        self.rows = {"q_proj": g * (arch.num_heads // arch.num_kv_heads) * d, "k_proj": g * d, "v_proj": g * d,
                     "gate_proj": arch.intermediate_size // tp, "up_proj": arch.intermediate_size // tp,
                     "o_proj": arch.hidden_size, "down_proj": arch.hidden_size}

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' update of the layer's (local) output for input ``x`` ([s, b, in or in/tp])."""
        from megatron.core import tensor_parallel

        a = torch.cat([self.lora_A[p] for p in self.projs])  # [n r, in]: one matmul for the fused projections
        h = x @ a.t()
        if self.kind == "column":
            h = tensor_parallel.copy_to_tensor_model_parallel_region(h)
        else:
            h = tensor_parallel.reduce_from_tensor_model_parallel_region(h)
        hs = dict(zip(self.projs, h.split([self.lora_A[p].shape[0] for p in self.projs], dim=-1), strict=True))
        lead = x.shape[:-1]
        parts = [(hs[p] @ self.lora_B[p].t()) * self.scaling if p in hs else x.new_zeros(*lead, self.rows[p])
                 for p in LINEARS[self.linear][1]]
        if self.linear.endswith("linear_qkv"):  # interleaved per local query group: [q of the group, k, v]
            g = self.arch.num_kv_heads // self.tp
            return torch.cat([t.reshape(*lead, g, -1) for t in parts], dim=-1).reshape(*lead, -1)
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

    def export(self, *, grads: bool, group: Any) -> list[tuple[str, torch.Tensor]]:
        """Collective over the TP group: (wire name, full tensor) of every adapter here (``grads``: its gradient)."""
        import torch.distributed as dist

        out = []
        for which in ("lora_A", "lora_B"):
            for proj, p in getattr(self, which).items():
                t = (p.main_grad if grads else p).detach()
                if which == self.split[0] and self.tp > 1:
                    parts = [torch.empty_like(t) for _ in range(self.tp)]
                    dist.all_gather(parts, t.contiguous(), group=group)
                    t = torch.cat(parts, dim=self.split[1])
                out.append((self.names[proj][which == "lora_B"], t))
        return out

    def load(self, full: dict[str, torch.Tensor], tp_rank: int) -> None:
        """Copy this rank's shards of the full adapter tensors ``full`` (wire names) into the parameters."""
        with torch.no_grad():
            for which in ("lora_A", "lora_B"):
                for proj, p in getattr(self, which).items():
                    t = full[self.names[proj][which == "lora_B"]]
                    if which == self.split[0]:
                        t = t.chunk(self.tp, dim=self.split[1])[tp_rank]
                    p.copy_(t)


def _hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + module.lora.delta(x), bias


def attach(module: Any, full: dict[str, torch.Tensor], chosen: dict[int, dict[str, list[str]]], *, arch: Arch,
           spec: LoraSpec, tp: int, tp_rank: int, layer_offset: int) -> list[Adapter]:
    """Freeze ``module`` (this rank's GPTModel) and give its targeted linear layers their adapters, sliced from the
    full adapter ``full`` (wire names) for this TP rank; returns the adapters in a fixed order."""
    module.requires_grad_(False)
    adapters: list[Adapter] = []
    for local, layer in enumerate(module.decoder.layers):
        g = local + layer_offset
        for linear, projs in chosen.get(g, {}).items():
            base = layer.get_submodule(linear)
            adapter = Adapter(linear, projs, full, layer=g, arch=arch, scaling=spec.alpha / spec.rank, tp=tp,
                              tp_rank=tp_rank, like=base.weight)
            base.lora = adapter
            base.register_forward_hook(_hook, with_kwargs=True)
            adapters.append(adapter)
    return adapters


def export(adapters: list[Adapter], *, grads: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Collective over the TP group: the full adapter (or its gradients) in wire names, on every rank."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    return [item for a in adapters for item in a.export(grads=grads, group=group)]


def checkpoint_state(adapters: list[Adapter], *, source: str, base_fingerprint: str) -> dict[str, Any]:
    """Collective over the TP group: the torch trainer's adapter-only checkpoint state (peft names, full tensors),
    which ``milehpc export --adapter`` / ``--merged`` read as they read the torch trainer's."""
    return {"adapter": {peft_name(n): t.cpu().clone() for n, t in export(adapters)}, "base_source": source,
            "base_fingerprint": base_fingerprint}


def load_checkpoint_state(adapters: list[Adapter], state: dict[str, Any], *, base_fingerprint: str,
                          tp_rank: int) -> None:
    """Inverse of :func:`checkpoint_state` (this rank's shards); refuses another base or another adapter layout."""
    if state["base_fingerprint"] != base_fingerprint:
        raise ConfigError(f"expected the base the LoRA checkpoint was trained on ({state['base_source']}), got "
                          "other base weights", field="model")
    full = {n.removeprefix(peft_lora.PEFT_PREFIX).replace(f".{peft_lora.ADAPTER}.", "."): t
            for n, t in state["adapter"].items()}
    want = {n for a in adapters for pair in a.names.values() for n in pair}
    if set(full) != want:
        missing, extra = sorted(want - set(full)), sorted(set(full) - want)
        raise ConfigError(f"expected the checkpoint's adapter to match [trainer.lora], got missing {missing[:3]} "
                          f"extra {extra[:3]}", field="trainer.lora")
    for a in adapters:
        a.load(full, tp_rank)

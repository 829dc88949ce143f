"""Multi-LoRA on the torch trainer (``[trainer.lora.adapters.NAME]``): several peft adapters on one frozen base, each
with its own optimizer and LR schedule. A step splits the batch by the adapter each sample names
(``sample.metadata["adapter"]``, set where its prompt was drawn: :mod:`milehpc.data.adapters`), makes that adapter
the active one (peft's ``set_adapter``: the others neither act nor take gradients) on the policy and on the KL
reference (a copy of the policy when RL began: the base while the adapters are fresh), and steps that adapter's
optimizer alone. The weight sync carries every adapter under its own name (``<module>.lora_A.<NAME>.weight``,
``lora.scaling.<NAME>``); the reference engine merges each for its own prompts.

Over DP ranks (no DDP hooks: each adapter's backward covers a different set of parameters on each rank) every rank
steps the adapters that any rank has samples of, in the job's order: a rank without samples of one joins with a
stand-in (one of its samples, nothing trained on: zero gradients, zero tokens), so the collectives of the step and
the manual all-reduce of that adapter's gradients (:func:`all_reduce_grads`, the DP mean as DDP takes it) match on
every rank, and the update equals the single-rank one on the union batch. The Megatron trainer is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from milehpc.errors import RuntimeFailure
from milehpc.samples import ADAPTER_KEY

if TYPE_CHECKING:
    import torch

    from milehpc.samples import Sample


# The trainer is milehpc.train.torch_trainer.TorchTrainer, typed Any here: that module imports this one, and the
# import-layer test counts a type-checking import as a cycle too.
TorchTrainer = Any

PREFIX = "adapter"  # metrics: adapter/<NAME>/<what>


def adapter_of(sample: Sample) -> str:
    name = sample.metadata.get(ADAPTER_KEY)
    if name is None:
        raise RuntimeFailure(f"a multi-LoRA sample (group {sample.group}) names no adapter in its metadata")
    return str(name)


def stand_in(sample: Sample, name: str) -> Sample:
    """A copy of ``sample`` for adapter ``name`` that trains nothing (its loss mask all zeros, its own group): what a
    DP rank without samples of ``name`` steps with, so that it joins that adapter's collectives."""
    from dataclasses import replace

    return replace(sample, loss_mask=[0] * len(sample.response_ids), group=-1,
                   metadata={**sample.metadata, ADAPTER_KEY: name})


def split_by_adapter(samples: list[Sample], adapters: list[str]) -> dict[str, list[Sample]]:
    """``samples`` by adapter, in the job's adapter order (every adapter present, maybe with none)."""
    out: dict[str, list[Sample]] = {a: [] for a in adapters}
    for s in samples:
        name = adapter_of(s)
        if name not in out:
            raise RuntimeFailure(f"a sample names adapter {name!r}, the job trains {adapters}")
        out[name].append(s)
    return out


def set_adapter(trainer: TorchTrainer, name: str) -> None:
    """``name`` becomes the active adapter of the policy and of the KL reference."""
    trainer.module.base_model.set_adapter(name)
    if trainer.ref is not None:
        trainer.ref.base_model.set_adapter(name)
        trainer.ref.requires_grad_(False)  # set_adapter makes the active adapter trainable: not in the reference


def adapter_adamw(trainer: TorchTrainer, name: str, lr: float) -> Any:
    """An AdamW over adapter ``name``'s parameters alone, with its ``weight_decay`` (else [trainer]'s)."""
    from milehpc.train import lora

    spec = trainer.job.trainer.lora
    assert spec is not None
    return trainer._adamw([p for _, p in lora.trainable(trainer.module, [name])], lr, spec.adapters[name].weight_decay)


def adapter_optimizers(trainer: TorchTrainer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each adapter's AdamW (its ``lr``, else [trainer]'s) and its LR schedule."""
    tr, spec = trainer.job.trainer, trainer.job.trainer.lora
    assert spec is not None
    optimizers, schedulers = {}, {}
    for name, adapter in spec.adapters.items():
        lr = tr.lr if adapter.lr is None else adapter.lr
        optimizers[name] = adapter_adamw(trainer, name, lr)
        schedulers[name] = trainer._schedule(optimizers[name], lr)
    return optimizers, schedulers


JOB_LEVEL_NORMS = ("train/grad_norm", "sft/grad_norm")
REPORTED = {"train/loss": "loss", "train/grad_norm": "grad_norm", "train/lr": "lr", "train/tokens": "tokens",
            "train/actor/kl": "kl", "sft/loss": "sft_loss"}  # of an adapter's step metrics, under adapter/<NAME>/


def per_adapter(trainer: TorchTrainer, samples: list[Sample], update: Callable[[list[Sample], str], dict[str, float]],
                *, skipped: Callable[[str], None] | None = None) -> dict[str, float]:
    """``update(part, name)`` for each adapter with samples, that adapter active (``skipped(name)`` for one without);
    its metrics under ``adapter/<NAME>/`` and the job's totals: token-weighted means, counts and times summed,
    extremes kept, ``grad_norm`` the norm over every adapter's gradients, and no job-level ``lr`` (each adapter has
    its own)."""
    per: dict[str, dict[str, float]] = {}
    parts = split_by_adapter(samples, trainer.adapters)
    counts = [float(len(p)) for p in parts.values()]
    if trainer.dp_size > 1:  # every rank must step the same adapters, in the same order
        from milehpc.comm.collectives import reduce_floats

        counts = reduce_floats(counts)
    for (name, part), count in zip(parts.items(), counts, strict=True):
        if count == 0:
            if skipped is not None:
                skipped(name)
            continue
        if not part:  # other ranks have samples of it: join its collectives, training nothing
            part = [stand_in(samples[0], name)]
        set_adapter(trainer, name)
        per[name] = update(part, name)
    out: dict[str, float] = {}
    weights = {n: m.get("train/tokens", 1.0) for n, m in per.items()}
    total_w = sum(weights.values()) or 1.0
    for name, metrics in per.items():
        for key, value in metrics.items():
            if key in REPORTED:
                out[f"{PREFIX}/{name}/{REPORTED[key]}"] = value
            if key in JOB_LEVEL_NORMS:  # as one optimizer over all the adapters would report it
                out[key] = math.hypot(out.get(key, 0.0), value)
            elif key == "train/lr":
                continue
            elif key.startswith("time/") or key == "train/tokens":
                out[key] = out.get(key, 0.0) + value
            elif key.endswith("_max"):
                out[key] = max(out.get(key, value), value)
            elif key.endswith("_min"):
                out[key] = min(out.get(key, value), value)
            else:
                out[key] = out.get(key, 0.0) + value * weights[name] / total_w
    return out


def all_reduce_grads(params: list[torch.nn.Parameter], dp_size: int) -> None:
    """The DP mean of the active adapter's gradients (a missing one counts as zeros), in one flat all-reduce on the
    default group's device (NCCL takes accelerator tensors only): what DDP's hooks would do, which multi-LoRA cannot
    use (each adapter's backward touches different parameters)."""
    import torch
    import torch.distributed as dist

    from milehpc.comm.collectives import collective_device

    device = collective_device()
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(device)
                      for p in params])
    dist.all_reduce(flat)
    flat /= dp_size
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.device, copy=True)  # not a view of the buffer
        offset += p.numel()


def count_skipped_step(scheduler: Any) -> None:
    """An adapter without samples this step: its LR schedule still counts the step (the job's steps), without
    torch's warning about a schedule stepped before its optimizer."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


def export_adapters(trainer: TorchTrainer) -> Iterator[tuple[str, torch.Tensor]]:
    """Every adapter's tensors and scaling, each under its name; bytes counted per adapter and in total."""
    from milehpc.train import lora

    assert trainer.lora is not None
    trainer.adapter_sync_bytes = {}
    for name in trainer.adapters:
        n = 0
        for key, tensor in lora.export(trainer.module, trainer.lora, name):
            n += tensor.numel() * tensor.element_size()
            yield key, tensor.detach()
        trainer.adapter_sync_bytes[name] = n
        trainer.sync_bytes += n


def load_adapter_optimizers(trainer: TorchTrainer, state: dict[str, Any]) -> None:
    """Each adapter's optimizer and schedule from a checkpoint (the adapters' weights are loaded with the model)."""
    from milehpc.errors import ConfigError

    got = sorted(state.get("optimizers", {}))
    if got != sorted(trainer.adapters):
        raise ConfigError(f"expected a checkpoint of the adapters {sorted(trainer.adapters)}, got {got}",
                          field="trainer.lora.adapters")
    for name in trainer.adapters:
        trainer.optimizers[name].load_state_dict(state["optimizers"][name])
        trainer.schedulers[name].load_state_dict(state["schedulers"][name])

"""LoRA for the torch trainer (``[trainer.lora]``), built on ``peft``: the frozen base stays where it was built,
only the adapter (and any ``modules_to_save``) is trained, kept in the optimizer, checkpointed and synced.

On the wire the adapter carries the engine's (plain HF) names: ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``
for an adapted linear layer (peft's saved-adapter names without the ``base_model.model.`` prefix), and the module's
own names for a module trained in full (``lm_head.weight``), so the reference engine needs no peft to apply them
(:mod:`milehpc.rollout.reference` merges ``base + (B @ A) * alpha / rank`` from a kept copy of the base).

A checkpoint holds the adapter alone plus the base's source (``model.path`` or the seeded build) and a fingerprint
of the base weights, checked on resume: a base that changed under a checkpoint would resume a different model.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError, PluginError

if TYPE_CHECKING:
    import torch

    from milehpc.config.job import JobSpec, LoraSpec

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # peft's name of the one adapter


def _peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise PluginError("[trainer.lora] needs peft: pip install 'milehpc[lora]'") from err
    return peft


def target_names(model: Any, patterns: list[str]) -> list[str]:
    """Full names of the ``nn.Linear`` modules of ``model`` matched by ``patterns`` (fnmatch on the whole name, or on
    its last part for a pattern without '.'); a pattern that matches nothing is a config error."""
    import torch

    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    found: list[str] = []
    for pattern in patterns:
        hits = [n for n in linears if fnmatch.fnmatchcase(n, pattern)
                or ("." not in pattern and fnmatch.fnmatchcase(n.rsplit(".", 1)[-1], pattern))]
        if not hits:
            raise ConfigError(f"expected a pattern matching a linear layer of the model (e.g. {linears[0]!r}), got "
                              f"{pattern!r}", field="trainer.lora.target_modules")
        found += [n for n in hits if n not in found]
    return found


def adapter_names(spec: LoraSpec) -> list[str]:
    """The peft adapter names of a job: its named adapters (multi-LoRA), or peft's one ``default``."""
    return list(spec.adapters) or [ADAPTER]


def attach(model: Any, spec: LoraSpec, *, seed: int) -> Any:
    """``model`` wrapped by peft with fresh adapters (B = 0: the policy is the base until the first step). peft draws
    A from the global RNG: seeded here, so every rank and every rerun of the job starts from the same adapter.
    Several adapters (``spec.adapters``): one peft adapter per name, the i-th drawn from ``seed + i``, all of them
    trainable (each adapter's optimizer holds its own)."""
    import torch

    peft = _peft()
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                             target_modules=target_names(model, spec.target_modules),
                             modules_to_save=list(spec.modules_to_save) or None, bias="none")
    names = adapter_names(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = peft.get_peft_model(model, config, adapter_name=names[0])
        for i, name in enumerate(names[1:], 1):
            torch.manual_seed(seed + i)
            module.add_adapter(name, config)
    if len(names) > 1:
        module.base_model.set_adapter(names[0])
        for _, param in trainable(module, names):
            param.requires_grad_(True)  # peft freezes the inactive ones; each optimizer steps only its own
    return module


def engine_name(name: str) -> str:
    """peft's parameter name -> the name the engine (and a saved peft adapter, prefix aside) uses. A named adapter
    of a multi-LoRA job keeps its name where peft has it: ``<module>.lora_A.<adapter>.weight``."""
    name = name.removeprefix(PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.{ADAPTER}.", f".{part}.")
    return name.replace(f".modules_to_save.{ADAPTER}.", ".")


def adapter_parts(adapter: str) -> tuple[str, ...]:
    return (f".lora_A.{adapter}.", f".lora_B.{adapter}.", f".modules_to_save.{adapter}.")


ADAPTER_PARTS = adapter_parts(ADAPTER)


def trainable(module: Any, adapters: list[str] | None = None) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapters' parameters (peft names; default: peft's one ``default`` adapter), in a fixed order: what the
    optimizer, the checkpoint and the sync hold. By name, not ``requires_grad``: the frozen KL reference copy has
    adapters too."""
    parts = ADAPTER_PARTS if adapters is None else tuple(p for a in adapters for p in adapter_parts(a))
    return [(n, p) for n, p in module.named_parameters() if any(part in n for part in parts)]


def export(module: Any, spec: LoraSpec, adapter: str = ADAPTER) -> Iterator[tuple[str, torch.Tensor]]:
    """One adapter in engine names and its scaling: all that a sync moves (a named adapter's scaling is
    ``lora.scaling.<adapter>``)."""
    import torch

    from milehpc.rollout.reference import LORA_SCALING

    # float64: alpha / rank exactly as the Python float peft multiplies by.
    scaling = LORA_SCALING if adapter == ADAPTER else f"{LORA_SCALING}.{adapter}"
    yield scaling, torch.tensor([spec.alpha / spec.rank], dtype=torch.float64)
    for name, param in trainable(module, None if adapter == ADAPTER else [adapter]):
        yield engine_name(name), param.detach()


FINGERPRINT_SAMPLE = 4096  # elements hashed per tensor: evenly strided, so a change anywhere likely shows


def fingerprint(model: Any) -> str:
    """A cheap identity of the base weights: name, shape, dtype and the exact bytes of a fixed sample of every
    tensor's elements. Bytes, not a float sum: a sum's last bits depend on the device and the thread count, and a
    run resumed or exported elsewhere must get the same fingerprint."""
    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // FINGERPRINT_SAMPLE)
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            h.update(flat[::step].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def base_source(job: JobSpec) -> str:
    """Where the frozen base comes from (a checkpoint stores this instead of the base itself)."""
    return f"path {job.model.path}" if job.model.path else f"seeded build (run.seed = {job.run.seed})"


def nbytes(named: list[tuple[str, torch.Tensor]] | Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def checkpoint_state(module: Any, *, source: str, base_fingerprint: str,
                     adapters: list[str] | None = None) -> dict[str, Any]:
    """Adapter-only model state (peft names: a multi-LoRA job's carry each adapter's name) plus the base's source and
    fingerprint."""
    return {"adapter": {n: p.detach().clone() for n, p in trainable(module, adapters)}, "base_source": source,
            "base_fingerprint": base_fingerprint}


def load_checkpoint_state(module: Any, state: dict[str, Any], *, base_fingerprint: str,
                          adapters: list[str] | None = None) -> None:
    """Inverse of :func:`checkpoint_state`; refuses a checkpoint written over another base."""
    import torch

    if state["base_fingerprint"] != base_fingerprint:
        raise ConfigError(f"expected the base the LoRA checkpoint was trained on ({state['base_source']}), got "
                          "other base weights", field="model")
    params = dict(trainable(module, adapters))
    adapter = state["adapter"]
    if set(adapter) != set(params):
        missing, extra = sorted(set(params) - set(adapter)), sorted(set(adapter) - set(params))
        raise ConfigError(f"expected the checkpoint's adapter to match [trainer.lora], got missing {missing[:3]} "
                          f"extra {extra[:3]}", field="trainer.lora")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(adapter[name])


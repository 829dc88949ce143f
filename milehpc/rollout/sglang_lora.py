"""``[trainer.lora]`` on the SGLang engine: the engine starts with LoRA enabled and every weight sync hands it the
trained adapter through SGLang's LoRA API; every generate request names that adapter (``lora_path``).

How a sync reaches SGLang (checked against sglang 0.5.23, ``srt/entrypoints/engine.py``,
``srt/managers/tokenizer_control_mixin.py``, ``srt/lora/lora_manager.py``):

* Only the adapter travels: the trainer's export (:func:`milehpc.train.lora.export`: ``<module>.lora_A.weight`` /
  ``.lora_B.weight`` and the scaling) goes by the bucketed broadcast to the rollout ranks
  (:func:`milehpc.weights.sync.direct_weight_sync` is False with LoRA), and the engine leader passes it to
  ``Engine.load_lora_adapter_from_tensors(name, tensors, config_dict)`` (peft's names and ``adapter_config.json``
  fields; one serialized copy per TP rank, each scheduler shards its own).
* SGLang refuses to load a name that is loaded ("already loaded"), so each version gets its own name
  (:func:`adapter_name`); the new one is loaded first and the old one unloaded after, so a failed load leaves the
  engine serving the previous adapter. Generation and updates share the engine's lock: no request uses the old
  name while it is unloaded.
* A scheduler that dies (separate rollout ranks) is noticed at the engine's next use — a sync or a generation — or
  by the generate call it dies in (which is then answered once more), and the engine restarts in place with the same
  LoRA server arguments; it loads the adapters of the current version (those a sync brings, or those the rank holds)
  under new names before it generates again. No re-sync
  from the trainer is needed: the rollout rank holds the adapter. (A colocated engine is restarted and refilled by
  :mod:`milehpc.runtime.offload`.)
* The base model is never synced: it is the checkpoint at ``model.path``, or for a random model the trainer's
  seeded build written once to the run directory (:func:`seeded_base_folder`) instead of SGLang's "dummy" weights.

Several adapters (``[trainer.lora.adapters.NAME]``, multi-LoRA): a sync carries each adapter under its name
(``<module>.lora_A.<NAME>.weight``, ``lora.scaling.<NAME>``: :func:`milehpc.train.multi_lora.export_adapters`);
:func:`split_adapters` parts them by name (the names alone tell, as in the reference engine) and each is loaded under
its own versioned name (:func:`adapter_name`) with the single adapter's translation. All the new names load before
any old one is unloaded; a request's ``lora_path`` is the loaded name of its ``SamplingParams.adapter`` (an adapter not
synced yet generates with the base, as peft's fresh B = 0 adapter). The engine holds ``max_loras_per_batch`` = the
adapters plus the base, so a batch naming every adapter never waits for a slot.

SGLang's LoRA cannot load modules trained in full (peft's ``modules_to_save``): the job rules refuse them, as they
refuse target modules SGLang has no LoRA layer for (:data:`milehpc.config.rules.SGLANG_LORA_MODULES`).

On a CPU: the default LoRA kernels (``csgmv``) are triton's, so the engine runs ``lora_backend="torch_native"``
(``srt/lora/backend/torch_backend.py``, plain torch ops); and SGLang's LoRA layers allocate pinned host memory
unconditionally (``pin_memory=True`` in ``srt/lora/layers.py``, ``backend/torch_backend.py``, ``lora.py``), which a
CPU-only torch cannot do. :func:`unpin_if_asked` makes pinning a no-op in the scheduler process there (pinning only
speeds up host-to-GPU copies, of which a CPU engine has none); a GPU engine is never touched.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.config.rules import SGLANG_LORA_MODULES
from milehpc.errors import ConfigError, RuntimeFailure
from milehpc.rollout.reference import LORA_SCALING  # the adapter's alpha / rank, sent with it

if TYPE_CHECKING:
    import torch

    from milehpc.config.job import LoraSpec

PEFT_PREFIX = "base_model.model."  # peft's saved-adapter names (milehpc.train.lora strips it for the wire)
ADAPTER_PARTS = (".lora_A.weight", ".lora_B.weight")
MAX_LORAS_PER_BATCH = 2  # SGLang counts the base model as one; one policy adapter at a time (more: multi-LoRA)
UNPIN_ENV = "MILEHPC_SGLANG_CPU_UNPINNED"  # set by the rank before it starts a CPU engine with LoRA


def server_args(spec: LoraSpec, *, cpu: bool) -> dict[str, Any]:
    """``ServerArgs`` fields of an engine that serves ``spec``'s adapters. Every module kind SGLang can adapt on these
    models gets a slot (an adapter without one of them loads it as zeros), so the engine needs no model to start."""
    args: dict[str, Any] = {"enable_lora": True, "max_lora_rank": spec.rank,
                            "lora_target_modules": list(SGLANG_LORA_MODULES),
                            "max_loras_per_batch": max(MAX_LORAS_PER_BATCH, len(spec.adapters) + 1)}
    if cpu:
        args["lora_backend"] = "torch_native"  # the default (csgmv) and triton need triton on a GPU
    return args


def adapter_name(version: int, load: int, adapter: str | None = None) -> str:
    """The name SGLang knows the ``load``-th loaded adapter by, of weight version ``version`` (a loaded name cannot be
    loaded again, and a re-sent version must load before the one it replaces is unloaded); ``adapter``: multi-LoRA's
    adapter name (None: the job's one adapter)."""
    return f"milehpc-{adapter or 'policy'}-v{version}-{load}"


def split_adapters(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str | None, list[tuple[str, torch.Tensor]]]:
    """A sync's tensors by adapter, each in the single adapter's names (``m.lora_A.NAME.weight`` -> ``NAME``:
    ``m.lora_A.weight``, ``lora.scaling.NAME`` -> ``NAME``: ``lora.scaling``); one adapter's sync is all under None.

    Each tensor is copied (to host memory) as it arrives: ``named`` may be a
    :class:`~milehpc.weights.broadcast.WeightStream`, whose tensors are views of two receive buffers that the next
    buckets overwrite, and an adapter spans many buckets (each tensor of >= 1 MiB is a bucket of its own). An
    adapter is small next to the model, so holding it whole costs little."""
    out: dict[str | None, list[tuple[str, Any]]] = {}
    for name, received in named:
        tensor = received.detach().to("cpu", copy=True)
        adapter, plain = None, name
        if name.startswith(LORA_SCALING + "."):
            adapter, plain = name.removeprefix(LORA_SCALING + "."), LORA_SCALING
        elif name.endswith(".weight"):
            head, _, last = name.removesuffix(".weight").rpartition(".")
            if head.endswith((".lora_A", ".lora_B", ".modules_to_save")):
                adapter, plain = last, f"{head}.weight"
        out.setdefault(adapter, []).append((plain, tensor))
    return out


def sync_names(adapter: str | None, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of :func:`split_adapters` after :func:`adapter_tensors`: one loaded adapter (peft names) in the
    names its sync carried."""
    for name, tensor in tensors.items():
        name = name.removeprefix(PEFT_PREFIX)
        if adapter is not None:
            head, _, _ = name.rpartition(".")  # m.lora_A.weight -> m.lora_A.NAME.weight
            name = f"{head}.{adapter}.weight"
        yield name, tensor


def module_kind(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A.weight`` -> ``q_proj``."""
    for part in ADAPTER_PARTS:
        name = name.removesuffix(part)
    return name.rsplit(".", 1)[-1]


def adapter_tensors(named: Iterable[tuple[str, torch.Tensor]], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """The synced adapter (engine names, see :mod:`milehpc.train.lora`) as peft names -> tensors, copied (the sync's
    buffers are reused). Anything but adapter matrices and the scaling is refused: SGLang's LoRA cannot load it."""
    out: dict[str, Any] = {}
    for name, tensor in named:
        if name == LORA_SCALING:
            if not math.isclose(float(tensor.reshape(-1)[0]), spec.alpha / spec.rank, rel_tol=1e-6):
                raise RuntimeFailure(f"the synced adapter's scaling {float(tensor.reshape(-1)[0])} is not "
                                     f"[trainer.lora] alpha / rank = {spec.alpha / spec.rank}")
            continue
        if not name.endswith(ADAPTER_PARTS):
            raise RuntimeFailure(f"SGLang's LoRA API loads adapter matrices only, got {name!r} (a module trained "
                                 "in full: the job rules refuse trainer.lora.modules_to_save with sglang)")
        out[PEFT_PREFIX + name] = tensor.detach().to("cpu", copy=True).contiguous()
    if not out:
        raise RuntimeFailure("the LoRA sync carried no adapter matrices")
    return out


def config_dict(tensors: dict[str, Any], spec: LoraSpec) -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` fields SGLang reads (``LoRAConfig.from_dict``): the kinds of the modules
    the tensors adapt, and the rank and alpha peft trained with (SGLang's scaling is ``lora_alpha / r``, as peft's)."""
    kinds = sorted({module_kind(n) for n in tensors})
    unknown = [k for k in kinds if k not in SGLANG_LORA_MODULES]
    qkv = {"q_proj", "k_proj", "v_proj"} & set(kinds)
    if unknown or (qkv and not {"q_proj", "v_proj"} <= qkv):
        # SGLang stacks q/k/v into one qkv_proj adapter and needs q_proj and v_proj for it (LoRAAdapter.
        # normalize_qkv_proj; k_proj alone may be missing: zeros).
        raise ConfigError(f"expected adapted modules SGLang's LoRA loads ({', '.join(SGLANG_LORA_MODULES)}; q_proj "
                          f"and v_proj together), got {kinds}", field="trainer.lora.target_modules")
    return {"peft_type": "LORA", "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": kinds,
            "bias": "none", "task_type": "CAUSAL_LM"}


def unpin_if_asked() -> None:
    """In a process started by a CPU engine with LoRA (``UNPIN_ENV`` set; SGLang's scheduler inherits it): pinning
    host memory becomes a no-op (see the module docstring). Idempotent; does nothing where torch can pin."""
    if os.environ.get(UNPIN_ENV) != "1":
        return
    import torch

    if getattr(torch, "_milehpc_unpinned", False) or torch.cuda.is_available():
        return

    def unpinned(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)
        return call

    for fn in ("tensor", "empty", "zeros", "ones", "full", "arange"):  # the factories SGLang's LoRA pins with
        setattr(torch, fn, unpinned(getattr(torch, fn)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    torch._milehpc_unpinned = True  # type: ignore[attr-defined]


def seeded_base_folder(job: Any, run_dir: Path, *, writer: bool) -> str:
    """A random model's base for SGLang: the trainer's seeded build (:func:`milehpc.models.build_model`, the same
    call) saved as an HF folder by ``writer`` (the first engine leader) and waited for by the others. With LoRA only
    the adapter is synced, so the base must be the trainer's bit for bit, not SGLang's dummy weights."""
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import build_model, save_model

    folder = Path(run_dir) / "sglang-lora-base"
    if writer and not folder.is_dir():
        tok = build_tokenizer(job.model.tokenizer)
        model = build_model(job.model, tok.vocab_size, seed=job.run.seed, pad_id=tok.pad_id, eos_id=tok.eos_id)
        tmp = folder.with_name(f"{folder.name}.{os.getpid()}")
        save_model(model, tmp)
        tmp.replace(folder)  # atomic: other engines on the shared filesystem see a whole folder or none
    timeout = job.resources.startup_timeout_s  # building and saving the model may be slow on a busy node
    deadline = time.monotonic() + timeout
    while not folder.is_dir():
        if time.monotonic() > deadline:
            raise RuntimeFailure(f"{folder} was not written by the first engine leader within {timeout:.0f} s "
                                 "(resources.startup_timeout_s)")
        time.sleep(0.2)
    return str(folder)

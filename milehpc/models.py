"""HF-architecture models for the reference engine and trainer: a tiny model of a supported family
(milehpc.config.families) built from the job's ``[model]`` table (random init, seeded) or a checkpoint loaded
from a local folder. No downloads."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.config.families import (
    CHECKPOINT_MOE_ENGINES,
    FAMILIES,
    check_family,
    folder_model_type,
    random_model_type,
)
from milehpc.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from milehpc.config.job import ModelSpec


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
            "float16": torch.float16}[name]


# Packages transformers' modelling code imports at module level for what a text model never runs here: scipy and
# torchvision (object-detection losses, image transforms) and, through torch._dynamo, triton (GPU kernels). On a CPU
# rank they are ~115 MiB of RSS per process (bench/vs_trl.py's peak RSS), so they are hidden while it is imported.
LEAN_HIDDEN = ("scipy", "torchvision", "triton")


@contextmanager
def lean_transformers_import() -> Iterator[None]:
    """Import transformers' modelling code without :data:`LEAN_HIDDEN` on a torch without a GPU.

    A ``None`` entry in ``sys.modules`` makes an import raise ImportError and ``importlib.util.find_spec`` return
    None (Python's import system reference), which is how transformers and torch probe optional packages; the
    entries go when the block ends, so a reward that imports scipy later still gets it (transformers' own cached
    ``is_scipy_available()`` / ``is_torchvision_available()`` and torch's triton probe stay False in this process:
    image processors and detection losses, which a text model on a CPU rank never runs; probes cached True before
    the block, by a tokenizer loaded first, are forgotten on entry). Packages already imported
    stay; with a GPU nothing is hidden (torch.compile and SGLang need triton there, and memory is not short)."""
    import torch

    gpu = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    hidden = [] if gpu else [name for name in LEAN_HIDDEN if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    _forget_availability(hidden)
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


# Where transformers and torch cache "is this optional package installed?" (functools caches of find_spec probes).
_PROBE_MODULES = ("transformers.utils.import_utils", "torch.utils._triton")


def _forget_availability(hidden: list[str]) -> None:
    """Drop the cached probes that name a hidden package, so they ask again and see it absent.

    A rank that touched transformers before its model (a tokenizer folder loads first) has ``is_scipy_available()``
    cached True; the model's import then takes the ``from scipy.optimize import ...`` branch into the hidden package
    and every family fails with "Could not import module 'Qwen2ForCausalLM'" (issue 32)."""
    for module_name in _PROBE_MODULES:
        module = sys.modules.get(module_name)
        if module is None:
            continue  # not imported yet: its first probe runs inside the block and sees the hiding
        for attr, fn in vars(module).items():
            if callable(getattr(fn, "cache_clear", None)) and any(name in attr for name in hidden):
                fn.cache_clear()


def _family(name: str) -> tuple[Any, Any, Any]:
    """(config class, causal LM class, token-classification class) of a family (milehpc.config.families).
    Importing the model module directly skips transformers' lazy top-level namespace, whose first touch scans
    every model it ships (seconds)."""
    import importlib

    fam = FAMILIES[name]
    with lean_transformers_import():
        mod = importlib.import_module(fam.module)
        config_mod = importlib.import_module(fam.module.replace("modeling_", "configuration_"))
    return getattr(config_mod, fam.config_class), getattr(mod, fam.causal_lm), getattr(mod, fam.token_classification)


def hf_config(spec: ModelSpec, vocab_size: int, *, pad_id: int = 0, eos_id: int = 2) -> Any:
    """The HF config for ``spec``: its ``arch`` family, or that family's MoE sibling when ``num_experts > 0``
    (Qwen2-MoE with a shared expert, Qwen3-MoE)."""

    common = dict(
        vocab_size=spec.vocab_size or vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, pad_token_id=pad_id, eos_token_id=eos_id,
        bos_token_id=None, attn_implementation="sdpa",
    )
    if (spec.vocab_size or vocab_size) < vocab_size:
        raise ConfigError(f"expected vocab_size >= the tokenizer's {vocab_size}, got {spec.vocab_size}",
                          field="model.vocab_size")
    model_type = random_model_type(spec.arch, spec.num_experts)
    if model_type == "qwen2_moe":
        common.update(shared_expert_intermediate_size=spec.intermediate_size)
    if spec.num_experts > 0:
        common.update(num_experts=spec.num_experts, num_experts_per_tok=spec.moe_top_k,
                      moe_intermediate_size=spec.intermediate_size)
    if model_type in ("qwen3", "qwen3_moe"):
        common.update(head_dim=spec.hidden_size // spec.num_heads)  # Qwen3 defaults to 128, not hidden / heads
    if model_type == "mistral":
        common.update(sliding_window=None)  # full attention (the Megatron trainer has no sliding window)
    return _family(model_type)[0](**common)


def causal_lm_class(spec: ModelSpec) -> type:
    """The transformers causal-LM class of ``spec``'s family (its name is what an HF config's ``architectures``
    lists)."""
    return _family(random_model_type(spec.arch, spec.num_experts))[1]


def build_model(spec: ModelSpec, vocab_size: int, *, seed: int = 0, pad_id: int = 0, eos_id: int = 2,
                value_head: bool = False) -> torch.nn.Module:
    """A causal LM (or, with ``value_head``, a per-token scalar critic) from ``spec``.

    Random init is seeded so every rank that builds the model gets identical weights.
    """
    import torch

    dtype = torch_dtype(spec.dtype)
    if spec.path:
        with lean_transformers_import():
            return _load_model(spec, dtype, seed=seed, value_head=value_head)
    config = hf_config(spec, vocab_size, pad_id=pad_id, eos_id=eos_id)
    _, causal_lm, token_cls = _family(random_model_type(spec.arch, spec.num_experts))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if value_head:
            config.num_labels = 1
            # No dropout before the value head (transformers defaults to 0.1; verl's critic sets 0): values must
            # not depend on the random stream, in the advantages' pass or in the loss's.
            config.classifier_dropout = 0.0
            model = token_cls(config)
        else:
            model = causal_lm(config)
    return model.to(dtype)


def _load_model(spec: ModelSpec, dtype: torch.dtype, *, seed: int, value_head: bool) -> torch.nn.Module:
    """The model of the local HF folder ``spec.path`` (see :func:`build_model`)."""
    import torch
    import transformers as tf

    path = Path(spec.path)
    if not path.is_dir():
        raise ConfigError(f"expected a local HF checkpoint folder, got {spec.path!r}", field="model.path")
    # The ranks check the family too: the login node may not have seen the folder.
    family = check_family(folder_model_type(path), field="model.path")
    if family.vision:
        if value_head:
            raise ConfigError("expected no critic (a value head) for a vision-language model, got one",
                              field="algorithm.name")
        from milehpc.models_vl import load_vl_model

        return load_vl_model(path, dtype)
    if value_head:
        # The checkpoint has no value head: its fresh init is seeded, so every trainer rank (and both
        # trainers) start the critic from the same head.
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True, num_labels=1)
        config.classifier_dropout = 0.0  # as in build_model (a keyword here would not reach the config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = tf.AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype,
                                                                      local_files_only=True)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model


def save_model(model: Any, path: str | Path) -> None:
    """Write an HF folder that ``model.path`` can load."""
    model.save_pretrained(str(path))


# ---- HF MoE names: transformers 5's in-memory layout vs the checkpoint's --------------------------------------
# transformers 5 holds a layer's routed experts stacked (``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows first;
# ``mlp.experts.down_proj`` [E, H, I]) and reverts that to per-expert names when it saves a checkpoint. SGLang's
# model classes load the checkpoint names only: sglang 0.5.23's qwen2_moe / qwen3_moe / mixtral ``load_weights``
# map experts through ``FusedMoE.make_expert_params_mapping`` (``experts.{e}.gate_proj.`` -> ``experts.w13_``...)
# and skip any name their parameters lack without a word, so stacked names would leave the experts as loaded.
MOE_LAYOUTS = ("transformers", "checkpoint")
_STACKED = re.compile(r"^(?P<pre>(?:.*\.)?layers\.\d+\.)mlp\.experts\.(?P<which>gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(?P<pre>(?:.*\.)?layers\.\d+\.)mlp\.gate\.weight$")


def engine_moe_layout(engine: str) -> str:
    """The MoE layout the rollout engine ``engine`` loads: ``"checkpoint"`` (per-expert names) for SGLang,
    ``"transformers"`` (stacked, as the model holds them) for the engines that run transformers' own classes."""
    return "checkpoint" if engine in CHECKPOINT_MOE_ENGINES else "transformers"


def checkpoint_expert_names(model_type: str, prefix: str, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) checkpoint names of routed expert ``expert`` in the layer named ``prefix``
    (``model.layers.3.``): Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``, else ``mlp.experts.{e}.gate_proj/
    up_proj/down_proj``."""
    if model_type == "mixtral":
        b = f"{prefix}block_sparse_moe.experts.{expert}."
        return b + "w1.weight", b + "w3.weight", b + "w2.weight"
    b = f"{prefix}mlp.experts.{expert}."
    return b + "gate_proj.weight", b + "up_proj.weight", b + "down_proj.weight"


def checkpoint_router_name(model_type: str, prefix: str) -> str:
    """The checkpoint name of the router of the layer named ``prefix`` (Mixtral: ``block_sparse_moe.gate``)."""
    return f"{prefix}block_sparse_moe.gate.weight" if model_type == "mixtral" else f"{prefix}mlp.gate.weight"


def moe_names(name: str, tensor: torch.Tensor, model_type: str, layout: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One tensor of an MoE model in transformers 5's names -> ``layout``'s: in the checkpoint layout the stacked
    experts come apart per expert (views, no copy) and Mixtral's router takes its checkpoint name; every other
    tensor, and everything in the transformers layout, passes as it is."""
    if layout not in MOE_LAYOUTS:
        raise ValueError(f"expected an MoE layout in {MOE_LAYOUTS}, got {layout!r}")
    stacked = _STACKED.match(name) if layout == "checkpoint" else None
    if stacked is not None:
        pre = stacked["pre"]
        for e in range(tensor.shape[0]):
            gate, up, down = checkpoint_expert_names(model_type, pre, e)
            if stacked["which"] == "down_proj":
                yield down, tensor[e]
            else:
                inter = tensor.shape[1] // 2
                yield gate, tensor[e, :inter]
                yield up, tensor[e, inter:]
        return
    router = _ROUTER.match(name) if layout == "checkpoint" and model_type == "mixtral" else None
    yield (checkpoint_router_name(model_type, router["pre"]) if router else name), tensor

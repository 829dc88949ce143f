"""One precision decision for the whole job, read by the trainer *and* the rollout engine.

``trainer.precision`` (fp32 | bf16 | fp8) and ``trainer.fp8_recipe`` in the job spec decide both what the trainer
computes in and what the engine serves, so that rollout logprobs and trainer logprobs come from the same number
format (the train–inference mismatch TIS corrects grows quickly when they do not):

========  ======================================  ==========================================================
trainer   trainer side                            SGLang engine side
========  ======================================  ==========================================================
fp32      fp32 params and math                    ``dtype=model.dtype`` (float32 unless the spec says else)
bf16      bf16 params (Megatron ``bf16=True``;    ``dtype="bfloat16"``
          torch trainer: ``model.dtype``)
fp8       bf16 params + transformer-engine FP8    ``dtype="bfloat16"``, ``quantization="fp8"`` (per-tensor
          GEMMs with ``fp8_recipe`` (Megatron)    online FP8), or ``"mxfp8"`` for the mxfp8 recipe
========  ======================================  ==========================================================

The torch trainer and the reference engines compute in ``model.dtype`` whatever ``trainer.precision`` says, so the
job rules (:mod:`milehpc.config.rules`) refuse ``bf16``/``fp8`` with them unless ``model.dtype = "bfloat16"``, and
``fp8`` with the torch trainer (no FP8 GEMMs there). ``fp32`` with ``model.dtype = "bfloat16"`` stays allowed: the
torch trainer then trains bf16 weights that every engine serves in bf16 (both sides agree), and Megatron trains a
bf16 checkpoint in fp32 that the engines serve in its own dtype (the fp32 row).

Facts used (checked against the sources):

* Megatron-core 0.16 ``TransformerConfig``: ``fp8: Literal['e4m3', 'hybrid'] | None`` and
  ``fp8_recipe: Literal['tensorwise', 'delayed', 'mxfp8', 'blockwise', 'custom']``
  (megatron/core/transformer/transformer_config.py, megatron/core/enums.py ``Fp8Recipe``); ``bf16`` in
  megatron/core/model_parallel_config.py.
* transformer-engine 2.x recipes in ``transformer_engine.common.recipe``: ``DelayedScaling``,
  ``Float8CurrentScaling`` (tensorwise), ``Float8BlockScaling`` (blockwise), ``MXFP8BlockScaling``.
* SGLang ``ServerArgs`` (sgl-project/sglang python/sglang/srt/server_args.py): ``dtype`` and ``quantization``
  with ``"fp8"`` and ``"mxfp8"`` among ``QUANTIZATION_CHOICES`` (both online quantisation).

This module is pure (no torch import): the login node may call it to validate a spec. Whether
transformer-engine is *installed* is checked where it is used (inside the job, where the container has it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from milehpc.errors import missing_dependency

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec

# Megatron's fp8 format: "hybrid" = E4M3 forward, E5M2 gradients (per-tensor recipes, as Miles/slime run them);
# the block recipes use E4M3 throughout, TE's default for Float8BlockScaling / MXFP8BlockScaling
# (transformer_engine/common/recipe/__init__.py) and the format SGLang's fp8 weights are served in.
_MEGATRON_FP8_FORMAT = {"delayed": "hybrid", "tensorwise": "hybrid", "blockwise": "e4m3", "mxfp8": "e4m3"}


def megatron_fp8_format(recipe: str | None) -> str:
    """Megatron's ``fp8`` format for a recipe (block-scaled recipes are e4m3-only); one source for both sides."""
    return _MEGATRON_FP8_FORMAT[recipe or "delayed"]


_TE_RECIPE_CLASS = {
    "delayed": "DelayedScaling",
    "tensorwise": "Float8CurrentScaling",
    "blockwise": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
}


@dataclass(frozen=True)
class Precision:
    """The resolved precision of a job (see the module docstring for the table)."""

    mode: str  # fp32 | bf16 | fp8
    params_dtype: str  # torch dtype name of the trainer's parameters
    fp8_recipe: str | None  # delayed | tensorwise | blockwise | mxfp8 (fp8 only)
    engine_dtype: str  # SGLang ServerArgs.dtype
    engine_quantization: str | None  # SGLang ServerArgs.quantization

    @property
    def needs_transformer_engine(self) -> bool:
        return self.mode == "fp8"

    def megatron_config(self) -> dict[str, Any]:
        """Keyword arguments for Megatron-core's ``TransformerConfig`` (dtype given as a name; the trainer maps it)."""
        out: dict[str, Any] = {"bf16": self.mode in ("bf16", "fp8"), "params_dtype": self.params_dtype}
        if self.mode == "fp8":
            out["fp8"] = megatron_fp8_format(self.fp8_recipe)
            out["fp8_recipe"] = self.fp8_recipe
        return out

    def sglang_server_args(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.engine_dtype}
        if self.engine_quantization:
            out["quantization"] = self.engine_quantization
        return out

    def te_recipe_class(self) -> str | None:
        """Name of the transformer-engine recipe class in ``transformer_engine.common.recipe`` (fp8 only)."""
        return _TE_RECIPE_CLASS[self.fp8_recipe or "delayed"] if self.mode == "fp8" else None


def resolve_precision(job: JobSpec) -> Precision:
    """The one precision both sides use, from ``trainer.precision``, ``trainer.fp8_recipe`` and ``model.dtype``."""
    mode = job.trainer.precision
    if mode == "fp32":
        # fp32 training keeps the checkpoint's dtype on the engine side (a bf16 checkpoint is served in bf16).
        return Precision("fp32", "float32", None, job.model.dtype, None)
    if mode == "bf16":
        return Precision("bf16", "bfloat16", None, "bfloat16", None)
    recipe = job.trainer.fp8_recipe
    return Precision("fp8", "bfloat16", recipe, "bfloat16", "mxfp8" if recipe == "mxfp8" else "fp8")


def require_transformer_engine(precision: Precision, what: str = "trainer.precision = 'fp8'") -> None:
    """One clear line (exit 2) when FP8 is asked for and transformer-engine is not installed.

    Uses ``find_spec`` only: importing transformer_engine without a GPU raises RuntimeError, and with it installed
    on a CPU machine ``import megatron.core`` itself breaks (see shared notes), so it is never imported here.
    """
    if not precision.needs_transformer_engine:
        return
    import importlib.util

    try:
        found = importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise missing_dependency(what, "transformer-engine")


def te_fp8_recipe(precision: Precision) -> Any:
    """The transformer-engine recipe object for ``te.fp8_autocast(enabled=True, fp8_recipe=...)`` (GPU only)."""
    require_transformer_engine(precision)
    from transformer_engine.common import recipe as te_recipe  # GPU containers only

    cls = getattr(te_recipe, precision.te_recipe_class() or "DelayedScaling")
    if precision.fp8_recipe in ("delayed", "tensorwise"):
        return cls(fp8_format=te_recipe.Format.HYBRID)
    return cls()

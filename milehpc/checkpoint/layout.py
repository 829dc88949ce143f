"""The layout record of a checkpoint (rank layout + model shape) and whether a job may load it: the same layout,
or another one the trainer plugin can reshard (``can_reshard``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError, MilehpcError

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec
    from milehpc.plan import Plan

_MODEL_KEYS = ("arch", "path", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
               "vocab_size", "num_experts", "tie_word_embeddings")
_PARALLEL_KEYS = ("world_size", "trainer_ranks", "tp", "pp", "dp", "ep", "rollout_ranks", "engines",
                  "gpus_per_engine", "colocated", "trainer_backend")


def layout_record(job: JobSpec, plan: Plan) -> dict[str, Any]:
    """What a checkpoint's shards depend on: the rank layout and the model's shape."""
    par = {k: getattr(plan, k) for k in _PARALLEL_KEYS if hasattr(plan, k)}
    par["trainer_backend"] = job.trainer.backend
    return {"parallel": par, "model": {k: getattr(job.model, k) for k in _MODEL_KEYS}}


def _diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return [f"{k}={saved.get(k)!r}->{current.get(k)!r}" for k in sorted(set(saved) | set(current))
            if saved.get(k) != current.get(k)]


def check_layout(saved: dict[str, Any] | None, current: dict[str, Any] | None, *, where: str,
                 can_reshard: Callable[[dict[str, Any], dict[str, Any]], bool] | None = None) -> bool:
    """Raise one clear ConfigError if a checkpoint written with layout ``saved`` cannot be loaded by a job
    with layout ``current``. Returns True when the layouts differ but ``can_reshard`` accepted them."""
    if saved is None or current is None:
        return False
    model = _diff(saved.get("model", {}), current.get("model", {}))
    if model:
        raise ConfigError(f"checkpoint is of a different model ({', '.join(model)}); "
                          "resume it with the model it was trained with, or start a new run dir", file=where)
    par = _diff(saved.get("parallel", {}), current.get("parallel", {}))
    if not par:
        return False
    if can_reshard is not None and can_reshard(saved["parallel"], current["parallel"]):
        return True
    raise ConfigError(f"checkpoint was written with another rank layout ({', '.join(par)}) and the "
                      f"{current.get('parallel', {}).get('trainer_backend', '?')} trainer cannot reshard it; "
                      "resume with the original layout or start a new run dir", file=where)


def reshard_check(job: JobSpec) -> Callable[[dict[str, Any], dict[str, Any]], bool] | None:
    """The job's trainer plugin's ``can_reshard`` (see :class:`milehpc.plugin_types.Trainer`), or None when the
    trainer resumes only at the layout it saved (or is unknown here: then the layout check refuses)."""
    from milehpc import plugins
    from milehpc.plugin_types import load_ref

    try:
        spec = plugins.lookup("trainer", job.trainer.backend)
    except MilehpcError:
        return None
    ref = getattr(spec, "can_reshard", None)
    return None if ref is None else load_ref(ref)

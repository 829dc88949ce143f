"""Work-arounds for megatron-core 0.16 bugs on installs without transformer-engine/Apex (CPU, and GPUs without TE).

Applied on every run (GPU or not) right after importing megatron.core; each one is a no-op where the bug is absent.

* ``moe_utils.te_general_gemm`` is only defined when TE imports, but the MoE router reads it unconditionally
  (``NameError``): define it as None so the plain-torch router GEMM is used.
* DistributedOptimizer ``fully_reshardable`` load without TE/Apex: ``_set_main_param_and_optimizer_states`` copies
  every key of torch Adam's state, ``step`` included, from source tensors that never carry ``step``
  (``KeyError: 'step'``). Patched to keep the current ``step`` (which ``load_state_dict`` has just restored).
* The other DistributedOptimizer load bugs (one ``step`` tensor shared by all params; ``assert len(steps) == 1`` on
  a fresh optimizer) are handled in :func:`milehpc.train.megatron.checkpoint.load`.
"""

from __future__ import annotations

from typing import Any

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _patch_distopt_step()
    _APPLIED = True


def _patch_distopt_step() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state.get(main_param, {})
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states

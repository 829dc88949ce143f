"""Work-arounds for megatron-core 0.16 bugs on installs without transformer-engine/Apex (CPU, and GPUs without TE).

Applied on every run (GPU or not) right after importing megatron.core; each one is a no-op where the bug is absent.

* ``moe_utils.te_general_gemm`` is only defined when TE imports, but the MoE router reads it unconditionally
  (``NameError``): define it as None so the plain-torch router GEMM is used.
* DistributedOptimizer state loading without TE/Apex (``fully_reshardable`` / ``dp_reshardable``): see
  :func:`milehpc.train.megatron.checkpoint.load` for the pieces handled at load time.
"""

from __future__ import annotations

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _APPLIED = True

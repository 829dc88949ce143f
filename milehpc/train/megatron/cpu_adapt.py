"""Run megatron-core on a machine without a GPU: the one place where milehpc bends Megatron's CUDA assumptions.

megatron-core (0.16) is device-agnostic except in a handful of spots that hard-code CUDA (facts measured in
shared/notes/gpu-stack-on-cpu.md):

* the RNG tracker (``get_cuda_rng_tracker`` / ``model_parallel_cuda_manual_seed``) saves and restores CUDA generator
  states -> a tracker over the CPU generator (:class:`CpuRNGStatesTracker`);
* ``torch.cuda.current_device()`` used as a ``device=`` argument (memory buffer, rotary embeddings, optimizer
  buffers) -> returns ``cpu``; ``torch.cuda.synchronize`` / ``empty_cache`` (checkpoint save, offload) -> no-ops;
* ``torch.tensor(..., device='cuda')`` in the optimizer and grad clipping, and type checks such as
  ``param.type() == 'torch.cuda.FloatTensor'`` in the (distributed) optimizer and ``clip_grads`` -> a
  :class:`torch.overrides.TorchFunctionMode` that sends ``device='cuda'`` requests to the CPU and answers
  ``Tensor.type()`` with the CUDA type name Megatron expects, and makes ``Tensor.cuda()`` a no-op
  (:class:`milehpc.comm.devcheck.CudaOnCpu`, shared with the device check).

Because ``.cuda()`` is a no-op here, a tensor left on the CPU where a GPU run needs it on CUDA (fault 8 of issue 12:
a CPU tensor all-reduced over NCCL) would pass unseen. With ``MILEHPC_DEVICE_CHECK=nccl`` the redirect records each
tensor's intended device and :mod:`milehpc.comm.devcheck` fails such a collective or module call on the CPU.

:func:`apply` does all of this once per process and only when ``torch.cuda.is_available()`` is False; it is never
applied on GPU runs. Cost (shared notes): ~20% on a tiny model, since the function mode sees every torch call.
Not adapted, chosen around instead: the MoE ``alltoall`` token dispatcher (CUDA streams; the model picks
``allgather`` on CPU), context parallelism (needs TE's attention; the job rules refuse it), and the fused kernels
(config turns them off). Sequence parallelism runs: gloo has the all-gather and reduce-scatter into tensors it uses,
and the local spec's norm, which refuses it, is replaced (:class:`.model.SequenceParallelRMSNorm`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_APPLIED = False


def needed() -> bool:
    import torch

    return not torch.cuda.is_available()


def applied() -> bool:
    return _APPLIED


def _make_mode() -> Any:
    from milehpc.comm import devcheck

    return devcheck.mode_class()()


class CpuRNGStatesTracker:
    """Megatron's named RNG states (data-parallel / model-parallel / expert seeds) over the CPU generator.

    ``fork(name)`` swaps the process's CPU RNG state for the named one and back, as the CUDA tracker does with the
    CUDA generator, so dropout inside TP regions stays reproducible per TP rank.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, Any] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, Any]:
        return dict(self.states_)

    def set_states(self, states: dict[str, Any]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        import torch

        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"RNG state {name!r} / seed {seed} already added")
        self._is_initialized = True
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        import torch

        if name not in self.states_:
            raise RuntimeError(f"RNG state {name!r} was not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def apply() -> bool:
    """Adapt megatron-core to the CPU if there is no GPU. Idempotent; returns True when the adaptation is active."""
    global _APPLIED
    if _APPLIED:
        return True
    if not needed():
        return False
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    from milehpc.comm import devcheck

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda *a, **k: None  # type: ignore[assignment]  # the tracker seeds the CPU generator

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker  # type: ignore[misc,assignment]
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    # The mode stays pushed for the life of the process (trainer processes only ever run this one model).
    devcheck.install_cuda_on_cpu()
    # MILEHPC_DEVICE_CHECK=nccl: record where each tensor would live on a GPU (the redirect above keeps the record)
    # and fail on a CPU tensor reaching a collective of a group that runs NCCL on GPUs. current_device() then
    # answers 0 as on a GPU, so Megatron's device=torch.cuda.current_device() buffers are recorded as CUDA.
    devcheck.enable_if_requested()
    _APPLIED = True
    return True

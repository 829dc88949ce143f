"""vLLM's worker extension for milehpc's weight sync (``LLM(worker_extension_cls="milehpc.weights.vllm.WeightReload")``,
started by :class:`milehpc.rollout.vllm_worker.VLLMCore`): mixed into vLLM's worker class, so ``self`` is the worker
that holds the model, in whatever process vLLM runs it (the engine's own on the CPU, a GPU worker process otherwise).

* :meth:`WeightReload.milehpc_load`: named tensors (HF names) into the live model by vLLM's layerwise reload
  (``model_executor/model_loader/reload``): the CPU backend repacks linear weights for oneDNN at load and leaves empty
  parameters, so a plain ``model.load_weights`` fails there (../shared/notes/vllm-on-cpu.md);
* the direct path: :meth:`WeightReload.milehpc_join` joins the trainer's update group the way SGLang's schedulers do
  (:func:`milehpc.weights.sglang.join_update_group`), :meth:`WeightReload.milehpc_receive` takes one flat uint8 bucket
  by broadcast from rank 0 (:func:`milehpc.rollout.sglang_mapping.flatten_bucket`), :meth:`WeightReload.milehpc_apply`
  loads what arrived.
"""

from __future__ import annotations

import logging
from typing import Any


class WeightReload:
    """vLLM worker extension (mixed into the worker class; ``self`` is the worker): layerwise reload of named
    tensors (HF names) into the live model, and a read-back of its parameters."""

    def milehpc_load(self, named_tensors: list[tuple[str, Any]]) -> int:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.model
        # The rotary embedding's cos/sin cache is no checkpoint weight: the reload puts its own tensors back and warns
        # "RotaryEmbedding: Failed to load weights" at every sync (layerwise.py finalize_layerwise_processing).
        quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        initialize_layerwise_reload(model)
        try:
            model.load_weights(weights=iter(named_tensors))
        finally:  # a failed load must not leave the layers on the meta device with wrapped loaders
            finalize_layerwise_reload(model, runner.model_config)
            quiet.setLevel(level)
        return len(named_tensors)

    # ---- the direct path: the trainer broadcasts into a group this worker joined (gloo here, NCCL on GPUs) --------
    def milehpc_join(self, address: str, port: int, world_size: int, rank: int, group_name: str, backend: str,
                     timeout: float) -> None:
        """Join the trainer's update group as ``rank``, the way SGLang's schedulers join it (TCPStore client at the
        trainer's ``address:port``, the store prefixed by the group name: :func:`milehpc.weights.sglang.
        join_update_group`, which the trainer's stage leader runs as rank 0)."""
        from datetime import timedelta

        from torch.distributed import TCPStore

        from milehpc.weights.sglang import join_update_group

        store = TCPStore(address, port, world_size, False, timedelta(seconds=timeout))
        groups = self.__dict__.setdefault("_milehpc_groups", {})
        groups[group_name] = join_update_group(store, world_size=world_size, rank=rank, group_name=group_name,
                                               backend=backend, timeout=timeout, device=self.device)  # type: ignore[attr-defined]

    def milehpc_receive(self, group_name: str, meta: dict[str, list]) -> int:
        """One bucket the trainer broadcasts from rank 0 as one flat uint8 tensor (milehpc.rollout.sglang_mapping.
        flatten_bucket: ``meta`` lists names, dtypes, shapes in the buffer's order), kept until :meth:`milehpc_apply`:
        a bucket may end inside a layer, and the layerwise reload rebuilds a layer from what it was given."""
        import torch
        import torch.distributed as dist

        dtypes = [getattr(torch, d) for d in meta["dtypes"]]
        sizes = [int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
                 for shape, dt in zip(meta["shapes"], dtypes, strict=True)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)  # type: ignore[attr-defined]
        dist.broadcast(flat, src=0, group=self.__dict__["_milehpc_groups"][group_name])
        pending = self.__dict__.setdefault("_milehpc_pending", [])
        offset = 0
        for name, dt, shape, size in zip(meta["names"], dtypes, meta["shapes"], sizes, strict=True):
            pending.append((name, flat[offset:offset + size].view(dt).view(shape)))
            offset += size
        return len(pending)

    def milehpc_apply(self) -> int:
        """Load every bucket received since the last apply (one layerwise reload)."""
        pending = self.__dict__.pop("_milehpc_pending", [])
        return self.milehpc_load(pending) if pending else 0

    def milehpc_parameters(self) -> list[tuple[str, Any]]:
        """The model's non-empty parameters by vLLM name (fused ``qkv_proj``/``gate_up_proj``; the CPU backend's
        repacked linear weights are empty parameters and are left out)."""
        return [(k, v.detach().clone()) for k, v in self.model_runner.model.named_parameters()  # type: ignore[attr-defined]
                if v.numel() > 0]

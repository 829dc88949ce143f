"""vLLM's worker extension for milehpc's weight sync (``LLM(worker_extension_cls="milehpc.weights.vllm.WeightReload")``,
started by :class:`milehpc.rollout.vllm_worker.VLLMCore`): mixed into vLLM's worker class, so ``self`` is the worker
that holds the model, in whatever process vLLM runs it (the engine's own on the CPU, a GPU worker process otherwise).

* :meth:`WeightReload.milehpc_load`: named tensors (HF names) into the live model by vLLM's layerwise reload
  (``model_executor/model_loader/reload``): the CPU backend repacks linear weights for oneDNN at load and leaves empty
  parameters, so a plain ``model.load_weights`` fails there (../shared/notes/vllm-on-cpu.md);
* the direct path: :meth:`WeightReload.milehpc_join` joins the trainer's update group the way SGLang's schedulers do
  (:func:`milehpc.weights.sglang.join_update_group`: a torch process group on the trainer's TCPStore; gloo on a CPU,
  NCCL on GPUs, the buckets received on the worker's device), :meth:`WeightReload.milehpc_receive` takes one flat
  uint8 bucket by broadcast from rank 0 (:func:`milehpc.rollout.sglang_mapping.flatten_bucket`) and loads it into
  the sync's layerwise reload at once, :meth:`WeightReload.milehpc_apply` closes the reload. Why not vLLM's own
  weight-transfer API (``WeightTransferConfig``, ``distributed/weight_transfer``): its NCCL engine builds a
  ``PyNcclCommunicator`` on vLLM's ``StatelessProcessGroup`` with its own rendezvous, which the trainer's side would
  have to join with vLLM installed in the trainer's process; the torch group above is what the trainer already
  joins for SGLang, and on the CPU the API has no backend at all (its NCCL init fails without an accelerator).
"""

from __future__ import annotations

import logging
from typing import Any


class WeightReload:
    """vLLM worker extension (mixed into the worker class; ``self`` is the worker): layerwise reload of named
    tensors (HF names) into the live model, and a read-back of its parameters."""

    def milehpc_load(self, named_tensors: list[tuple[str, Any]]) -> int:
        self._milehpc_begin()
        try:
            self.model_runner.model.load_weights(weights=iter(named_tensors))  # type: ignore[attr-defined]
        finally:  # a failed load must not leave the layers on the meta device with wrapped loaders
            self._milehpc_end()
        return len(named_tensors)

    def milehpc_load_bytes(self, blob: bytes) -> int:
        """:meth:`milehpc_load` of tensors sent as safetensors bytes (to TP workers in their own processes)."""
        from safetensors.torch import load

        return self.milehpc_load(list(load(blob).items()))

    def _milehpc_begin(self) -> None:
        """Open a layerwise reload (idempotent): the layers go to the meta device with loaders that buffer what they
        are given and rebuild (repack) each layer once all of its weights have arrived."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.__dict__.get("_milehpc_reloading"):
            return
        # The rotary embedding's cos/sin cache is no checkpoint weight: the reload puts its own tensors back and warns
        # "RotaryEmbedding: Failed to load weights" at every sync (layerwise.py finalize_layerwise_processing).
        quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        self.__dict__["_milehpc_reloading"] = quiet.level
        quiet.setLevel(logging.ERROR)
        initialize_layerwise_reload(self.model_runner.model)  # type: ignore[attr-defined]

    def _milehpc_end(self) -> None:
        """Close the reload: layers given none of their weights get their old tensors back, the rest are rebuilt."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        level = self.__dict__.pop("_milehpc_reloading", None)
        if level is None:
            return
        runner = self.model_runner  # type: ignore[attr-defined]
        try:
            finalize_layerwise_reload(runner.model, runner.model_config)
        finally:
            logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(level)

    # ---- the direct path: the trainer broadcasts into a group this worker joined (gloo here, NCCL on GPUs) --------
    def milehpc_join(self, address: str, port: int, world_size: int, rank: int, group_name: str, backend: str,
                     timeout: float) -> None:
        """Join the trainer's update group as ``rank`` + this worker's TP rank (``rank``: the engine's first, as SGLang's
        ``rank_offset``), the way SGLang's schedulers join it (TCPStore client at the trainer's ``address:port``, the
        store prefixed by the group name: :func:`milehpc.weights.sglang.join_update_group`, which the trainer's stage
        leader runs as rank 0). Every TP worker receives the full tensors and its layers' loaders keep its shard."""
        from datetime import timedelta

        from torch.distributed import TCPStore
        from vllm.distributed import get_tensor_model_parallel_rank

        from milehpc.weights.sglang import join_update_group

        rank += get_tensor_model_parallel_rank()
        store = TCPStore(address, port, world_size, False, timedelta(seconds=timeout))
        groups = self.__dict__.setdefault("_milehpc_groups", {})
        groups[group_name] = join_update_group(store, world_size=world_size, rank=rank, group_name=group_name,
                                               backend=backend, timeout=timeout, device=self.device)  # type: ignore[attr-defined]

    def milehpc_leave(self, group_name: str) -> None:
        """Leave an update group (rebuilt under a new name after another engine restarted or a sync broke)."""
        from milehpc.weights.sglang import leave_update_group

        pg = self.__dict__.get("_milehpc_groups", {}).pop(group_name, None)
        if pg is not None:
            leave_update_group(pg)

    def milehpc_receive(self, group_name: str, meta: dict[str, list]) -> int:
        """One bucket the trainer broadcasts from rank 0 as one flat uint8 tensor (milehpc.rollout.sglang_mapping.
        flatten_bucket: ``meta`` lists names, dtypes, shapes in the buffer's order), loaded at once into the sync's
        layerwise reload (opened by the first bucket): a layer is rebuilt as soon as all of its weights are in, so a
        bucket ending inside a layer keeps only that layer's part buffered, never the whole model."""
        import torch
        import torch.distributed as dist

        dtypes = [getattr(torch, d) for d in meta["dtypes"]]
        sizes = [int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
                 for shape, dt in zip(meta["shapes"], dtypes, strict=True)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)  # type: ignore[attr-defined]
        dist.broadcast(flat, src=0, group=self.__dict__["_milehpc_groups"][group_name])
        named, offset = [], 0
        for name, dt, shape, size in zip(meta["names"], dtypes, meta["shapes"], sizes, strict=True):
            named.append((name, flat[offset:offset + size].view(dt).view(shape)))
            offset += size
        self._milehpc_begin()
        try:
            self.model_runner.model.load_weights(weights=iter(named))  # type: ignore[attr-defined]
        except BaseException:
            self._milehpc_end()
            raise
        return len(named)

    def milehpc_apply(self) -> None:
        """After the last bucket: close the sync's reload (rebuilds what waited for the end: attention layers)."""
        self._milehpc_end()

    def milehpc_drop(self) -> None:
        """A broken sync attempt: close its reload (the attempt is redone from the first bucket)."""
        self._milehpc_end()

    def milehpc_parameters(self) -> bytes:
        """The model's non-empty parameters by vLLM name (fused ``qkv_proj``/``gate_up_proj``; this worker's TP shards;
        the CPU backend's repacked linear weights are empty parameters and are left out), as safetensors bytes (they
        may cross a process boundary)."""
        from safetensors.torch import save

        return save({k: v.detach().clone() for k, v in self.model_runner.model.named_parameters()  # type: ignore[attr-defined]
                     if v.numel() > 0})

"""The critic of PPO/GAE on the Megatron trainer: its own GPTModel, sharded like the policy (same config, TP/PP/DP),
whose output layer is a value head (hidden -> 1), with its own DDP wrapper and optimizer.

* **Weights**: the torch trainer's critic (:func:`milehpc.models.build_model` with ``value_head=True``, seeded with
  ``run.seed + 1``: an HF token-classification model) converted like the policy: its body by :mod:`.convert`, its
  ``score`` layer (weight ``[1, hidden]`` and bias) into the :class:`ValueHead`, held whole on every TP rank of the
  last pipeline stage (one output column: nothing to split; its gradient is the same on every TP rank, as a norm's).
* **Step**: the policy's micro-batches through the critic's own pipeline schedule (the algorithm's value loss,
  normalised like the policy's loss), then its own Adam step at ``trainer.options.critic_lr`` (constant, as the
  torch trainer's), clipped at ``trainer.clip_grad``.
* **Checkpoint**: in the same dist checkpoint as the policy under ``critic`` / ``critic_optimizer`` (keys prefixed
  ``critic.``), so it reshards on resume like the policy (:mod:`.checkpoint`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from milehpc.samples.batch import Batch

HEAD = ("output_layer.weight", "output_layer.bias")  # the value head's parameters in the GPTModel
_HF_HEAD = {"output_layer.weight": "score.weight", "output_layer.bias": "score.bias"}
PREFIX = "critic."  # of the critic's keys in the dist checkpoint (the policy's are unprefixed)


class ValueHead(torch.nn.Module):
    """``hidden -> 1`` with a bias, where GPTModel calls its output layer (same call signature)."""

    def __init__(self, hidden_size: int, *, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None,
                ) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


class MegatronCritic:
    """The critic model, its DDP wrapper and optimizer; driven by :class:`MegatronTrainer` (its schedule, its
    micro-batches, its DP group)."""

    def __init__(self, trainer: Any, hf_model: Any = None) -> None:
        """``trainer``: the :class:`~milehpc.train.megatron.trainer.MegatronTrainer` (which imports this module)."""
        from milehpc.train.megatron import model as mm
        from milehpc.train.megatron.convert import load_hf_weights

        self.trainer = trainer
        job = trainer.job
        from milehpc.builtin.megatron import MegatronOptions
        from milehpc.plugin_types import schema_defaults

        # The plugin's defaults under the job's options (from_context merged them; a trainer built directly not).
        self.lr = float({**schema_defaults(MegatronOptions), **job.trainer.options}["critic_lr"])
        if hf_model is None:
            from milehpc.models import build_model

            hf_model = build_model(job.model, trainer.vocab_size, seed=job.run.seed + 1, pad_id=trainer.pad_id,
                                   eos_id=trainer.eos_id, value_head=True)
        hf = dict(hf_model.state_dict())
        head = {name: hf.pop(hf_name) for name, hf_name in _HF_HEAD.items()}
        # A token-classification model has no LM head: convert its body as a tied model (nothing to read there).
        self.body_arch = dataclasses.replace(trainer.arch, tie_word_embeddings=True)
        config = trainer.routing_free_config()
        self.module = mm.build_gpt(trainer.arch, config, tp=trainer.tp, te=trainer.te, share_embeddings=False,
                                   keep_rng=True)
        dtype = config.params_dtype
        if self.module.post_process:
            self.module.output_layer = ValueHead(trainer.arch.hidden_size, dtype=dtype, device="cpu")
            self.module.output_layer.load_state_dict({k.split(".")[-1]: v.to(dtype) for k, v in head.items()})
        load_hf_weights(self.module, hf, self.body_arch, tp=trainer.tp, dtype=dtype, skip=HEAD)
        if trainer.device.type == "cuda":
            self.module.cuda()
        self.ddp, self.optimizer = trainer.wrap(self.module, config, lr=self.lr)

    def values_of(self, mb: Batch, out: torch.Tensor) -> torch.Tensor:
        """``[B, R]`` values at the positions that predict each response token (the torch trainer's
        :meth:`~milehpc.train.torch_trainer.TorchTrainer.values`), from the head's ``[B, T, 1]`` output."""
        return mb.response_logits(out)[..., 0].float()

    def values(self, batch: Batch) -> torch.Tensor:
        """``[B, R]`` values of ``batch`` before the update (what GAE and the value clipping read), every stage."""
        return self.trainer.forward_rows(batch, self.values_of, self.ddp)

    def update(self, mbs: list[Batch], *, tokens: float, seqs: float) -> tuple[float, list[Any]]:
        """One optimizer step of the critic on the step's micro-batches (``batch.returns`` and ``batch.values``
        set): its gradient norm, and the per-micro-batch outputs for the metrics (last stage), whose ``loss`` is
        the value term of the torch trainer's combined loss."""
        tr = self.trainer
        n_mb = len(mbs)

        def loss_func(mb: Batch, out: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            loss, metrics = tr.algorithm.value_loss(self.values_of(mb, out), mb, global_tokens=tokens,
                                                    global_seqs=seqs, dp_size=tr.dp_size)
            metrics["loss"] = float(loss.detach())
            return loss * n_mb, {"metrics": metrics, "tokens": float(mb.num_tokens)}

        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        outs = tr.run_schedule(mbs, loss_func, forward_only=False, model=self.ddp)
        ok, norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron trainer: critic optimizer step skipped (non-finite gradients)")
        return float(norm or 0.0), outs

    def export(self, *, grads: bool = False) -> list[tuple[str, torch.Tensor]]:
        """Collective over the trainer ranks, like :meth:`MegatronTrainer.export_weights`: this stage's critic
        weights (or last gradients) in the HF token-classification names (``model.*``, ``score.*``)."""
        named = self.trainer.export_module(self.module, self.body_arch, grads=grads, raw=HEAD)
        return [(_HF_HEAD.get(n, n), t) for n, t in named]

    # ---- checkpoint (see .checkpoint for the dist checkpoint) -------------------------------------------------
    def local_state(self) -> dict[str, Any]:
        """This rank's shard as trained (a checkpoint without a dist checkpoint directory: same layout only)."""
        return {"critic": {k: v for k, v in self.ddp.state_dict().items() if not k.endswith("_extra_state")},
                "critic_optimizer": self.optimizer.state_dict()}

    def load_local_state(self, state: dict[str, Any]) -> None:
        self.ddp.load_state_dict(state["critic"], strict=False)
        self.optimizer.load_state_dict(state["critic_optimizer"])

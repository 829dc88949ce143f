"""The Megatron-core trainer: TP/PP/DP (EP for MoE) inside milehpc's MPI job, no torchrun.

* **Process groups**: the runtime has already made the torch.distributed default group = the trainer ranks
  (tp * pp * dp of them, in Megatron's order: TP fastest, then DP, then PP — the plan's ``trainer_coords``), so
  ``parallel_state.initialize_model_parallel`` carves TP/PP/DP/EP out of it directly.
* **Weights**: every trainer rank starts from the same HF weights as the rollout engines (built from the job spec
  with the run's seed, or loaded from ``model.path``), converted and TP/PP-sliced (:mod:`.convert`), so trainer
  and engine agree before the first sync.
* **Step**: Megatron DDP + ``get_megatron_optimizer`` (Adam; the distributed optimizer with
  ``trainer.distributed_optimizer``); micro-batches through Megatron's pipeline schedules (1F1B for PP > 1); the
  algorithm plugin's loss on per-token logprobs computed from the vocab-parallel logits (never gathered).
* **Mini- and micro-batches** (issue 33, :mod:`milehpc.train.micro_batches`): ``trainer.mini_batch_size`` makes
  several optimizer steps per rollout batch (old logprobs computed once before the first); with
  ``trainer.max_tokens_per_micro_batch`` the micro-batches are token bins, each one packed row (as
  ``trainer.sequence_parallel``, whose packed length the TP group splits). ``trainer.recompute`` and
  ``sequence_parallel`` are TransformerConfig's (:func:`.model.transformer_config`); ``trainer.vpp`` makes
  :attr:`module` and :attr:`ddp` :class:`.chunks.Chunks` of the rank's model chunks (interleaved 1F1B).
* **Batch**: the ranks of one DP replica (its TP x PP ranks) must see the same samples. Whatever the loop hands
  each rank, :meth:`MegatronTrainer._replica_samples` makes it so: identical lists are used as they are, different
  lists (a loop that split the batch over all trainer ranks) are concatenated in rank order.
* **Weight export** (:meth:`export_weights`, a collective over the trainer ranks): each PP stage's leader (tp=0,
  dp=0) returns that stage's layers in HF names, TP shards (and EP experts) gathered; one sync group per stage.
* **Routing replay (R3)**: with ``trainer.options.routing_replay`` the experts the rollout engine chose
  (``Sample.routed_experts``) are fed to Megatron's ``RouterReplay`` before every micro-batch forward.
* **KL reference**: with ``algorithm.kl_coef > 0`` a frozen second GPT model, built like the policy (same config,
  same TP/PP shard) from the same initial weights: the reference is the *initial policy*. It has no DDP wrapper and
  no optimizer state and is not checkpointed — a resumed run rebuilds it from the same source (the job rules
  refuse it after an SFT warm-up, whose result only the policy's checkpoint holds). Its logprobs go into
  ``batch.ref_logprobs`` before the advantages (KL in the reward or in the loss, as in the torch trainer). With
  ``resources.colocate`` on a GPU it waits in CPU memory between uses.
* **Teacher** (on-policy distillation): a frozen GPT model of its own architecture from ``trainer.options.
  teacher_path``, sharded and offloaded like the reference (:mod:`.teacher`); its logprobs go into
  ``batch.teacher_logprobs``.
* **Critic** (PPO/GAE): a second trained GPT model with a value head, its own DDP wrapper, optimizer and place in the
  dist checkpoint (:mod:`.critic`); its values go into ``batch.values`` before the advantages, and each epoch's
  policy step is followed by its own.
* **LoRA** (``[trainer.lora]``, :mod:`.lora`): the base frozen, peft's adapters TP-sharded on the linear layers; the
  optimizer, the checkpoint (adapter-only, no dist checkpoint) and the weight sync hold the adapter alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError
from milehpc.samples import Sample

if TYPE_CHECKING:
    import torch

    from milehpc.comm.context import RunContext
    from milehpc.config.job import JobSpec
    from milehpc.samples.batch import Batch
    from milehpc.train.megatron import packing

_MASKED_LOGIT = -1e9  # padded vocabulary columns (finite: 0 * it stays 0 in the entropy)


def init_parallel(tp: int, pp: int, ep: int = 1, *, timeout_s: float = 600.0, seed: int = 0, moe: bool = False,
                  vpp: int = 1) -> None:
    """Megatron's parallel state from the already-initialised default process group (idempotent)."""
    import warnings

    # Megatron warns at import and build time about Apex/TE being absent and deprecated knobs: noise in every
    # rank's log for the (intended) local layer spec.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.")

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from milehpc.train.megatron import cpu_adapt, fixes

    cpu_adapt.apply()
    fixes.apply()
    if not dist.is_initialized():
        raise RuntimeError("megatron trainer: torch.distributed is not initialised (the runtime bootstraps it)")
    world = dist.get_world_size()
    if world % (tp * pp):
        raise RuntimeError(f"megatron trainer: trainer world size {world} is not a multiple of tp*pp={tp * pp}")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(), ps.get_virtual_pipeline_model_parallel_world_size() or 1)
        if have == (tp, pp, ep, vpp):
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        # Experts whole on each rank (EP splits them; TP does not), which keeps conversion simple.
        expert_tensor_parallel_size=1 if moe else None,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, *,
                            entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs of ``targets`` (and optionally the entropy) from this TP rank's slice of the logits
    ``[..., V/tp]`` — exact, without gathering the vocabulary. Columns past the HF vocab (TP padding) are masked."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    # A fresh contiguous fp32 copy: Megatron's cross entropy works in place on its input.
    x = logits.to(torch.float32, copy=True).contiguous()
    part = x.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * part
    if start + part > vocab_size:
        cols = torch.arange(start, start + part, device=x.device) >= vocab_size
        x = x.masked_fill(cols, _MASKED_LOGIT)
    ent = None
    if entropy:
        # H = log Z - sum p z with z = x - max: two all-reduces over TP; backward is the identity per rank.
        m = x.detach().max(dim=-1, keepdim=True).values
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX,
                                     group=ps.get_tensor_model_parallel_group())
        z = x - m
        e = z.exp()
        total = tensor_parallel.reduce_from_tensor_model_parallel_region(e.sum(-1))
        pz = tensor_parallel.reduce_from_tensor_model_parallel_region((e * z).sum(-1))
        ent = total.log() - pz / total
    nll = tensor_parallel.vocab_parallel_cross_entropy(x.clone() if entropy else x, targets.contiguous())
    return -nll, ent


class MegatronTrainer:
    """Implements :class:`milehpc.train.base.Trainer` with megatron-core."""

    # Every trainer rank must call export_weights (TP/EP gathers), not only the sync-group sources.
    export_is_collective = True

    def __init__(self, job: JobSpec, *, pad_id: int, vocab_size: int, eos_id: int = 2, algorithm: Any = None,
                 hf_model: Any = None, hf_config: Any = None) -> None:

        from milehpc.train.megatron import model as mm

        self.job = job
        tr = job.trainer
        self.pad_id, self.vocab_size, self.eos_id = int(pad_id), int(vocab_size), int(eos_id)
        t = job.rollout.temperature
        self.temperature = t if t > 0 else 1.0
        if algorithm is None:
            from milehpc.algorithms.api import Algorithm

            algorithm = Algorithm.from_job(job)
        # No KL reference after an SFT warm-up, MoE with tp = 1 and ep dividing the experts, a teacher_path for
        # distillation: the job rules refused anything else on the login node (milehpc.config.rules).
        self.algorithm = algorithm
        from_table = hf_config is None and hf_model is None and not job.model.path
        if hf_config is None:
            hf_config = hf_model.config if hf_model is not None else mm.hf_config_for(
                job.model, vocab_size, pad_id=pad_id, eos_id=eos_id)
        self.arch = mm.arch_of(hf_config)
        if self.arch.is_moe and not from_table:
            # Only a checkpoint's config.json (read here, inside the job) can make the model an MoE unseen by the
            # login node. Megatron trains MoE with TP only together with sequence parallelism (TE/Apex).
            if tr.tp > 1:
                raise ConfigError(f"expected trainer.tp = 1 for a mixture of experts (the checkpoint has "
                                  f"{self.arch.num_experts} experts; split them with trainer.ep), got {tr.tp}",
                                  field="trainer.tp")
            if self.arch.num_experts % tr.ep:
                raise ConfigError(f"expected trainer.ep to divide the checkpoint's {self.arch.num_experts} experts, "
                                  f"got {tr.ep}", field="trainer.ep")
        self.replay = bool(tr.options.get("routing_replay", False)) and self.arch.is_moe
        if tr.vpp > 1 and (self.arch.is_moe or algorithm.needs_ref or algorithm.needs_critic or
                           algorithm.needs_teacher or tr.lora is not None):
            # The job rules refuse these on the login node; a checkpoint's config.json can make the model an MoE.
            raise ConfigError("virtual pipeline stages train a dense policy alone (no KL reference, critic, teacher, "
                              f"LoRA or experts): expected trainer.vpp = 1, got {tr.vpp}", field="trainer.vpp")
        init_parallel(tr.tp, tr.pp, tr.ep, timeout_s=job.resources.collective_timeout_s, seed=job.run.seed,
                      moe=self.arch.is_moe, vpp=tr.vpp)
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.tp, self.pp = tr.tp, tr.pp
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        from milehpc.comm.devcheck import compute_device

        # CUDA on a GPU, and under the device check on the CPU too (where it records intended devices).
        self.device = compute_device()
        self.config = mm.transformer_config(self.arch, tr, routing_replay=self.replay,
                                            use_cpu_initialization=self.device.type == "cpu")
        self.te = mm.use_transformer_engine(tr)
        # The TE spec's attention is causal and reads no mask: feed it packed THD sequences (no padding, as slime
        # does). ``packed`` without ``thd`` runs the same packed rows on the local spec with a block-diagonal mask.
        # Token-budget micro-batches (issue 33) are packed rows too, and so is sequence parallelism (the packed length
        # is a multiple of the TP size, which splits it).
        self.packed = self.te or bool(tr.max_tokens_per_micro_batch) or tr.sequence_parallel
        self.thd = self.te
        if tr.vpp > 1:  # this PP rank's model chunks, one per virtual stage (milehpc.train.megatron.chunks)
            from milehpc.train.megatron.chunks import Chunks

            self.module: Any = Chunks([mm.build_gpt(self.arch, self.config, tp=self.tp, te=self.te, vp_stage=i)
                                       for i in range(tr.vpp)])
        else:
            self.module = mm.build_gpt(self.arch, self.config, tp=self.tp, te=self.te)
        hf_model = self._load_hf(hf_model)
        # [trainer.lora]: what the adapters need of the HF model, read before it is dropped.
        lora_init = self._lora_init(hf_model) if tr.lora is not None else None
        del hf_model
        # Built now, before any step or checkpoint load: the policy is still the initial one.
        self.ref = self._build_reference() if algorithm.needs_ref else None
        self.teacher: Any = None
        self.teacher_vocab = self.arch.vocab_size
        if algorithm.needs_teacher:
            from milehpc.train.megatron import teacher

            self.teacher, self.teacher_vocab = teacher.build(self)
        # The base frozen, adapters on its linear layers (after the reference copied the base).
        self.adapters = self._attach_lora(*lora_init) if lora_init is not None else []
        self.sync_bytes = 0  # of the last adapter export (LoRA)
        # Colocated (or asked to) on a GPU: the frozen models (reference, teacher) wait in CPU memory between uses.
        self.ref_offload = ((bool(job.resources.colocate) or bool(job.trainer.options.get("offload_frozen", False)))
                            and self.device.type == "cuda")
        if self.device.type == "cuda":
            self.module.cuda()
        for frozen in (self.ref, self.teacher):
            if frozen is not None:
                # Colocated: frozen models wait in CPU memory (Megatron builds them on the GPU when it has one).
                frozen.to("cpu" if self.ref_offload else self.device)
        self.ddp, self.optimizer = self.wrap(self.module, self.config, lr=tr.lr)
        self.critic: Any = None
        if algorithm.needs_critic:
            from milehpc.train.megatron.critic import MegatronCritic

            self.critic = MegatronCritic(self)
        self.version = 0
        self.steps = 0

    # ---- construction ------------------------------------------------------------------------------------
    @property
    def layer_offset(self) -> int:
        from milehpc.train.megatron.model import layer_offset

        return layer_offset(self.module)

    @property
    def expert_offset(self) -> int:
        from milehpc.train.megatron.model import expert_offset

        return expert_offset(self.arch)

    def _load_hf(self, hf_model: Any) -> Any:
        """Start from the HF weights the rollout engines start from (same builder, same seed); returns that HF
        model."""
        from milehpc.train.megatron.convert import load_hf_weights

        if hf_model is None:
            from milehpc.models import build_model

            hf_model = build_model(self.job.model, self.vocab_size, seed=self.job.run.seed, pad_id=self.pad_id,
                                   eos_id=self.eos_id)
        from milehpc.train.megatron.chunks import parts

        weights = dict(hf_model.state_dict())
        for chunk in parts(self.module):
            load_hf_weights(chunk, weights, self.arch, tp=self.tp, dtype=self.config.params_dtype)
        return hf_model

    def _lora_init(self, hf_model: Any) -> tuple[dict[int, dict[str, list[str]]], dict[str, torch.Tensor]]:
        """(targeted projections, initial adapter) of the HF model: the torch trainer's peft adapters (same seed,
        same draws); the base's fingerprint and full size are taken first (checkpoints, sync metrics)."""
        from milehpc.train import lora as peft_lora
        from milehpc.train.megatron import lora

        spec = self.job.trainer.lora
        if self.arch.is_moe:  # a checkpoint's config.json can make it an MoE unseen by the login node
            raise ConfigError(f"the megatron trainer's LoRA adapts dense models: expected a checkpoint without "
                              f"experts, got {self.arch.num_experts}", field="trainer.lora")
        self.base_fingerprint = peft_lora.fingerprint(hf_model)
        self.full_model_bytes = peft_lora.nbytes(hf_model.state_dict().items())
        chosen = lora.targets(hf_model, spec)
        return chosen, lora.initial_adapter(hf_model, spec, seed=self.job.run.seed)

    def _attach_lora(self, chosen: dict[int, dict[str, list[str]]], full: dict[str, torch.Tensor]) -> list[Any]:
        """Freeze the base and put this rank's shards of the adapter ``full`` on its ``chosen`` linear layers."""
        from milehpc.train.megatron import lora

        return lora.attach(self.module, full, chosen, arch=self.arch, spec=self.job.trainer.lora, tp=self.tp,
                           tp_rank=self.tp_rank, layer_offset=self.layer_offset)

    def _build_reference(self) -> Any:
        """A frozen copy of the policy as loaded: same config and sharding, no DDP, no optimizer, no gradients."""
        from milehpc.train.megatron import model as mm

        ref = mm.build_gpt(self.arch, self.routing_free_config(), tp=self.tp, te=self.te, keep_rng=True)
        ref.load_state_dict(self.module.state_dict(), strict=True)
        return mm.freeze(ref, self.config)

    def routing_free_config(self) -> Any:
        """The policy's TransformerConfig for a second model (reference, critic): without routing replay, whose
        registry is per process and holds the policy's routers (the second model routes freely)."""
        import copy

        if not self.replay:
            return self.config
        config = copy.copy(self.config)
        config.moe_enable_routing_replay = False
        return config

    def wrap(self, module: Any, config: Any, *, lr: float) -> tuple[Any, Any]:
        """A trained model's Megatron DDP wrapper and Adam optimizer (the policy's; the critic's at its own lr)."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from milehpc.train.megatron.chunks import Chunks, parts

        tr = self.job.trainer
        wrapped = []
        for chunk in parts(module):  # virtual pipeline stages: a DDP wrapper (own gradient buffer) per chunk
            if config.bf16:
                from megatron.core.transformer.module import Float16Module

                chunk = Float16Module(config, chunk)
            wrapped.append(DistributedDataParallel(
                config,
                DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                              use_distributed_optimizer=tr.distributed_optimizer),
                chunk,
            ))
        ddp = wrapped[0] if len(wrapped) == 1 else Chunks(wrapped)
        config.finalize_model_grads_func = finalize_model_grads
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, min_lr=min(tr.min_lr, lr), weight_decay=tr.weight_decay,
                            adam_beta1=tr.adam_beta1, adam_beta2=tr.adam_beta2, adam_eps=tr.adam_eps,
                            clip_grad=tr.clip_grad, bf16=config.bf16, params_dtype=config.params_dtype,
                            use_distributed_optimizer=tr.distributed_optimizer),
            wrapped,
        )
        return ddp, opt

    # ---- the batch of this DP replica ---------------------------------------------------------------------
    def _replica_samples(self, samples: list[Sample]) -> list[Sample]:
        import torch.distributed as dist

        group = self.ps.get_model_parallel_group()
        if dist.get_world_size(group) == 1:
            return list(samples)
        lists: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(lists, [s.to_dict() for s in samples], group=group)
        if all(x == lists[0] for x in lists):
            return list(samples)
        return [Sample.from_dict(d) for part in lists for d in part]

    def _batch(self, samples: list[Sample]) -> Batch:
        """Padded tensors; the routed experts are read from the samples themselves (see :meth:`_replay_tensors`,
        which also accepts full-sequence routing), so they are left out of the batch tensors."""
        import dataclasses

        from milehpc.samples.batch import to_batch

        plain = [dataclasses.replace(s, routed_experts=None) if s.routed_experts else s for s in samples]
        batch = to_batch(plain, self.pad_id).to(self.device)
        batch.samples = list(samples)
        return batch

    def _micro_pairs(self, batch: Batch) -> list[tuple[list[int], Batch]]:
        """(rows, micro-batch) pairs: :meth:`_micro_batches`, or with ``trainer.max_tokens_per_micro_batch`` the token
        bins (:mod:`milehpc.train.micro_batches`; packed rows, so PP's fixed shape is the step's longest bin)."""
        import torch

        from milehpc.train import micro_batches as cut

        budget = self.job.trainer.max_tokens_per_micro_batch
        if not budget:
            mbs = self._micro_batches(batch)
            size = mbs[0].size
            return [(list(range(i * size, (i + 1) * size)), mb) for i, mb in enumerate(mbs)]
        pairs = cut.micro_batches(batch, size=batch.size, max_tokens=budget)
        for _, mb in pairs:
            mb.response_mask = mb.response_mask.to(torch.float32)
        return pairs + [([], mb) for mb in self._count_padding(len(pairs), pairs[0][1])]

    def _count_padding(self, count: int, like: Batch) -> list[Batch]:
        """Fully masked micro-batches that bring ``count`` to what the interleaved schedule (``trainer.vpp``) takes:
        a multiple of the PP size (megatron-core refuses a last group of micro-batches shorter than PP). They add
        nothing to the loss, its gradients or the metrics (no token); none without virtual stages."""
        import torch

        if self.job.trainer.vpp == 1:
            return []
        extra = -count % self.pp
        out = []
        for _ in range(extra):
            mb = like.select(range(like.size))
            mb.response_mask = torch.zeros_like(mb.response_mask)
            mb.samples = [None] * like.size  # type: ignore[list-item]
            out.append(mb)
        return out

    def _micro_batches(self, batch: Batch) -> list[Batch]:
        """Equal-sized micro-batches (PP sends fixed shapes): the last one is padded with fully masked rows."""
        import torch

        size = min(self.job.trainer.micro_batch_size, batch.size)
        pad = -batch.size % size
        if pad:
            idx = list(range(batch.size)) + [0] * pad
            batch = batch.select(idx)
            batch.response_mask[-pad:] = 0
            if batch.samples is not None:
                batch.samples = batch.samples[: -pad] + [None] * pad  # type: ignore[list-item]
            batch.response_lengths = batch.response_lengths.clone()
            batch.response_lengths[-pad:] = 0
            batch.rewards = batch.rewards.clone()
        mbs = batch.split(size)
        for mb in mbs:
            mb.response_mask = mb.response_mask.to(torch.float32)
        return mbs + self._count_padding(len(mbs), mbs[0])

    # ---- forward through the schedule --------------------------------------------------------------------
    def _replay_tensors(self, mb: Batch, pk: packing.Packed | None = None) -> list[torch.Tensor]:
        """This stage's routing-replay indices of one micro-batch: per local MoE layer ``[T * B, k]`` in the
        router's token order (sequence-major).

        ``Sample.routed_experts`` may cover every input position (``P + R - 1`` or ``P + R`` entries, from the first
        prompt token: full R3, what SGLang's routed-experts output gives) or only the ``R`` positions that produced
        the response tokens (``P - 1 .. P + R - 2``; the other prompt positions then route freely). Positions
        without a record (padding, the last token) get experts 0..k-1; they feed nothing that is trained on."""
        import torch

        b, t = mb.input_ids.shape
        k, layers = self.arch.moe_top_k, len(self.module.decoder.layers)
        idx = torch.arange(k, dtype=torch.long).repeat(t, b, layers, 1)  # [T, B, L, k]
        width = mb.prompt_width
        for i, s in enumerate(mb.samples or []):
            if s is None or not s.routed_experts:
                continue
            rec = torch.as_tensor(s.routed_experts, dtype=torch.long)  # [tokens, L_total, k]
            p, r = len(s.prompt_ids), len(s.response_ids)
            if rec.shape[0] == r and r != p + r - 1:
                start = width - 1
            elif rec.shape[0] in (p + r - 1, p + r):
                start = width - p
            else:
                raise ValueError(f"sample {s.index}: routed_experts has {rec.shape[0]} entries; expected {r} "
                                 f"(response positions) or {p + r - 1} (every input position)")
            if rec.shape[1:] != (self.arch.num_layers, k):
                raise ValueError(f"sample {s.index}: routed_experts entries are {tuple(rec.shape[1:])}, expected "
                                 f"(layers, top_k) = ({self.arch.num_layers}, {k})")
            n = min(rec.shape[0], t - start)
            idx[start:start + n, i] = rec[:n, self.layer_offset:self.layer_offset + layers]
        if pk is not None:  # packed: the router sees the packed row's tokens in order
            packed = torch.arange(k, dtype=torch.long).repeat(pk.length, layers, 1)  # [L, layers, k]
            packed[: len(pk.rows)] = idx[pk.cols.cpu(), pk.rows.cpu()]
            return [packed[:, j].contiguous().to(self.device) for j in range(layers)]
        return [idx[:, :, j].reshape(t * b, k).to(self.device) for j in range(layers)]

    def _set_replay(self, mb: Batch, pk: packing.Packed | None = None) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        RouterReplay.clear_global_indices()
        RouterReplay.set_replay_data(self._replay_tensors(mb, pk))
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def run_schedule(self, mbs: list[Batch], loss_func: Any, *, forward_only: bool, model: Any = None) -> list[Any]:
        """Megatron's forward(-backward) schedule over ``mbs`` through ``model`` (the policy's DDP wrapper unless
        given: the reference, forward only); returns the loss_func outputs (last stage)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from milehpc.train.megatron import packing
        from milehpc.train.megatron.model import attention_mask

        model = self.ddp if model is None else model
        replay = self.replay and model is self.ddp  # the reference's routers are not in the replay registry
        # One packed length per step: pipeline stages exchange activations of a fixed shape.
        length = max(packing.packed_length(mb.attention_mask) for mb in mbs) if self.packed else 0
        length = -(-length // self.tp) * self.tp  # sequence parallelism splits the packed row over the TP group

        def forward_step(data_iterator: Iterator[Batch], model: Any) -> tuple[Any, Any]:
            mb = next(data_iterator)
            if not self.packed:
                if replay:
                    self._set_replay(mb)
                out = model(mb.input_ids, mb.position_ids, attention_mask(mb.attention_mask))
                return out, partial(loss_func, mb)
            pk = packing.pack(mb.input_ids, mb.attention_mask, length=length, pad_id=self.pad_id)
            if replay:
                self._set_replay(mb, pk)
            if self.thd:
                out = model(pk.input_ids, pk.position_ids, None, packed_seq_params=packing.thd_params(pk))
            else:
                out = model(pk.input_ids, pk.position_ids, packing.block_causal_mask(pk))
            return out, partial(_unpacked_loss, loss_func, mb, pk)

        seq, size = (length, 1) if self.packed else (int(mbs[0].input_ids.shape[1]), int(mbs[0].size))
        from milehpc.train.megatron.chunks import parts

        chunks = parts(model)  # virtual pipeline stages: the interleaved schedule, an iterator per chunk
        fb = get_forward_backward_func()
        out = fb(forward_step_func=forward_step, data_iterator=[iter(mbs) for _ in chunks] if len(chunks) > 1
                 else iter(mbs), model=chunks, num_microbatches=len(mbs), seq_length=seq, micro_batch_size=size,
                 forward_only=forward_only)
        if replay:
            from megatron.core.transformer.moe.router_replay import RouterReplay

            RouterReplay.clear_global_indices()
            RouterReplay.clear_global_router_replay_action()
        return out

    def _logprobs_of(self, mb: Batch, logits: torch.Tensor, *, entropy: bool = False, vocab_size: int | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        sliced = mb.response_logits(logits)
        if self.temperature != 1.0:
            sliced = sliced / self.temperature
        return vocab_parallel_logprobs(sliced, mb.responses.clamp(min=0), vocab_size or self.arch.vocab_size,
                                       entropy=entropy)

    def _from_last_stage(self, obj: Any) -> Any:
        """Broadcast a python object from the last PP stage to the other stages of this pipeline."""
        import torch.distributed as dist

        if self.pp == 1:
            return obj
        box = [obj]
        src = dist.get_global_rank(self.ps.get_pipeline_model_parallel_group(), self.pp - 1)
        dist.broadcast_object_list(box, src=src, group=self.ps.get_pipeline_model_parallel_group())
        return box[0]

    def _dp_sum_tensor(self, t: Any) -> Any:
        """Sum a tensor over the DP group (batch whitening over the whole step, not one rank's share)."""
        import torch.distributed as dist

        out = t.clone()
        dist.all_reduce(out, group=self.ps.get_data_parallel_group())
        return out

    def _dp_sum(self, values: list[float], op: str = "sum") -> list[float]:
        from milehpc.comm.collectives import reduce_floats

        if self.dp_size == 1:
            return values
        # On the DP group's device: NCCL refuses CPU tensors (issue 12, fault 8).
        return reduce_floats(values, op, group=self.ps.get_data_parallel_group())

    # ---- Trainer protocol ---------------------------------------------------------------------------------
    def _forward_logprobs(self, batch: Batch, model: Any = None, vocab_size: int | None = None) -> torch.Tensor:
        """``[B, R]`` logprobs of ``batch``'s responses (the policy's, or ``model``'s: the reference, the teacher
        with its ``vocab_size``), forward only, on every PP stage, in the dtype of ``batch.response_mask``."""
        return self.forward_rows(batch, lambda mb, logits: self._logprobs_of(mb, logits, vocab_size=vocab_size)[0],
                                 model)

    def forward_rows(self, batch: Batch, rows_of: Any, model: Any = None) -> torch.Tensor:
        """``[B, R]``: ``rows_of(micro-batch, model output)`` of every micro-batch through ``model`` (default: the
        policy), forward only, on every PP stage, in the dtype of ``batch.response_mask``."""
        import torch

        width = batch.response_width

        def loss_func(mb: Batch, out: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            rows = rows_of(mb, out).detach().cpu()  # a trimmed micro-batch's are narrower: padded back to R
            return out.new_zeros(()), {"rows": torch.nn.functional.pad(rows, (0, width - rows.shape[1]))}

        (self.ddp if model is None else model).eval()
        pairs = self._micro_pairs(batch)
        with torch.no_grad():
            out = self.run_schedule([mb for _, mb in pairs], loss_func, forward_only=True, model=model)
        rows = self._from_last_stage(torch.cat([o["rows"] for o in out]) if out else None)
        if self.job.trainer.max_tokens_per_micro_batch:  # the token bins' rows back in the batch's order
            order = torch.as_tensor([r for rows_, _ in pairs for r in rows_])
            rows = rows[: len(order)]  # without the padding micro-batches (virtual stages)
            rows = torch.empty_like(rows).index_copy_(0, order, rows)
        return rows[: batch.size].to(device=batch.response_mask.device, dtype=batch.response_mask.dtype)

    def _frozen_logprobs(self, batch: Batch, model: Any, vocab_size: int | None = None) -> torch.Tensor:
        """``[B, R]`` logprobs of a frozen model (the reference, the teacher); offloaded weights come in for the
        pass and go back."""
        if self.ref_offload:
            model.to(self.device)
        try:
            return self._forward_logprobs(batch, model, vocab_size)
        finally:
            if self.ref_offload:
                model.to("cpu")

    def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        samples = self._replica_samples(samples)
        rows = self._forward_logprobs(self._batch(samples)).tolist()
        return [row[: len(s.response_ids)] for row, s in zip(rows, samples, strict=True)]

    def train_step(self, samples: list[Sample], step: int) -> dict[str, float]:
        import torch

        from milehpc.train.torch_trainer import lr_factor

        t0 = time.perf_counter()
        samples = self._replica_samples(samples)
        batch = self._batch(samples)
        # The no-grad passes before the update, in the torch trainer's order (KL in the reward reads both).
        if self.ref is not None:
            batch.ref_logprobs = self._frozen_logprobs(batch, self.ref)
        if self.teacher is not None:
            batch.teacher_logprobs = self._frozen_logprobs(batch, self.teacher, self.teacher_vocab)
        if self.critic is not None:
            batch.values = self.critic.values(batch)
        minis = self._mini_batch_count(batch)
        # More than one mini-batch: PPO's old policy is the one before the first step (milehpc.train.micro_batches).
        if self.algorithm.needs_old_logprobs or minis > 1:
            batch.old_logprobs = self._forward_logprobs(batch)
        adv_metrics = self.algorithm.compute_advantages(batch, dp_sum=self._dp_sum_tensor if self.dp_size > 1 else None)
        t_prepared = time.perf_counter()  # the no-grad logprob passes and the advantages (bench/realsize.py)
        tokens, seqs = self._dp_sum([batch.num_tokens, batch.num_seqs])
        tr = self.job.trainer
        factor = lr_factor(self.steps, warmup=tr.warmup_steps, total=self.job.run.steps, schedule=tr.lr_schedule,
                           min_ratio=tr.min_lr / tr.lr if tr.lr else 0.0)
        for group in self.optimizer.param_groups:
            group["lr"] = tr.lr * factor
        from milehpc.train import micro_batches as cut

        # Per mini-batch: its global counts (what its loss is normalised by) and its micro-batches.
        steps = []
        for part in cut.mini_batches(batch, minis):
            counts = (tokens, seqs) if minis == 1 else tuple(self._dp_sum([part.num_tokens, part.num_seqs]))
            steps.append((counts, [mb for _, mb in self._micro_pairs(part)]))
        version = self.version
        epochs = self.job.algorithm.ppo_epochs
        first_epoch = True
        (tokens_now, seqs_now), mbs = steps[0]
        n_mb = len(mbs)

        def loss_func(mb: Batch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            logp, ent = self._logprobs_of(mb, logits, entropy=True)
            if mb.old_logprobs is None:
                mb.old_logprobs = logp.detach()
            loss, metrics = self.algorithm.loss(logp, mb, entropy=ent, global_tokens=tokens_now,
                                                global_seqs=seqs_now, dp_size=self.dp_size)
            extra = {"tokens": float(mb.num_tokens)}
            # The train-inference mismatch: of the first epoch (later ones see updated weights), as the torch trainer.
            if first_epoch and mb.rollout_logprobs is not None and mb.samples is not None:
                fresh = torch.tensor([s is not None and s.weight_version == version for s in mb.samples],
                                     dtype=torch.bool, device=logp.device)
                m = mb.response_mask.bool() & fresh[:, None]
                if m.any():
                    d = (logp.detach() - mb.rollout_logprobs).abs()[m]
                    extra.update(diff_max=float(d.max()), diff_sum=float(d.sum()), diff_n=float(d.numel()))
            # The schedule divides by the number of micro-batches; the loss is already globally normalised.
            return loss * n_mb, {"metrics": metrics, **extra}

        self.ddp.train()
        grad_norm = critic_norm = 0.0
        outs: list[Any] = []  # every epoch's (policy and critic): the metrics are their means over the epochs
        for _epoch in range(epochs):
            for (tokens_now, seqs_now), mbs in steps:
                n_mb = len(mbs)
                self.ddp.zero_grad_buffer()
                self.optimizer.zero_grad()
                outs += self.run_schedule(mbs, loss_func, forward_only=False)
                first_epoch = False  # the mismatch is of the weights that sampled: the first pass alone
                ok, norm, _ = self.optimizer.step()
                if not ok:
                    raise RuntimeError("megatron trainer: optimizer step skipped (non-finite gradients)")
                grad_norm = float(norm or 0.0)
                if self.critic is not None:
                    critic_norm, critic_outs = self.critic.update(mbs, tokens=tokens_now, seqs=seqs_now)
                    outs += critic_outs
        self.version += 1
        self.steps += 1
        # The critic's outputs add its metrics and its value term to "loss" (the torch trainer's combined loss).
        summary = self._from_last_stage(self._summarise(outs, tokens, epochs, minis))
        from milehpc.comm.collectives import combine_rank_metrics

        # Combined over the DP ranks, as the torch trainer reports them (each rank's are of its share of the batch).
        dp_group = self.ps.get_data_parallel_group()
        out = {f"train/{k}": v for k, v in combine_rank_metrics(summary["sums"], self.dp_size, group=dp_group).items()}
        diff_sum, diff_n = self._dp_sum([summary["diff_sum"], summary["diff_n"]])
        adv = combine_rank_metrics(adv_metrics, self.dp_size, group=dp_group)
        out.update({f"train/{k}": v for k, v in adv.items()})
        out["train/grad_norm"] = grad_norm
        if self.critic is not None:
            out["critic/grad_norm"] = critic_norm
        out["train/lr"] = tr.lr * factor
        out["train/tokens"] = tokens
        if diff_n > 0:
            out["train/logprob_diff_mean"] = diff_sum / diff_n
            out["train/logprob_diff_max"] = self._dp_sum([summary["diff_max"]], "max")[0]
        out["time/train_compute"] = time.perf_counter() - t0
        out["time/train_prepare"] = t_prepared - t0
        if self.adapters:  # bytes the last weight sync moved, and what a full-model sync would have (torch trainer's)
            out["sync/bytes"] = float(self.sync_bytes)
            out["sync/full_model_bytes"] = float(self.full_model_bytes)
        return out

    def _mini_batch_count(self, batch: Batch) -> int:
        """Optimizer steps this train step takes: the job's mini-batches, no more than any DP rank has samples."""
        from milehpc.train import micro_batches as cut

        fewest = (lambda: int(-self._dp_sum([-float(batch.size)], "max")[0])) if self.dp_size > 1 else None
        return cut.rank_mini_batch_count(self.job, batch.size, fewest)

    def _summarise(self, outs: list[Any], tokens: float, epochs: int = 1, minis: int = 1) -> dict[str, Any]:
        """The loss metrics of this rank's micro-batches over ``epochs`` epochs and ``minis`` mini-batches (whose loss
        shares are of their own mini-batch's loss: averaged), summed like the torch trainer's
        (``add_micro_batch_metrics``; last stage, else empty)."""
        from milehpc.algorithms.api import add_micro_batch_metrics

        sums: dict[str, float] = {}
        diff = {"diff_max": 0.0, "diff_sum": 0.0, "diff_n": 0.0}
        for o in outs:
            add_micro_batch_metrics(sums, o["metrics"], o["tokens"] / max(tokens / self.dp_size, 1.0) * minis,
                                    epochs * minis)
            diff["diff_max"] = max(diff["diff_max"], o.get("diff_max", 0.0))
            diff["diff_sum"] += o.get("diff_sum", 0.0)
            diff["diff_n"] += o.get("diff_n", 0.0)
        return {"sums": sums, **diff}

    # ---- SFT warm-up --------------------------------------------------------------------------------------
    def sft_optimizer(self, lr: float) -> Any:
        """The optimizer of the supervised warm-up: its own Adam state (like the torch trainer's separate AdamW),
        except with the distributed optimizer, whose shards of the main params must stay the only copy."""
        if self.job.trainer.distributed_optimizer:
            return _SftOptimizer(self.optimizer, lr)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from milehpc.train.megatron.chunks import parts

        tr = self.job.trainer
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, weight_decay=tr.weight_decay, adam_beta1=tr.adam_beta1,
                            adam_beta2=tr.adam_beta2, adam_eps=tr.adam_eps, clip_grad=tr.clip_grad,
                            bf16=self.config.bf16, params_dtype=self.config.params_dtype),
            parts(self.ddp),
        )
        return _SftOptimizer(opt, lr)

    def sft_step(self, samples: list[Sample], optimizer: Any) -> dict[str, float]:
        """One supervised step: token-mean NLL of the responses over the global token count."""

        samples = self._replica_samples(samples)
        batch = self._batch(samples)
        (tokens,) = self._dp_sum([batch.num_tokens])
        mbs = self._micro_batches(batch)
        n_mb = len(mbs)

        def loss_func(mb: Batch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            logp, _ = self._logprobs_of(mb, logits)
            loss = -(logp * mb.response_mask).sum() / max(tokens, 1.0) * self.dp_size
            return loss * n_mb, {"loss": float(loss.detach()) / self.dp_size}

        for group in optimizer.opt.param_groups:
            group["lr"] = optimizer.lr
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        optimizer.opt.zero_grad()
        outs = self.run_schedule(mbs, loss_func, forward_only=False)
        ok, norm, _ = optimizer.opt.step()
        total = self._from_last_stage(sum(o["loss"] for o in outs) if outs else 0.0)
        return {"sft/loss": self._dp_sum([total])[0], "sft/grad_norm": float(norm or 0.0)}

    def freeze_reference(self) -> None:
        """Nothing to do: the reference is the initial policy, frozen when the trainer was built (see the module
        doc; the job rules refuse a KL reference after an SFT warm-up)."""

    def skip_step(self) -> None:
        """No rank had samples this step: keep the version schedule."""
        self.version += 1

    # ---- weights -------------------------------------------------------------------------------------------
    def export_weights(self, *, moe_layout: str | None = None, grads: bool = False,
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective over the trainer ranks: this PP stage's weights in HF names on the stage leader (tp=0,
        dp=0); nothing elsewhere. TP shards are gathered over the TP group, experts over the EP group, **one
        parameter at a time as the result is iterated** (issue 33: a list of the whole stage on one GPU did not fit
        a 235B MoE at pp=2): every trainer rank iterates it to the end, in step. ``grads``: the last step's
        gradients (DP-reduced ``main_grad``) in the same names instead, to compare a step with the torch trainer's.
        With LoRA: the adapter alone (and its scaling), in the torch trainer's wire names (:mod:`.lora`).
        ``moe_layout``: an MoE model's HF names (:func:`milehpc.models.moe_names`); unset = the ones the job's
        rollout engine loads (SGLang: per expert)."""
        from milehpc.models import engine_moe_layout

        if self.adapters:
            return iter(self._export_adapter(grads=grads))
        from milehpc.train.megatron.chunks import parts

        layout = moe_layout or engine_moe_layout(self.job.rollout.engine)  # now, not when first iterated
        # Virtual stages: each chunk's layers under their global indices, one after the other.
        return (item for chunk in parts(self.module)
                for item in self.export_module(chunk, self.arch, moe_layout=layout, grads=grads))

    def _export_adapter(self, *, grads: bool) -> list[tuple[str, torch.Tensor]]:
        import torch

        from milehpc.rollout.reference import LORA_SCALING
        from milehpc.train.megatron import lora

        named = lora.export(self.adapters, grads=grads)  # a collective over the TP group: every rank calls it
        if self.tp_rank != 0 or self.dp_rank != 0:
            return []
        spec = self.job.trainer.lora
        # float64: alpha / rank exactly as the Python float peft multiplies by (milehpc.train.lora.export).
        out = [] if grads else [(LORA_SCALING, torch.tensor([spec.alpha / spec.rank], dtype=torch.float64))]
        out += [(n, t.cpu().contiguous()) for n, t in named]
        if not grads:
            self.sync_bytes = sum(t.numel() * t.element_size() for _, t in out)
        return out

    def export_module(self, module: Any, arch: Any, *, moe_layout: str = "transformers", grads: bool = False,
                      raw: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`export_weights` of ``module`` (the policy, the critic) of architecture ``arch``, lazily; the
        parameters named in ``raw`` are held whole on every TP rank and come under their Megatron names (a value
        head), last. A generator: each parameter is gathered when the previous one's HF tensors were taken, so the
        stage leader holds one parameter's gathered parts at a time (an MoE layer's experts in the transformers
        layout, which stacks them), not the stage."""
        from milehpc.train.megatron import convert
        from milehpc.train.megatron.model import expert_offset, layer_offset

        leader = self.tp_rank == 0 and self.dp_rank == 0
        expert_gather = arch.is_moe and self.ps.get_expert_model_parallel_world_size() > 1
        kept: list[tuple[str, torch.Tensor]] = []

        def full() -> Iterator[tuple[str, torch.Tensor]]:
            for name, p in module.named_parameters():
                t = (p.main_grad if grads else p).detach()
                if name in raw:
                    kept.append((name, t))
                    continue
                if ".local_experts." in name:
                    if expert_gather:
                        parts = self._gather(t, self.ps.get_expert_model_parallel_group())
                        local = len(module.decoder.layers[0].mlp.experts.local_experts)
                        idx = int(name.split(".local_experts.")[1].split(".")[0])
                        for r, part in enumerate(parts):
                            yield name.replace(f".local_experts.{idx}.", f".local_experts.{r * local + idx}."), part
                        continue
                    yield name, t  # experts are not TP-split (expert_tensor_parallel_size = 1)
                    continue
                if self.dp_rank != 0:
                    continue
                if convert.tp_dim(name) is not None and self.tp > 1:
                    t = convert.tp_gather(name, self._gather(t, self.ps.get_tensor_model_parallel_group()))
                yield name, t

        if not leader:
            for _ in full():  # the gathers are collectives: take part, keep nothing
                pass
            return
        glob = convert.rename_layers(full(), layer_offset(module), 0 if expert_gather else expert_offset(arch))
        # On the trainer's device, not the host: the SGLang update group is NCCL, which takes CUDA tensors only
        # (issue 30, fault 1), and the other consumers copy where they need (a host snapshot, the sync's buckets).
        for n, t in convert.to_hf(glob, arch, moe_layout=moe_layout):
            yield n, t.contiguous()
        for n, t in kept:
            yield n, t.contiguous()

    @staticmethod
    def _gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return parts

    # ---- checkpoint ----------------------------------------------------------------------------------------
    # Set by from_context to <checkpoint dir>/megatron: checkpoints then go through dist_checkpointing (resharding).
    dist_checkpoint_root: Any = None

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """Collective over the trainer ranks. With a checkpoint root: model and optimizer go into a
        dist_checkpointing directory (``v<steps>``, resumable at another TP/PP/DP layout) and this rank's state
        only references it; without one: this rank's shard as trained (same layout only). With LoRA: the full
        adapter in peft names (what ``milehpc export --adapter`` reads) and this rank's optimizer state, with or
        without a root (same layout only). All resume bit-exactly."""
        import torch

        from milehpc.train.megatron import checkpoint

        state: dict[str, Any] = {"version": self.version, "steps": self.steps, "rng_tracker": _tracker_states()}
        if self.adapters:  # adapter-only, per rank: the frozen base is rebuilt from its source, never written
            from milehpc.train import lora as peft_lora
            from milehpc.train.megatron import lora

            state["model"] = lora.checkpoint_state(self.adapters, source=peft_lora.base_source(self.job),
                                                   base_fingerprint=self.base_fingerprint)
            state["optimizer"] = self.optimizer.state_dict()
            state["lora_layout"] = [self.tp, self.pp, self.dp_size]
            if self.critic is not None:
                state.update(self.critic.local_state())
            return state
        if self.dist_checkpoint_root is not None:
            from pathlib import Path

            root = Path(self.dist_checkpoint_root)
            path = checkpoint.save(self, root / f"v{self.steps:08d}")
            if torch.distributed.get_rank() == 0:
                # The newest `keep` milehpc checkpoints reference at most `keep` of these, plus the one being
                # written; older ones are unreferenced.
                checkpoint.prune(root, self.job.checkpoint.keep + 1)
            state["dist_checkpoint"] = str(path)
            return state
        state["model"] = {k: v for k, v in self.ddp.state_dict().items() if not k.endswith("_extra_state")}
        state["optimizer"] = self.optimizer.state_dict()
        if self.critic is not None:
            state.update(self.critic.local_state())
        return state

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:

        from milehpc.train.megatron import checkpoint

        # Set by LoopCheckpoint when the checkpoint was written at another TP/PP/DP layout: ``state`` is then trainer
        # rank 0's (version, steps, dist checkpoint path); model and optimizer are resharded by dist_checkpointing.
        resharded = bool(state.get("resharded"))
        if ("lora_layout" in state) != bool(self.adapters):
            raise ConfigError(f"this checkpoint was written {'with' if 'lora_layout' in state else 'without'} "
                              f"[trainer.lora]: expected the job to {'keep' if 'lora_layout' in state else 'leave out'}"
                              " [trainer.lora] to resume it", field="trainer.lora")
        if self.adapters:
            self._load_lora_state(state)
        elif "dist_checkpoint" in state:
            checkpoint.load(self, state["dist_checkpoint"])
        elif resharded:
            raise ConfigError("this Megatron checkpoint holds per-rank shards (it was written without a checkpoint "
                              "directory), which load only at the layout that wrote them; resume with that "
                              "trainer.tp/pp/dp", field="trainer")
        else:
            self.ddp.load_state_dict(state["model"], strict=False)
            self.optimizer.load_state_dict(state["optimizer"])
            if self.critic is not None:
                self.critic.load_local_state(state)
        self.version, self.steps = int(state["version"]), int(state["steps"])
        if resharded:
            # The RNG tracker's streams belong to a TP rank of the old layout: keep the ones seeded for this
            # layout at start-up (dropout is 0 here, so training does not draw from them anyway).
            return
        _set_tracker_states(state.get("rng_tracker"))

    def _load_lora_state(self, state: dict[str, Any]) -> None:
        """Adapter (this rank's shards of the full one), optimizer and critic of a LoRA checkpoint; its optimizer state
        is per rank, so only the layout that wrote it resumes it."""
        from milehpc.train.megatron import lora

        layout = [self.tp, self.pp, self.dp_size]
        if state.get("resharded") or state.get("lora_layout") != layout:
            raise ConfigError(f"a Megatron LoRA checkpoint resumes at the layout that wrote it: expected trainer "
                              f"tp, pp, dp = {state.get('lora_layout')}, got {layout}", field="trainer")
        lora.load_checkpoint_state(self.adapters, state["model"], base_fingerprint=self.base_fingerprint,
                                   tp_rank=self.tp_rank)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.critic is not None:
            self.critic.load_local_state(state)


def _unpacked_loss(loss_func: Any, mb: Batch, pk: Any, logits: torch.Tensor) -> Any:
    """The loss on packed logits ``[1, L, V/tp]``, read back into the micro-batch's padded layout."""
    from milehpc.train.megatron import packing

    return loss_func(mb, packing.unpack(logits, pk))


class _SftOptimizer:
    """The loop's handle on the warm-up optimizer: a Megatron optimizer and its learning rate."""

    def __init__(self, opt: Any, lr: float) -> None:
        self.opt, self.lr = opt, lr


def _tracker_states() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    return dict(tensor_parallel.get_cuda_rng_tracker().get_states())


def _set_tracker_states(states: dict[str, Any] | None) -> None:
    from megatron.core import tensor_parallel

    if states:
        tensor_parallel.get_cuda_rng_tracker().set_states(dict(states))


def from_context(ctx: RunContext) -> MegatronTrainer:
    """Trainer factory (``impl(ctx)``) for ``trainer.backend = "megatron"``."""
    import dataclasses

    from milehpc import plugins
    from milehpc.config.schema import merge_params
    from milehpc.data.tokenizer import build_tokenizer

    job = ctx.job
    spec = plugins.lookup("trainer", job.trainer.backend)
    options = merge_params(spec.defaults, job.trainer.options)  # checked on the login node
    job = dataclasses.replace(job, trainer=dataclasses.replace(job.trainer, options=options))
    tok = build_tokenizer(job.model.tokenizer)
    trainer = MegatronTrainer(job, pad_id=tok.pad_id, vocab_size=tok.vocab_size, eos_id=tok.eos_id)
    run_dir = ctx.run_dir
    if run_dir is not None:
        from milehpc.checkpoint import checkpoint_root

        trainer.dist_checkpoint_root = checkpoint_root(job, run_dir) / "megatron"
    return trainer

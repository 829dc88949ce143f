"""The reference trainer: HF-architecture models in plain PyTorch, data parallel over the default process group
(gloo on CPU, NCCL on GPUs) with DDP, or FSDP2 (``fully_shard``) with ``trainer.options.fsdp = true``.

One ``train_step`` = one optimizer step over this DP rank's share of the batch (or one per mini-batch with
``trainer.mini_batch_size``): micro-batches (of ``micro_batch_size`` rows, or by token budget:
:mod:`milehpc.train.micro_batches`) with gradient accumulation (DDP syncs only on the last), clipping, AdamW, an LR
schedule. The logprobs and entropy that the metrics report come from the very forward pass that the loss uses
(:meth:`TorchTrainer.forward`), so the train–inference comparison measures what the loss sees. A frozen reference
copy (KL) and a critic (PPO+GAE) are built when the algorithm asks for them.

With ``[trainer.lora]`` the policy is a peft model over a frozen base (:mod:`milehpc.train.lora`): the optimizer, the
checkpoint and the weight sync hold the adapter alone; the SFT warm-up trains the adapter too, so the base stays
the one its source builds (no full sync, no base in any checkpoint).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from milehpc.algorithms.api import add_micro_batch_metrics
from milehpc.builtin.trainers import TORCH_TRAINER_OPTIONS
from milehpc.data.images import IMAGES_KEY
from milehpc.faults import maybe_fail
from milehpc.models import engine_moe_layout, moe_names
from milehpc.models_vl import vision_parameter
from milehpc.samples import Sample
from milehpc.train import micro_batches as cut

if TYPE_CHECKING:
    import torch

    from milehpc.comm.context import RunContext
    from milehpc.config.job import JobSpec
    from milehpc.samples.batch import Batch


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step ``step``: linear warm-up, then constant/cosine/linear to
    ``min_ratio``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


def _dist() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Reduce a few floats over the DP group (the default process group = the trainer ranks)."""
    from milehpc.comm.collectives import reduce_floats

    if _dist()[1] == 1:
        return values
    # On the default group's device: NCCL refuses CPU tensors (issue 12, fault 8).
    return reduce_floats(values, op)


def _dp_sum_tensor(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over the DP group (batch whitening over the whole step, not one rank's share)."""
    import torch.distributed as dist

    out = t.clone()
    dist.all_reduce(out)
    return out


class TorchTrainer:
    """Implements :class:`milehpc.train.base.Trainer` for HF causal LMs."""

    def __init__(self, job: JobSpec, tokenizer: Any, *, device: Any = "cpu", algorithm: Any = None,
                 options: dict[str, Any] | None = None, model: Any = None) -> None:
        import torch

        from milehpc.models import build_model

        self.job, self.tokenizer = job, tokenizer
        self.options = {**TORCH_TRAINER_OPTIONS, **(options or {})}
        self.device = torch.device(device)
        self.rank, self.dp_size = _dist()
        self.pad_id = int(tokenizer.pad_id)
        t = job.rollout.temperature
        self.temperature = t if t > 0 else 1.0
        if algorithm is None:
            from milehpc.algorithms.api import Algorithm

            algorithm = Algorithm.from_job(job)
        self.algorithm = algorithm
        spec = job.model
        # Same seed on every rank: DP replicas (and the rollout engines) start from identical weights.
        self.module = (model if model is not None else
                       build_model(spec, tokenizer.vocab_size, seed=job.run.seed, pad_id=self.pad_id,
                                   eos_id=tokenizer.eos_id)).to(self.device)
        # A vision-language model: its processor's folder (pixels for the forward); the vision tower frozen with
        # model.freeze_vision = true (out of the optimizer, and the weight sync sends the LM alone).
        self.vision_folder: str | None = None
        self.freeze_vision = False
        from milehpc.models_vl import is_vision_model

        if is_vision_model(self.module):
            from milehpc.data.images import tokenizer_folder
            from milehpc.data.source import register_images

            self.vision_folder = tokenizer_folder(tokenizer)
            register_images(job.data)  # the samples carry image references: their bytes come from the prompt files
            self.freeze_vision = bool(spec.freeze_vision)
            for name, p in self.module.named_parameters():
                if self.freeze_vision and vision_parameter(name):
                    p.requires_grad_(False)
        # What a full-model sync would move: the LoRA runs report it beside the adapter's bytes.
        self.full_model_bytes = sum(t.numel() * t.element_size() for t in self.module.state_dict().values())
        self.sync_bytes = 0  # of the last export_weights
        self.lora = job.trainer.lora
        if self.lora is not None:
            from milehpc.train import lora

            self.base_fingerprint = lora.fingerprint(self.module)
            self.module = lora.attach(self.module, self.lora, seed=job.run.seed)
            if self.lora.dropout > 0:
                # peft's dropout draws from the process RNG, which nothing seeded before: seed it, so a rerun draws
                # the same masks (a resume then restores the checkpoint's stream).
                torch.manual_seed((job.run.seed * 1_000_003 + self.rank) % 2**63)
        # Multi-LoRA over DP: no DDP hooks (each adapter's backward leaves the others' gradients unset); the active
        # adapter's gradients are all-reduced by hand before clipping (milehpc.train.multi_lora.all_reduce_grads).
        self.manual_grad_sync = self.lora is not None and bool(self.lora.adapters) and self.dp_size > 1
        self.model = self.module if self.manual_grad_sync else self._wrap(self.module)
        # FSDP2 shards the weights: gathering them for the weight sync is a collective over all trainer ranks.
        self.export_is_collective = bool(self.options["fsdp"]) and self.dp_size > 1
        # Multi-LoRA ([trainer.lora.adapters]): one optimizer and LR schedule per adapter, over that adapter alone.
        self.adapters: list[str] = list(self.lora.adapters) if self.lora is not None else []
        self.optimizers: dict[str, Any] = {}
        self.schedulers: dict[str, Any] = {}
        self.adapter_sync_bytes: dict[str, int] = {}  # of the last export_weights, per adapter
        if self.adapters:
            from milehpc.train.multi_lora import adapter_optimizers

            self.optimizers, self.schedulers = adapter_optimizers(self)
            self.optimizer = self.scheduler = None
        else:
            self.optimizer = self._adamw(self._trainable(self.model), job.trainer.lr)
            self.scheduler = self._schedule(self.optimizer, job.trainer.lr)
        self.ref: Any = None
        self.critic = self.critic_module = self.critic_opt = None
        if algorithm.needs_critic:
            self.critic_module = build_model(spec, tokenizer.vocab_size, seed=job.run.seed + 1, pad_id=self.pad_id,
                                             eos_id=tokenizer.eos_id, value_head=True).to(self.device)
            self.critic = self._wrap(self.critic_module)
            self.critic_opt = self._adamw(self.critic.parameters(), float(self.options["critic_lr"]))
        # FSDP over several ranks without a reference or critic, a teacher_path for distillation: the job rules
        # refused anything else on the login node (milehpc.config.rules).
        self.teacher: Any = None
        if algorithm.needs_teacher:
            from dataclasses import replace

            self.teacher = build_model(replace(spec, path=self.options["teacher_path"]), tokenizer.vocab_size)
            self.teacher = self.teacher.to(self.device).eval().requires_grad_(False)
        self.version = 0  # weight version: number of optimizer steps taken since RL began
        self.steps = 0

    # ---- construction helpers ----------------------------------------------
    def _wrap(self, module: Any) -> Any:
        if self.dp_size == 1:
            return module
        if self.options["fsdp"]:
            from torch.distributed.fsdp import fully_shard

            for layer in module.model.layers:
                fully_shard(layer)
            return fully_shard(module)
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, device_ids=None if self.device.type == "cpu" else [self.device])

    @staticmethod
    def _trainable(model: Any) -> list[Any]:
        """The parameters an optimizer owns: a LoRA run's frozen base stays out of its state."""
        return [p for p in model.parameters() if p.requires_grad]

    def _adamw(self, params: Iterable[Any], lr: float, weight_decay: float | None = None) -> Any:
        import torch

        tr = self.job.trainer
        return torch.optim.AdamW(params, lr=lr, betas=(tr.adam_beta1, tr.adam_beta2), eps=tr.adam_eps,
                                 weight_decay=tr.weight_decay if weight_decay is None else weight_decay)

    def _schedule(self, optimizer: Any, peak: float) -> Any:
        import torch

        tr = self.job.trainer
        min_ratio = tr.min_lr / peak if peak else 0.0
        total = math.ceil(self.job.run.steps / 1)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
            s, warmup=tr.warmup_steps, total=total, schedule=tr.lr_schedule, min_ratio=min_ratio))

    # ---- forward (the one code path for loss, metrics and logprob checks) --------------------
    def forward(self, model: Any, batch: Batch, *, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[B, R]`` logprobs of the response tokens (at the rollout temperature) and optionally entropy."""
        if self.vision_folder is not None:  # pixels and 3-D positions of the rows' images (milehpc.models_vl)
            from milehpc.data.images import rows_pixels
            from milehpc.models_vl import vision_inputs

            shown = rows_pixels(self.vision_folder, [list(s.metadata.get(IMAGES_KEY) or []) for s in batch.samples])
            kw = vision_inputs(self.module, batch.input_ids, batch.attention_mask, shown)
            logits = model(input_ids=None, attention_mask=batch.attention_mask, use_cache=False, **kw).logits
        else:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids, use_cache=False).logits
        logp = batch.response_logprobs(logits, self.temperature)
        ent = batch.response_entropy(logits, self.temperature) if entropy else None
        return logp, ent

    def values(self, batch: Batch) -> torch.Tensor:
        """``[B, R]`` critic values at the positions that predict each response token."""
        out = self.critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          position_ids=batch.position_ids).logits[..., 0]
        return batch.response_logits(out.unsqueeze(-1))[..., 0]

    def _batch(self, samples: list[Sample]) -> Batch:
        from milehpc.samples.batch import to_batch

        return to_batch(samples, self.pad_id).to(self.device)

    def micro_batches(self, batch: Batch) -> list[tuple[list[int], Batch]]:
        """(rows, micro-batch) pairs of ``batch``: ``micro_batch_size`` rows, or bins of the token budget."""
        tr = self.job.trainer
        return cut.micro_batches(batch, size=tr.micro_batch_size, max_tokens=tr.max_tokens_per_micro_batch)

    def _rows(self, batch: Batch, fn: Any) -> torch.Tensor:
        """``[B, R]``: ``fn(micro-batch)`` (``[b, r]``) of every micro-batch, back at its rows."""
        import torch

        parts = [(rows, fn(mb)) for rows, mb in self.micro_batches(batch)]
        if not self.job.trainer.max_tokens_per_micro_batch:
            return torch.cat([p for _, p in parts])  # the plain path: consecutive untrimmed rows, as always
        return cut.assemble(parts, batch.response_mask)

    def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The policy's logprobs of each sample's response tokens; several adapters: each with its own adapter."""
        if self.adapters:
            from milehpc.train.multi_lora import split_by_adapter

            by_sample = {}
            for name, part in split_by_adapter(samples, self.adapters).items():
                if part:
                    self.module.base_model.set_adapter(name)
                    by_sample.update(zip(map(id, part), self._logprobs(part), strict=True))
            return [by_sample[id(s)] for s in samples]
        return self._logprobs(samples)

    def _logprobs(self, samples: list[Sample]) -> list[list[float]]:
        import torch

        batch = self._batch(samples)
        out: list[list[float]] = []
        with torch.no_grad():
            rows = self._rows(batch, lambda mb: self.forward(self.module, mb)[0])
        for row, n in zip(rows.tolist(), batch.response_lengths.tolist(), strict=True):
            out.append(row[: int(n)])
        return out

    # ---- reference model ---------------------------------------------------
    def freeze_reference(self) -> None:
        """Snapshot the current policy as the KL reference (called when RL begins, after any SFT warm-up)."""
        if self.algorithm.needs_ref and self.ref is None:
            self.ref = copy.deepcopy(self.module).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)

    # ---- SFT warm-up ---------------------------------------------------------
    def sft_optimizer(self, lr: float) -> Any:
        """A fresh AdamW over the policy for the warm-up (its moments do not carry into RL); several adapters: one
        per adapter, by name."""
        if self.adapters:
            from milehpc.train.multi_lora import adapter_adamw

            return {a: adapter_adamw(self, a, lr) for a in self.adapters}
        return self._adamw(self._trainable(self.model), lr)

    def sft_step(self, samples: list[Sample], optimizer: Any) -> dict[str, float]:
        """One supervised step (token-mean NLL over the response, global over DP) on labelled samples; several
        adapters: each adapter's samples step that adapter (:mod:`milehpc.train.multi_lora`)."""
        if self.adapters:
            from milehpc.train.multi_lora import per_adapter

            return per_adapter(self, samples, lambda part, a: self._sft_update(part, optimizer[a]))
        return self._sft_update(samples, optimizer)

    def _sft_update(self, samples: list[Sample], optimizer: Any) -> dict[str, float]:
        batch = self._batch(samples)
        tokens = _all_reduce([batch.num_tokens])[0]
        self.model.train()
        total = 0.0
        mbs = [mb for _, mb in self.micro_batches(batch)]
        for i, mb in enumerate(mbs):
            with self._no_sync(self.model, last=i == len(mbs) - 1):
                logp, _ = self.forward(self.model, mb)
                loss = -(logp * mb.response_mask).sum() / max(tokens, 1.0) * self.dp_size
                loss.backward()
            total += float(loss.detach()) / self.dp_size
        grad_norm = self._clip(self.model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"sft/loss": _all_reduce([total])[0], "sft/grad_norm": grad_norm}

    # ---- RL step -------------------------------------------------------------
    def _no_sync(self, model: Any, *, last: bool) -> Any:
        import contextlib

        if last or model is None or not hasattr(model, "no_sync"):
            return contextlib.nullcontext()
        return model.no_sync()

    def _clip(self, model: Any) -> float:
        import torch

        if self.manual_grad_sync and model is self.model:
            from milehpc.train.multi_lora import all_reduce_grads

            all_reduce_grads([p for p in model.parameters() if p.requires_grad], self.dp_size)
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.job.trainer.clip_grad or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2 returns a DTensor
            norm = norm.full_tensor()
        return float(norm)

    def _prepare(self, batch: Batch, *, old_logprobs: bool = False) -> dict[str, float]:
        """No-grad passes before the update: reference logprobs, critic values, then advantages."""
        import torch

        with torch.no_grad():
            if self.ref is not None:
                batch.ref_logprobs = self._rows(batch, lambda mb: self.forward(self.ref, mb)[0])
            if self.teacher is not None:
                batch.teacher_logprobs = self._rows(batch, lambda mb: self.forward(self.teacher, mb)[0])
            if self.critic is not None:
                batch.values = self._rows(batch, self.values)
            # With one epoch and one mini-batch the loss's own forward gives the old logprobs (ratio = 1 exactly,
            # as nothing changed before the optimizer step); more epochs or mini-batches need them fixed before the
            # first update (PPO's old policy: the one that the whole batch's advantages are for).
            if self.algorithm.needs_old_logprobs or old_logprobs:
                batch.old_logprobs = self._rows(batch, lambda mb: self.forward(self.module, mb)[0])
        return self.algorithm.compute_advantages(batch, dp_sum=_dp_sum_tensor if _dist()[1] > 1 else None) or {}

    def train_step(self, samples: list[Sample], step: int) -> dict[str, float]:
        if self.adapters:  # each adapter's samples step that adapter's optimizer alone
            from milehpc.train.multi_lora import count_skipped_step, per_adapter

            out = per_adapter(self, samples, lambda part, a: self._update(part, self.optimizers[a], self.schedulers[a]),
                              skipped=lambda a: count_skipped_step(self.schedulers[a]))
        else:
            out = self._update(samples, self.optimizer, self.scheduler)
        self.version += 1
        self.steps += 1
        if self.lora is not None:  # bytes the last weight sync moved, and what a full-model sync would have
            out["sync/bytes"] = float(self.sync_bytes)
            out["sync/full_model_bytes"] = float(self.full_model_bytes)
            for a, n in self.adapter_sync_bytes.items():
                out[f"adapter/{a}/sync_bytes"] = float(n)
        return out

    def _mini_batch_count(self, batch: Batch) -> int:
        """Optimizer steps this train step takes: the job's mini-batches, no more than any DP rank has samples."""
        fewest = (lambda: int(-_all_reduce([-float(batch.size)], "max")[0])) if self.dp_size > 1 else None
        return cut.rank_mini_batch_count(self.job, batch.size, fewest)

    def _update(self, samples: list[Sample], optimizer: Any, scheduler: Any) -> dict[str, float]:
        """One optimizer step of ``optimizer`` (and its ``scheduler``) over ``samples`` per mini-batch and epoch; the
        step's metrics (means over the mini-batches and epochs)."""
        import torch

        t0 = time.perf_counter()
        batch = self._batch(samples)
        self.model.train()
        minis = self._mini_batch_count(batch)
        adv_metrics = self._prepare(batch, old_logprobs=minis > 1)
        t_prepared = time.perf_counter()  # the batch, the no-grad logprob/value passes, the advantages
        t_optim = 0.0
        tokens, seqs = _all_reduce([batch.num_tokens, batch.num_seqs])
        sums: dict[str, float] = {}
        diff_max, diff_sum, diff_n = 0.0, 0.0, 0.0
        grad_norm = 0.0
        # Per mini-batch: its global counts (what its loss is normalised by) and its micro-batches.
        steps = []
        for part in cut.mini_batches(batch, minis):
            counts = (tokens, seqs) if minis == 1 else _all_reduce([part.num_tokens, part.num_seqs])
            mbs = [mb for _, mb in self.micro_batches(part)]
            n_mbs = len(mbs)
            if self.export_is_collective:
                # FSDP2 gathers weights in every forward: all ranks must run as many micro-batches (a rank with
                # fewer repeats its first one with a zero weight).
                n_mbs = int(_all_reduce([float(len(mbs))], "max")[0])
            steps.append((counts, mbs, n_mbs))
        epochs = self.job.algorithm.ppo_epochs
        for epoch in range(epochs):
            for (mini_tokens, mini_seqs), mbs, n_mbs in steps:
                for i in range(n_mbs):
                    mb, scale = (mbs[i], 1.0) if i < len(mbs) else (mbs[0], 0.0)
                    last = i == n_mbs - 1
                    with self._no_sync(self.model, last=last), self._no_sync(self.critic, last=last):
                        logp, ent = self.forward(self.model, mb, entropy=True)
                        values = self.values(mb) if self.critic is not None else None
                        loss, metrics = self.algorithm.loss(logp, mb, entropy=ent, values=values,
                                                            global_tokens=mini_tokens, global_seqs=mini_seqs,
                                                            dp_size=self.dp_size)
                        (loss * scale).backward()
                    if scale == 0.0:
                        continue
                    # Loss shares are of their mini-batch's loss: averaged over the mini-batches (and epochs).
                    add_micro_batch_metrics(sums, metrics, mb.num_tokens / max(tokens / self.dp_size, 1.0) * minis,
                                            epochs * minis)
                    if epoch == 0 and mb.rollout_logprobs is not None:
                        # Train–inference mismatch on tokens sampled by the very weights we hold now (the first
                        # mini-batch's alone still hold them).
                        fresh = torch.tensor([s.weight_version == self.version for s in mb.samples],
                                             dtype=torch.bool, device=self.device)
                        m = mb.response_mask.bool() & fresh[:, None]
                        if m.any() and (minis == 1 or mbs is steps[0][1]):
                            d = (logp.detach() - mb.rollout_logprobs).abs()[m]
                            diff_max = max(diff_max, float(d.max()))
                            diff_sum, diff_n = diff_sum + float(d.sum()), diff_n + float(d.numel())
                if self.dp_size > 1:
                    # A rank whose micro-batches had no tokens (a multi-LoRA stand-in) has no extremes: neutral ones,
                    # so every rank reduces the same keys.
                    sums.update({k: -math.inf if k.endswith("max") else math.inf for k in metrics
                                 if k.endswith(("max", "min")) and k not in sums})
                t1 = time.perf_counter()
                grad_norm = self._clip(self.model)
                maybe_fail("optimizer", self.steps)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if self.critic is not None:
                    critic_norm = self._clip(self.critic)
                    self.critic_opt.step()
                    self.critic_opt.zero_grad(set_to_none=True)
                t_optim += time.perf_counter() - t1
        t_updated = time.perf_counter()
        scheduler.step()
        from milehpc.comm.collectives import combine_rank_metrics

        out = {f"train/{k}": v for k, v in combine_rank_metrics(sums, self.dp_size).items()}
        diff_sum, diff_n = _all_reduce([diff_sum, diff_n])
        out.update({f"train/{k}": v for k, v in combine_rank_metrics(adv_metrics, _dist()[1]).items()})
        out["train/grad_norm"] = grad_norm
        if self.critic is not None:
            out["critic/grad_norm"] = critic_norm
        out["train/lr"] = scheduler.get_last_lr()[0]
        out["train/tokens"] = tokens
        if diff_n > 0:
            out["train/logprob_diff_mean"] = diff_sum / diff_n
            out["train/logprob_diff_max"] = _all_reduce([diff_max], "max")[0]
        out["time/train_compute"] = time.perf_counter() - t0
        # Where the step's compute went (bench/async_loop.py --profile): fwd_bwd includes the logprob diagnostics.
        out["time/train_prepare"] = t_prepared - t0
        out["time/train_fwd_bwd"] = t_updated - t_prepared - t_optim
        out["time/train_optim"] = t_optim
        return out

    def skip_step(self) -> None:
        """No rank had samples this step: keep the version schedule."""
        self.version += 1

    # ---- weights and state -------------------------------------------------
    def export_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Full weights in HF naming (with LoRA: the adapter alone, :func:`milehpc.train.lora.export`); with FSDP2
        every rank must call this (it gathers). With FSDP2 on separate rollout ranks only the weight-sync source
        (trainer rank 0) needs the whole tensors: each is gathered onto it alone and the other ranks yield nothing
        (they hold no more than their shard); colocated, every rank's engine takes them, so every rank gathers all."""
        self.sync_bytes = 0
        if self.adapters:
            from milehpc.train.multi_lora import export_adapters

            yield from export_adapters(self)
            return
        if self.lora is not None:
            from milehpc.train import lora

            named: Iterable[tuple[str, Any]] = lora.export(self.module, self.lora)
        else:
            named = self.module.state_dict().items()
        # In the names the job's engine loads: SGLang wants an MoE model's experts one by one (milehpc.models).
        layout = engine_moe_layout(self.job.rollout.engine)
        model_type = getattr(getattr(self.module, "config", None), "model_type", "")
        everywhere = self.job.resources.colocate
        # A tied lm_head is the embedding again (+27% bytes at Qwen2.5-0.5B's shape): the engines tie it themselves
        # (the reference engine's model shares one storage; SGLang's load_weights skips it or copies the embedding).
        tied = bool(getattr(getattr(self.module, "config", None), "tie_word_embeddings", False))
        for name, tensor in named:
            if tied and name == "lm_head.weight":
                continue
            if self.freeze_vision and vision_parameter(name):
                continue  # the engine's vision tower is the one it loaded, as the trainer's
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor() if everywhere else gather_to_first(tensor)
                if tensor is None:
                    continue
            self.sync_bytes += tensor.numel() * tensor.element_size()
            yield from moe_names(name, tensor.detach(), model_type, layout)

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """Model, optimizer, scheduler, critic and reference; the process RNG is the checkpoint's own."""
        state = {"model": self._model_state(self.module), "version": self.version, "steps": self.steps}
        if self.adapters:  # each adapter's optimizer and schedule (the adapters themselves are in "model")
            state["optimizers"] = {a: o.state_dict() for a, o in self.optimizers.items()}
            state["schedulers"] = {a: s.state_dict() for a, s in self.schedulers.items()}
        else:
            state["optimizer"], state["scheduler"] = self.optimizer.state_dict(), self.scheduler.state_dict()
        if self.critic is not None:
            state["critic"] = self.critic_module.state_dict()
            state["critic_optimizer"] = self.critic_opt.state_dict()
        if self.ref is not None:
            state["ref"] = self._model_state(self.ref)
        return state

    def _model_state(self, module: Any) -> dict[str, Any]:
        """The policy's (or reference's) weights; with LoRA the adapter and the base's source, never the base."""
        if self.lora is None:
            return module.state_dict()
        from milehpc.train import lora

        return lora.checkpoint_state(module, source=lora.base_source(self.job), base_fingerprint=self.base_fingerprint,
                                     adapters=self.adapters or None)

    def _load_model_state(self, module: Any, state: dict[str, Any]) -> None:
        if self.lora is None:
            module.load_state_dict(state)
            return
        from milehpc.train import lora

        lora.load_checkpoint_state(module, state, base_fingerprint=self.base_fingerprint,
                                   adapters=self.adapters or None)

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self._load_model_state(self.module, state["model"])
        if self.adapters:
            from milehpc.train.multi_lora import load_adapter_optimizers

            load_adapter_optimizers(self, state)
        else:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        self.version, self.steps = int(state["version"]), int(state["steps"])
        if self.critic is not None and "critic" in state:
            self.critic_module.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_optimizer"])
        if "ref" in state:
            self.freeze_reference()
            if self.ref is not None:
                self._load_model_state(self.ref, state["ref"])



def gather_to_first(t: Any) -> torch.Tensor | None:
    """The whole of a sharded DTensor (FSDP2) on the first rank of its mesh, None on the others: a gather, not an
    all-gather, so the other ranks never hold the full tensor. FSDP2 shards dim 0 as ``torch.chunk`` does (the
    last ranks may hold fewer rows, or none): each shard is padded to the chunk size for the gather and the pad cut
    off. Another layout falls back to ``full_tensor`` (an all-gather), kept on the first rank only."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    mesh = t.device_mesh
    group = mesh.get_group() if mesh.ndim == 1 else None
    first = group is not None and dist.get_rank(group) == 0
    if group is None or len(t.placements) != 1 or t.placements[0] != Shard(0):
        full = t.full_tensor()
        return full if (group is None or first) else None
    size, rows = dist.get_world_size(group), t.shape[0]
    chunk = -(-rows // size)
    local = t.to_local()
    padded = local.new_zeros((chunk, *t.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    parts = [torch.empty_like(padded) for _ in range(size)] if first else None
    dist.gather(padded, parts, group=group, group_dst=0)
    return torch.cat(parts)[:rows] if parts is not None else None


def from_context(ctx: RunContext) -> TorchTrainer:
    """Trainer factory (``impl(ctx)``): the job's model on this rank's device, DP over the trainer group."""
    from milehpc import plugins
    from milehpc.config.schema import merge_params
    from milehpc.data.tokenizer import build_tokenizer

    job = ctx.job
    spec = plugins.lookup("trainer", job.trainer.backend)
    options = merge_params(spec.defaults, job.trainer.options)  # checked on the login node
    device = ctx.comms.device or "cpu"
    return TorchTrainer(job, build_tokenizer(job.model.tokenizer), device=device, options=options)

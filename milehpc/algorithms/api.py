"""The algorithm a job spec's ``[algorithm]`` table selects: an advantage estimator and a policy loss (both
plugins, by name, with validated params) plus the KL, entropy, critic and off-policy terms around them.

Typical use on a trainer rank (one optimizer step, any number of micro-batches and DP ranks)::

    algo = Algorithm.from_job(job)
    metrics = algo.compute_advantages(batch)           # fills batch.advantages / batch.returns
    tokens = allreduce_sum(batch.num_tokens)            # global counts of the whole step
    seqs = allreduce_sum(batch.num_seqs)
    for mb in batch.split(micro_batch_size):
        logits = model(mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids).logits
        loss, m = algo.loss(mb.response_logprobs(logits), mb, entropy=mb.response_entropy(logits),
                            global_tokens=tokens, global_seqs=seqs, dp_size=dp)
        loss.backward()                                 # sum over micro-batches; DDP averages over ranks
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from milehpc.algorithms.aggregation import Aggregator, dp_statistics, masked_mean
from milehpc.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from milehpc.config.job import AlgorithmSpec, JobSpec
    from milehpc.samples.batch import Batch

# Estimator params that default to the [algorithm] table's own fields when the plugin declares them.
_SHARED_PARAMS = ("gamma", "lam")


def _resolve(kind: str, name: str, params: dict[str, Any], *, file: str | None, field_name: str,
             ) -> tuple[Any, Callable[..., Any], dict[str, Any]]:
    from milehpc import plugins
    from milehpc.config.schema import check_params

    spec = plugins.lookup(kind, name, file=file, field=f"algorithm.{field_name}")
    plugins.check_requires(spec, f"{kind} '{name}'")
    values = check_params(spec, params, file=file, prefix=f"algorithm.{field_name}_params")
    return spec, spec.load(), values


def _check_range(params: dict[str, Any], key: str, ok: Callable[[float], bool], expect: str, *,
                 file: str | None, prefix: str) -> None:
    if key in params and params[key] is not None and not ok(params[key]):
        raise ConfigError(f"expected {expect}, got {params[key]!r}", file=file, field=f"{prefix}.{key}")


@dataclass
class Algorithm:
    """Advantage estimator + policy loss + KL / entropy / value / off-policy terms (see the module doc)."""

    spec: AlgorithmSpec
    advantage_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    advantage_params: dict[str, Any]
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, float]]]
    loss_params: dict[str, Any]
    needs_critic: bool = False
    needs_teacher: bool = False
    horizon: float | None = None
    names: dict[str, str] = field(default_factory=dict)
    max_response_len: int | None = None  # rollout.max_new_tokens: the soft overlong penalty's maximal length

    @property
    def needs_ref(self) -> bool:
        """A reference policy's logprobs are needed (``batch.ref_logprobs``) when a KL term is on."""
        return self.spec.kl_coef > 0

    @property
    def needs_old_logprobs(self) -> bool:
        """More than one optimizer pass per batch needs the pre-update logprobs recomputed by the trainer."""
        return self.spec.ppo_epochs > 1

    @classmethod
    def from_spec(cls, spec: AlgorithmSpec, file: str | None = None, *, horizon: int | None = None) -> Algorithm:
        """Look up and validate the plugins named by ``spec`` (unknown names and bad params are one-line
        :class:`~milehpc.errors.PluginError` / :class:`~milehpc.errors.ConfigError`). ``horizon`` is the
        seq-mean-token-sum-norm divisor when ``spec.loss_agg_horizon`` is 0 (pass rollout.max_new_tokens)."""
        adv_params = dict(spec.advantage_params)
        adv_entry, adv_fn, adv_values = _resolve("advantage", spec.advantage, adv_params, file=file,
                                                 field_name="advantage")
        for key in _SHARED_PARAMS:
            if key in adv_entry.defaults and key not in adv_params:
                adv_values[key] = getattr(spec, key)
        _, loss_fn, loss_values = _resolve("loss", spec.loss, dict(spec.loss_params), file=file,
                                           field_name="loss")
        prefix = "algorithm.loss_params"
        _check_range(loss_values, "clip_low", lambda v: 0 <= v < 1, "a value in [0, 1)", file=file, prefix=prefix)
        _check_range(loss_values, "clip_high", lambda v: v >= 0, "a value >= 0", file=file, prefix=prefix)
        _check_range(loss_values, "clip_ratio_c", lambda v: v == 0 or v > 1, "0 (off) or a value > 1",
                     file=file, prefix=prefix)
        _check_range(adv_values, "epsilon", lambda v: v >= 0, "a value >= 0", file=file,
                     prefix="algorithm.advantage_params")
        return cls(
            spec=spec, advantage_fn=adv_fn, advantage_params=adv_values, loss_fn=loss_fn, loss_params=loss_values,
            needs_critic=adv_entry.needs_critic,
            needs_teacher=adv_entry.needs_teacher,
            horizon=float(spec.loss_agg_horizon or horizon) if (spec.loss_agg_horizon or horizon) else None,
            names={"advantage": spec.advantage, "loss": spec.loss},
            max_response_len=horizon,
        )

    @classmethod
    def from_job(cls, job: JobSpec, file: str | None = None) -> Algorithm:
        return cls.from_spec(job.algorithm, file, horizon=job.rollout.max_new_tokens)

    # -- advantages ----------------------------------------------------------------------------------------

    def compute_advantages(self, batch: Batch, *, dp_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
                           ) -> dict[str, float]:
        """Fill ``batch.advantages`` and ``batch.returns``; returns metrics. Group estimators need whole groups on
        one rank; batch whitening (REINFORCE++, GAE) needs the whole step's statistics: on a DP rank that holds
        only its share, pass ``dp_sum`` (a sum over the DP group) and the result equals the single-rank one.
        With ``kl_in_reward`` the estimator sees ``r_t - kl_coef * kl_t`` (``batch.token_rewards`` itself is
        left as it was, so calling this twice gives the same result). DAPO's overlong reward shaping works the
        same way (:func:`overlong_penalty` added to the outcome reward the estimator sees); overlong filtering
        zeroes ``batch.response_mask`` on truncated rows first, so count the step's tokens after this call."""
        from dataclasses import replace

        import torch

        from milehpc.algorithms.advantages import group_stats, outcome_rewards, token_level_rewards
        from milehpc.algorithms.kl import kl_penalty

        spec = self.spec
        metrics: dict[str, float] = {}
        if spec.overlong_filter:
            truncated = _truncated(batch)
            batch.response_mask = batch.response_mask * (~truncated).to(batch.response_mask.dtype).unsqueeze(-1)
            metrics["reward/overlong_filtered_fraction"] = float(truncated.to(batch.rewards.dtype).mean())
        mask = batch.response_mask
        source = batch
        if spec.overlong_buffer:
            if self.max_response_len is None:
                raise ValueError("overlong_buffer needs the maximal response length (Algorithm.from_job)")
            penalty = overlong_penalty(batch.response_lengths, self.max_response_len, spec.overlong_buffer,
                                       spec.overlong_penalty).to(batch.rewards.dtype)
            source = replace(batch, token_rewards=token_level_rewards(batch) + outcome_rewards(batch, penalty))
            metrics["reward/overlong_penalty"] = float(penalty.mean())
        if spec.kl_in_reward and spec.kl_coef > 0:
            if batch.ref_logprobs is None:
                raise ValueError("kl_in_reward needs batch.ref_logprobs (a reference policy)")
            policy = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
            if policy is None:
                raise ValueError("kl_in_reward needs the policy's logprobs (old or rollout)")
            kl = kl_penalty(policy, batch.ref_logprobs, spec.kl_type) * mask
            source = replace(source, token_rewards=token_level_rewards(source) - spec.kl_coef * kl)
            metrics["reward/kl_penalty"] = float(masked_mean(kl, mask))
        if self.needs_critic and batch.values is None:
            raise ValueError(f"advantage '{self.names.get('advantage')}' needs batch.values (a critic)")
        with torch.no_grad(), dp_statistics(dp_sum):
            adv, ret = self.advantage_fn(source, **self.advantage_params)
        batch.advantages, batch.returns = adv.detach(), ret.detach()
        rows = mask.sum(-1) > 0
        valid = None if batch.failed is None else ~batch.failed
        _, std, size = group_stats(batch.rewards, batch.group_ids, valid)
        metrics.update({
            "reward/mean": float(batch.rewards[rows].mean()) if rows.any() else 0.0,
            "advantages/mean": float(masked_mean(adv, mask)),
            "advantages/abs_mean": float(masked_mean(adv.abs(), mask)),
            "advantages/max": float(adv[mask > 0].max()) if mask.any() else 0.0,
            "advantages/min": float(adv[mask > 0].min()) if mask.any() else 0.0,
            # Groups whose rewards are all equal give no signal to group-relative estimators.
            "advantages/zero_std_fraction": float(((std == 0) & (size > 1)).to(adv.dtype).mean()),
            "reward/failed_fraction": float(batch.failed.to(adv.dtype).mean()) if batch.failed is not None else 0.0,
        })
        return metrics

    # -- loss ----------------------------------------------------------------------------------------------

    def aggregator(self, *, global_tokens: float | None = None, global_seqs: float | None = None,
                   dp_size: int = 1) -> Aggregator:
        return Aggregator(self.spec.loss_agg_mode, global_tokens, global_seqs, dp_size, self.horizon)

    def loss(self, logprobs: torch.Tensor, batch: Batch, *, entropy: torch.Tensor | None = None,
             values: torch.Tensor | None = None, global_tokens: float | None = None,
             global_seqs: float | None = None, dp_size: int = 1) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch, to ``backward()``. ``logprobs`` (``[B, R]``) are the current policy's
        on ``batch``'s response tokens; ``entropy`` (``[B, R]``) adds the entropy bonus and metric; ``values``
        (``[B, R]``, the critic's current predictions) adds the clipped value loss. ``global_tokens`` /
        ``global_seqs`` are the counts of the whole optimizer step over all DP ranks and ``dp_size`` the DP
        world size: then the DP-mean of the gradients equals the gradient of the single-rank loss of the union
        (see :mod:`milehpc.algorithms.aggregation`), and so does the DP-mean of the returned loss values.
        Without ``batch.old_logprobs`` the old policy is the current one, detached (one step per batch)."""
        from milehpc.algorithms.kl import kl_penalty
        from milehpc.algorithms.off_policy import importance_weights

        spec = self.spec
        mask = batch.response_mask.to(logprobs.dtype)
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        agg = self.aggregator(global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size)
        metrics: dict[str, float] = {}
        pg_agg = agg
        if spec.off_policy_correction != "none":
            if batch.rollout_logprobs is None:
                raise ValueError(f"off_policy_correction = {spec.off_policy_correction!r} needs the rollout "
                                 "engine's logprobs (batch.rollout_logprobs)")
            weights, m = importance_weights(old, batch.rollout_logprobs, mask, spec.off_policy_correction,
                                            spec.off_policy_level, spec.off_policy_cap, spec.off_policy_lower)
            pg_agg = agg.with_weights(weights)
            metrics.update(m)
        advantages = batch.advantages
        if advantages is None:
            if self.names.get("loss") != "sft":
                raise ValueError("batch.advantages is not set: call compute_advantages(batch) first")
            advantages = logprobs.new_zeros(logprobs.shape)
        pg_loss, m = self.loss_fn(logprobs, old, advantages, mask, pg_agg, **self.loss_params)
        metrics.update(m)
        metrics["actor/pg_loss"] = float(pg_loss.detach())
        total = pg_loss
        if entropy is not None:
            ent = agg(entropy, mask)
            metrics["actor/entropy"] = float(masked_mean(entropy.detach(), mask))
            if spec.entropy_coef:
                total = total - spec.entropy_coef * ent
        if spec.kl_coef > 0 and not spec.kl_in_reward:
            if batch.ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs batch.ref_logprobs (a reference policy)")
            kl = kl_penalty(logprobs, batch.ref_logprobs, spec.kl_type)
            kl_loss = agg(kl, mask)
            metrics["actor/kl_loss"] = float(kl_loss.detach())
            metrics["actor/kl"] = float(masked_mean(kl.detach(), mask))
            total = total + spec.kl_coef * kl_loss
        if values is not None:
            v_total, m = self.value_loss(values, batch, agg=agg)
            metrics.update(m)
            total = total + v_total
        metrics["loss"] = float(total.detach())
        return total, metrics

    def value_loss(self, values: torch.Tensor, batch: Batch, *, global_tokens: float | None = None,
                   global_seqs: float | None = None, dp_size: int = 1, agg: Aggregator | None = None,
                   ) -> tuple[torch.Tensor, dict[str, float]]:
        """The critic's term of :meth:`loss` alone: ``value_coef`` times the clipped value loss of ``values``
        (``[B, R]``, the critic's current predictions) against ``batch.returns``, clipped around ``batch.values``
        (the critic's values before the update), and its metrics. For a trainer whose critic runs its own
        backward pass (Megatron: a separate model in its own pipeline schedule)."""
        from milehpc.algorithms.losses import value_loss

        if batch.returns is None or batch.values is None:
            raise ValueError("the value loss needs batch.returns and batch.values (old critic values)")
        if agg is None:
            agg = self.aggregator(global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size)
        mask = batch.response_mask.to(values.dtype)
        v_loss, metrics = value_loss(values, batch.returns, batch.values, mask, agg, self.spec.value_clip)
        metrics["critic/value_loss"] = float(v_loss.detach())
        return self.spec.value_coef * v_loss, metrics


# Metrics that are a micro-batch's share of the step's loss (divided by the whole step's normaliser already): the
# step's value is their sum over micro-batches. Every other metric is a micro-batch mean, averaged by token share.
LOSS_SHARES = frozenset({"loss", "actor/pg_loss", "actor/kl_loss", "critic/value_loss"})


def add_micro_batch_metrics(sums: dict[str, float], metrics: dict[str, float], token_share: float,
                            epochs: int = 1) -> None:
    """Accumulate one micro-batch's :meth:`Algorithm.loss` metrics into ``sums``: over a rank's micro-batches (and
    ``epochs`` epochs, averaged) they add up to the rank's part of the step; their sum over DP ranks divided by the
    DP size is the step's. ``token_share``: the micro-batch's tokens / the mean tokens per DP rank. Keys ending in
    ``max`` / ``min`` (``actor/ratio_max``, ...) keep the extreme over the micro-batches and epochs instead (over the
    DP ranks: :func:`milehpc.comm.collectives.combine_rank_metrics`); a micro-batch without tokens has none."""
    for k, v in metrics.items():
        if k.endswith(("max", "min")):
            if token_share > 0:
                pick = max if k.endswith("max") else min
                sums[k] = pick(sums[k], float(v)) if k in sums else float(v)
            continue
        w = 1.0 if k in LOSS_SHARES else token_share
        sums[k] = sums.get(k, 0.0) + float(v) * w / epochs


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476, verl's ``DAPORewardManager``): 0 up to
    ``max_len - buffer`` tokens, then ``-(L - (max_len - buffer)) / buffer * factor``, so ``-factor`` at
    ``max_len`` (a longer multi-turn response goes on down, as verl's)."""
    import torch

    over = lengths.to(torch.float64) - (max_len - buffer)
    return torch.clamp(-over / buffer * factor, max=0.0)


def _truncated(batch: Batch) -> torch.Tensor:
    """``[B]`` bool: the rows whose sample hit max_new_tokens (status TRUNCATED)."""
    import torch

    from milehpc.samples import Status

    if batch.samples is None:
        raise ValueError("overlong_filter needs the batch's samples (their status says which were truncated)")
    return torch.tensor([s.status is Status.TRUNCATED for s in batch.samples], dtype=torch.bool,
                        device=batch.response_mask.device)

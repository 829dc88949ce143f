"""Built-in advantage estimators and policy losses (registered like any third-party plugin)."""

from __future__ import annotations

from collections.abc import Iterator

from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import AdvantageEstimator, PolicyLoss

_ADV = "milehpc.algorithms.advantages:"
_LOSS = "milehpc.algorithms.losses:"


@hookimpl
def milehpc_advantage_estimators() -> Iterator[AdvantageEstimator]:
    yield AdvantageEstimator(name="grpo", impl=_ADV + "grpo", defaults={"epsilon": 1e-6, "norm_by_std": True},
                             description="group-relative: (r - group mean) / (group std + epsilon)")
    yield AdvantageEstimator(name="dr_grpo", impl=_ADV + "grpo", defaults={"epsilon": 1e-6, "norm_by_std": False},
                             description="Dr. GRPO: r - group mean (no std normalisation)")
    yield AdvantageEstimator(name="rloo", impl=_ADV + "rloo",
                             description="leave-one-out baseline: r - mean of the group's other samples")
    yield AdvantageEstimator(name="reinforce_pp", impl=_ADV + "reinforce_pp", defaults={"gamma": 1.0},
                             description="REINFORCE++: discounted returns, whitened over the batch")
    yield AdvantageEstimator(name="reinforce_pp_baseline", impl=_ADV + "reinforce_pp_baseline",
                             description="REINFORCE++-baseline: r - group mean, whitened over the batch")
    yield AdvantageEstimator(name="gae", impl=_ADV + "gae", defaults={"gamma": 1.0, "lam": 1.0},
                             needs_critic=True, description="PPO's GAE with a critic (values, gamma, lambda)")
    yield AdvantageEstimator(name="distill", impl=_ADV + "distill", defaults={"coef": 1.0}, needs_teacher=True,
                             description="on-policy distillation: per-token log p_teacher - log p_student")
    yield AdvantageEstimator(name="none", impl=_ADV + "none", description="zeros (for SFT)")


@hookimpl
def milehpc_policy_losses() -> Iterator[PolicyLoss]:
    yield PolicyLoss(name="ppo_clip", impl=_LOSS + "ppo_clip",
                     defaults={"clip_low": 0.2, "clip_high": 0.2, "clip_ratio_c": 3.0},
                     description="PPO clip, separate low/high ranges, dual clip (clip_ratio_c; 0 = off)")
    yield PolicyLoss(name="gspo", impl=_LOSS + "gspo", defaults={"clip_low": 3e-4, "clip_high": 4e-4},
                     description="GSPO: sequence-level ratio and clipping")
    yield PolicyLoss(name="policy_gradient", impl=_LOSS + "policy_gradient",
                     description="vanilla policy gradient -A * pi/pi_old, no clipping")
    yield PolicyLoss(name="sft", impl=_LOSS + "sft", description="supervised: negative log-likelihood")

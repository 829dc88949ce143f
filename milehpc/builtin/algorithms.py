"""Built-in advantage estimators and policy losses (registered like any third-party plugin)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from milehpc.config.schema import opt
from milehpc.errors import ConfigError
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import AdvantageEstimator, PolicyLoss

_ADV = "milehpc.algorithms.advantages:"
_LOSS = "milehpc.algorithms.losses:"


@dataclass
class GrpoParams:
    epsilon: float = opt(1e-6, min=0.0, help="added to the group's std before dividing")
    norm_by_std: bool = opt(True, help="divide by the group's std (false: Dr. GRPO)")


@dataclass
class DrGrpoParams(GrpoParams):
    norm_by_std: bool = opt(False, help="divide by the group's std (false: Dr. GRPO)")


@dataclass
class DiscountParams:
    gamma: float = opt(1.0, min=0.0, max=1.0, help="discount; unset = algorithm.gamma")


@dataclass
class GaeParams(DiscountParams):
    lam: float = opt(1.0, min=0.0, max=1.0, help="GAE lambda; unset = algorithm.lam")


@dataclass
class DistillParams:
    coef: float = opt(1.0, min=0.0, help="weight of log p_teacher - log p_student")


@dataclass
class ClipParams:
    clip_low: float = opt(0.2, min=0.0, help="lower clip range: ratio >= 1 - clip_low, in [0, 1)")
    clip_high: float = opt(0.2, min=0.0, help="upper clip range: ratio <= 1 + clip_high")

    def validate(self, *, file: str | None, prefix: str) -> None:
        if self.clip_low >= 1:
            raise ConfigError(f"expected a value in [0, 1), got {self.clip_low!r}", file=file,
                              field=f"{prefix}.clip_low")


@dataclass
class PpoClipParams(ClipParams):
    clip_ratio_c: float = opt(3.0, min=0.0, help="dual clip bound for negative advantages (0 = off, else > 1)")

    def validate(self, *, file: str | None, prefix: str) -> None:
        super().validate(file=file, prefix=prefix)
        if 0 < self.clip_ratio_c <= 1:
            raise ConfigError(f"expected 0 (off) or a value > 1, got {self.clip_ratio_c!r}", file=file,
                              field=f"{prefix}.clip_ratio_c")


@dataclass
class GspoParams(ClipParams):
    clip_low: float = opt(3e-4, min=0.0, help="lower clip range of the sequence ratio, in [0, 1)")
    clip_high: float = opt(4e-4, min=0.0, help="upper clip range of the sequence ratio")


@hookimpl
def milehpc_advantage_estimators() -> Iterator[AdvantageEstimator]:
    yield AdvantageEstimator(name="grpo", impl=_ADV + "grpo", schema=GrpoParams,
                             description="group-relative: (r - group mean) / (group std + epsilon)")
    yield AdvantageEstimator(name="dr_grpo", impl=_ADV + "grpo", schema=DrGrpoParams,
                             description="Dr. GRPO: r - group mean (no std normalisation)")
    yield AdvantageEstimator(name="rloo", impl=_ADV + "rloo",
                             description="leave-one-out baseline: r - mean of the group's other samples")
    yield AdvantageEstimator(name="reinforce_pp", impl=_ADV + "reinforce_pp", schema=DiscountParams,
                             description="REINFORCE++: discounted returns, whitened over the batch")
    yield AdvantageEstimator(name="reinforce_pp_baseline", impl=_ADV + "reinforce_pp_baseline",
                             description="REINFORCE++-baseline: r - group mean, whitened over the batch")
    yield AdvantageEstimator(name="gae", impl=_ADV + "gae", schema=GaeParams,
                             needs_critic=True, description="PPO's GAE with a critic (values, gamma, lambda)")
    yield AdvantageEstimator(name="distill", impl=_ADV + "distill", schema=DistillParams, needs_teacher=True,
                             description="on-policy distillation: per-token log p_teacher - log p_student")
    yield AdvantageEstimator(name="none", impl=_ADV + "none", description="zeros (for SFT)")


@hookimpl
def milehpc_policy_losses() -> Iterator[PolicyLoss]:
    yield PolicyLoss(name="ppo_clip", impl=_LOSS + "ppo_clip",
                     schema=PpoClipParams,
                     description="PPO clip, separate low/high ranges, dual clip (clip_ratio_c; 0 = off)")
    yield PolicyLoss(name="gspo", impl=_LOSS + "gspo", schema=GspoParams,
                     description="GSPO: sequence-level ratio and clipping")
    yield PolicyLoss(name="policy_gradient", impl=_LOSS + "policy_gradient",
                     description="vanilla policy gradient -A * pi/pi_old, no clipping")
    yield PolicyLoss(name="sft", impl=_LOSS + "sft", description="supervised: negative log-likelihood")

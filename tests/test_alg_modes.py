"""verl's names and modes (issue 17, item 3): every ``kl_type`` name verl's ``kl_penalty`` accepts, selectable from a
job spec and mapped to the right estimator; ``token-sum`` aggregation through the whole loss; and float64 batches
that stay float64 end to end, statistics included. Expected values are worked by hand in the comments."""

from __future__ import annotations

import math
import typing
from dataclasses import fields, replace

import pytest
import torch

from milehpc.algorithms import advantages as A
from milehpc.algorithms import losses as L
from milehpc.algorithms.aggregation import Aggregator
from milehpc.algorithms.api import Algorithm
from milehpc.algorithms.kl import KL_TYPES, kl_penalty
from milehpc.config.job import AlgorithmSpec
from milehpc.config.load import job_from_dict
from milehpc.samples import Sample
from milehpc.samples.batch import to_batch


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


# ---- kl_type -----------------------------------------------------------------------------------------------------

def test_every_kl_name_of_the_job_spec_is_an_estimator_and_loads_from_a_job_file():
    names = typing.get_args(typing.get_type_hints(AlgorithmSpec)["kl_type"])
    assert set(names) == set(KL_TYPES) == {"kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"}
    for name in names:
        spec = job_from_dict({"name": "t", "algorithm": {"kl_type": name, "kl_coef": 0.1}}, file="job.toml")
        assert spec.algorithm.kl_type == name


@pytest.mark.parametrize("d", [0.5, -0.5])
def test_kl_names_map_to_verls_estimators(d):
    # d = log p - log q (policy minus reference), one token.
    logp, ref = t([[-1.0 + d]]), t([[-1.0]])
    k3 = math.exp(-d) + d - 1  # exp(log q - log p) - (log q - log p) - 1
    want = {"k1": d, "kl": d,                     # log p - log q
            "abs": abs(d),                        # |log p - log q|: not symmetric with k1 for d < 0
            "k2": 0.5 * d * d, "mse": 0.5 * d * d,
            "k3": k3, "low_var_kl": k3}
    for name, value in want.items():
        assert kl_penalty(logp, ref, name).item() == pytest.approx(value, abs=1e-12), name


def test_abs_kl_is_selectable_in_the_loss():
    # Two tokens with log p - log q = -0.5 and +0.5: abs gives 0.5 each, token-mean 0.5 (k1 would give 0).
    algo = Algorithm.from_spec(AlgorithmSpec(advantage="grpo", kl_coef=1.0, kl_type="abs"))
    b = to_batch([Sample(prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[-1.0, -1.0], reward=1.0)], 0)
    algo.compute_advantages(b)
    b.ref_logprobs = torch.tensor([[-0.5, -1.5]])
    _, m = algo.loss(torch.full((1, 2), -1.0, requires_grad=True), b)
    assert m["actor/kl_loss"] == pytest.approx(0.5)


# ---- token-sum ---------------------------------------------------------------------------------------------------

def test_token_sum_through_the_algorithm_and_over_dp_ranks():
    # Vanilla policy gradient at ratio 1: the loss is -sum_t m_t A_t. Advantages (Dr. GRPO, group of 2 with rewards
    # 1 and 0): +0.5 and -0.5 on every token. Row 0 has 3 tokens, row 1 has 2: -(3 * 0.5) - (2 * -0.5) = -0.5.
    algo = Algorithm.from_spec(AlgorithmSpec(advantage="dr_grpo", loss="policy_gradient", loss_agg_mode="token-sum"))
    samples = [Sample(prompt_ids=[1], response_ids=[2] * n, rollout_logprobs=[-1.0] * n, reward=r, group=0, index=i)
               for i, (n, r) in enumerate([(3, 1.0), (2, 0.0)])]
    b = to_batch(samples, 0)
    algo.compute_advantages(b)
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    loss, _ = algo.loss(logp, b)
    assert loss.item() == pytest.approx(-0.5)
    (grad,) = torch.autograd.grad(loss, logp)
    # d(-A * exp(logp - sg(logp)))/d logp = -A on each trained token, 0 on padding.
    assert grad.flatten().tolist() == pytest.approx([-0.5, -0.5, -0.5, 0.5, 0.5, 0.0])
    # Split over 2 DP ranks (one row each): the mean of the ranks' losses is the single-rank loss.
    per_rank = [algo.loss(logp[i:i + 1].detach(), b.select([i]), dp_size=2)[0].item() for i in range(2)]
    assert sum(per_rank) / 2 == pytest.approx(-0.5)


# ---- float64 end to end ------------------------------------------------------------------------------------------

def as_float64(batch):
    return replace(batch, **{f.name: getattr(batch, f.name).double() for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)
                             and getattr(batch, f.name).is_floating_point()})


def batch64():
    rewards = [1.0, 0.0, 0.5, 0.5, 0.25, 0.0]
    groups = [0, 0, 1, 1, 2, 2]  # group 1 has equal rewards (std 0)
    samples = [Sample(prompt_ids=[1], response_ids=[2, 3, 4], rollout_logprobs=[-1.0] * 3, loss_mask=[1, 0, 1],
                      reward=r, group=g, index=i) for i, (r, g) in enumerate(zip(rewards, groups, strict=True))]
    b = as_float64(to_batch(samples, 0))
    b.values = torch.full_like(b.response_mask, 0.25)
    b.teacher_logprobs = torch.full_like(b.response_mask, -0.5)
    return b


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "distill", "none"])
def test_float64_batches_give_float64_advantages(name):
    adv, ret = getattr(A, name)(batch64())
    assert adv.dtype == torch.float64 and ret.dtype == torch.float64, (adv.dtype, ret.dtype)


def test_statistics_are_counted_in_the_batchs_dtype():
    # 3 tokens, one of them outside the clip range: clip_frac is exactly 1/3 in float64 (float32 gives
    # 0.3333333432674408). Advantages +1 and log-ratios 0, 0, 1 (ratio e > 1 + 0.2: clipped).
    mask = torch.ones(1, 3, dtype=torch.float64)
    adv = t([[1.0, 1.0, 1.0]])
    old = t([[0.0, 0.0, 0.0]])
    logp = t([[0.0, 0.0, 1.0]])
    agg = Aggregator()
    _, m = L.ppo_clip(logp, old, adv, mask, agg)
    assert m["actor/clip_frac"] == 1 / 3
    # Negative advantages with ratio e^2 past the dual clip c = 3 on one token of 3: clip_frac_lower = 1/3.
    _, m = L.ppo_clip(t([[0.0, 0.0, 2.0]]), old, -adv, mask, agg)
    assert m["actor/clip_frac_lower"] == 1 / 3
    # The value clip (0.5 around the old value 0) binds on one token of 3: V = 2 = the return gives (V - R)^2 = 0,
    # the clipped 0.5 gives 2.25 > 0.
    _, m = L.value_loss(t([[0.0, 0.0, 2.0]]), t([[0.0, 0.0, 2.0]]), t([[0.0, 0.0, 0.0]]), mask, agg)
    assert m["critic/clip_frac"] == 1 / 3
    # GSPO: the sequence ratio exp(mean log-ratio) = exp(1/3) > 1 + 4e-4 for all 3 tokens of row 0, none of
    # row 1 (ratio 1): 3 of 6 tokens.
    _, m = L.gspo(t([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), torch.zeros(2, 3, dtype=torch.float64), t([[1.0] * 3] * 2),
                  torch.ones(2, 3, dtype=torch.float64), agg)
    assert m["actor/clip_frac"] == 0.5
    # One group of three (the equal-reward group 1) in batch64: zero_std_fraction is 2 rows of 6 = 1/3 exactly.
    algo = Algorithm.from_spec(AlgorithmSpec(advantage="grpo"))
    metrics = algo.compute_advantages(b := batch64())
    assert b.advantages.dtype == torch.float64
    assert metrics["advantages/zero_std_fraction"] == 1 / 3

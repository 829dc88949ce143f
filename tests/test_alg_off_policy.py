"""Off-policy correction against the reference formulas (issue 17, item 5): TIS and MIS at token and sequence
level as verl's ``rollout_corr_helper.py`` computes them — log-ratio clamped to ±20 before ``exp`` (on the sum at the
sequence level), truncation ``min(ratio, cap)``, rejection outside ``[lower, cap]`` with both ends kept, padding never
entering. Every expected weight is worked by hand in the comments from ratios chosen as exact logs."""

from __future__ import annotations

import math

import pytest
import torch

from milehpc.algorithms.api import Algorithm
from milehpc.algorithms.off_policy import importance_weights
from milehpc.config.job import AlgorithmSpec
from milehpc.samples import Sample
from milehpc.samples.batch import to_batch

LN = math.log
NAN, INF = float("nan"), float("inf")


def lp(rows):
    return torch.tensor(rows, dtype=torch.float64)


# Token level: log(pi_old / pi_rollout) per token, written as rollout = 0 and old = the log-ratio.
#   row 0: ratios 3, 0.25, 1, e^25 (past the safety bound: exp(clamp(25, -20, 20)) = e^20)
#   row 1: ratio 1.5, then a padding token whose logprobs are garbage (old NaN, rollout -inf)
TOKEN_OLD = lp([[LN(3), LN(0.25), 0.0, 25.0], [LN(1.5), NAN, 0.0, 0.0]])
TOKEN_ROLLOUT = lp([[0.0, 0.0, 0.0, 0.0], [0.0, -INF, 0.0, 0.0]])
TOKEN_MASK = lp([[1, 1, 1, 1], [1, 0, 0, 0]])


def test_token_tis_truncates_at_the_cap():
    w, m = importance_weights(TOKEN_OLD, TOKEN_ROLLOUT, TOKEN_MASK, "tis", "token", cap=2.0)
    # min(ratio, 2): 3 -> 2, 0.25, 1, e^20 -> 2; 1.5; padding 0 (no NaN leaks from the garbage logprobs).
    assert w.flatten().tolist() == pytest.approx([2.0, 0.25, 1.0, 2.0, 1.5, 0.0, 0.0, 0.0])
    assert m["off_policy/ratio_max"] == pytest.approx(math.exp(20.0))  # the safety bound, not e^25
    assert m["off_policy/ratio_min"] == pytest.approx(0.25)
    assert m["off_policy/capped_fraction"] == pytest.approx(2 / 5)  # 3 and e^20 of the 5 tokens
    assert m["off_policy/weight_mean"] == pytest.approx((2 + 0.25 + 1 + 2 + 1.5) / 5)
    # mismatch KL, k1 of KL(rollout || old) = mean(log rollout - log old) = -(ln 3 + ln .25 + 0 + 25 + ln 1.5) / 5
    assert m["off_policy/mismatch_kl"] == pytest.approx(-(LN(3) + LN(0.25) + 25.0 + LN(1.5)) / 5)


def test_token_mis_rejects_outside_the_bounds_keeping_both_ends():
    w, m = importance_weights(TOKEN_OLD, TOKEN_ROLLOUT, TOKEN_MASK, "mis", "token", cap=2.0)
    # Upper bound only (lower 0): 3 and e^20 are rejected (weight 0), 0.25, 1 and 1.5 keep their ratio.
    assert w.flatten().tolist() == pytest.approx([0.0, 0.25, 1.0, 0.0, 1.5, 0.0, 0.0, 0.0])
    # verl's single-threshold rejection: lower = 1 / cap = 0.5 rejects 0.25 too.
    w, m = importance_weights(TOKEN_OLD, TOKEN_ROLLOUT, TOKEN_MASK, "mis", "token", cap=2.0, lower=0.5)
    assert w.flatten().tolist() == pytest.approx([0.0, 0.0, 1.0, 0.0, 1.5, 0.0, 0.0, 0.0])
    assert m["off_policy/capped_fraction"] == pytest.approx(3 / 5)
    # The bounds are inclusive (verl keeps lower <= ratio <= upper): ratios exactly 2 and 0.5 stay.
    w, _ = importance_weights(lp([[LN(2), LN(0.5)]]), lp([[0.0, 0.0]]), lp([[1, 1]]), "mis", "token", cap=2.0,
                              lower=0.5)
    assert w.flatten().tolist() == pytest.approx([2.0, 0.5])


def test_sequence_level_uses_the_product_of_the_token_ratios_clamped_on_the_sum():
    old = lp([[LN(2), LN(0.5), LN(1.5)],   # product 2 * 0.5 * 1.5 = 1.5
              [LN(3), 0.0, 0.0],           # product 3 (its last 2 tokens are padding: mask 0)
              [LN(0.25), 0.0, 0.0],        # product 0.25
              [-15.0, -15.0, 0.0]])        # sum -30 -> clamped to -20: e^-20 (per-token clamps would give e^-30)
    rollout = torch.zeros_like(old)
    rollout[1, 1:] = -INF  # padding garbage
    mask = lp([[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    w, _ = importance_weights(old, rollout, mask, "tis", "sequence", cap=2.0)
    # Every token of a sequence carries min(product, 2); padding carries 0.
    e20 = math.exp(-20.0)
    want = [[1.5, 1.5, 1.5], [2.0, 0.0, 0.0], [0.25, 0.25, 0.25], [e20, e20, 0.0]]
    for got, row in zip(w.tolist(), want, strict=True):
        assert got == pytest.approx(row, rel=1e-9, abs=0.0)
    # MIS with verl's lower bound 1 / cap: sequence 1 (3 > 2) and sequences 2, 3 (below 0.5) are rejected whole.
    w, m = importance_weights(old, rollout, mask, "mis", "sequence", cap=2.0, lower=0.5)
    assert w.tolist() == [[1.5, 1.5, 1.5], [0.0] * 3, [0.0] * 3, [0.0] * 3]
    assert m["off_policy/capped_fraction"] == pytest.approx(6 / 9)  # 1 + 3 + 2 of the 9 trained tokens


def test_mis_lower_bound_from_the_job_spec_reaches_the_loss():
    # Two one-token samples, Dr. GRPO advantages +0.5 / -0.5 (rewards 1, 0), vanilla PG at ratio 1, token-mean.
    # Rollout logprobs make the ratios pi_old / pi_rollout = 0.25 (rejected: below 0.5) and 1.5 (kept), so
    # loss = -(0 * 0.5 + 1.5 * -0.5) / 2 = 0.375 (the rejected token stays in the denominator with weight 0).
    algo = Algorithm.from_spec(AlgorithmSpec(advantage="dr_grpo", loss="policy_gradient", off_policy_correction="mis",
                                             off_policy_cap=2.0, off_policy_lower=0.5))
    b = to_batch([Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-1.0], reward=r, group=0, index=i)
                  for i, r in enumerate([1.0, 0.0])], 0)
    algo.compute_advantages(b)
    b.rollout_logprobs = torch.tensor([[-1.0 - LN(0.25)], [-1.0 - LN(1.5)]])
    loss, m = algo.loss(torch.full((2, 1), -1.0, requires_grad=True), b)
    assert loss.item() == pytest.approx(0.375)
    assert m["off_policy/capped_fraction"] == pytest.approx(0.5)

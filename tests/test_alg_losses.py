"""Policy losses, value loss, KL estimators and off-policy weights on hand-worked cases (expected values from
the formulas with ``math``), plus property tests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from milehpc.algorithms import losses as L
from milehpc.algorithms.aggregation import Aggregator
from milehpc.algorithms.kl import kl_penalty
from milehpc.algorithms.off_policy import importance_weights

TOKEN_MEAN = Aggregator("token-mean")


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def ppo_token(a, log_ratio, lo, hi, c):
    """The PPO dual-clip per-token loss, written out from the formula."""
    r = math.exp(log_ratio)
    l1, l2 = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
    loss = max(l1, l2)
    if a < 0 and c:
        loss = min(loss, -a * c)
    return loss


def test_ppo_clip_hand_worked_values_metrics_and_gradients():
    adv = [1.0, 1.0, -1.0, -1.0, -2.0]
    log_ratio = [0.1, 0.5, -0.5, 1.5, 0.0]
    old = t([[-1.0] * 5])
    logp = (old + t([log_ratio])).requires_grad_(True)
    mask = torch.ones(1, 5, dtype=torch.float64)
    loss, m = L.ppo_clip(logp, old, t([adv]), mask, TOKEN_MEAN, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    want = [ppo_token(a, lr, 0.2, 0.28, 3.0) for a, lr in zip(adv, log_ratio, strict=True)]
    # By hand: -e^.1, -1.28 (clip-higher), 0.8 (clipped low), 3 (dual clip), 2 (ratio 1).
    assert want == pytest.approx([-math.exp(0.1), -1.28, 0.8, 3.0, 2.0])
    assert loss.item() == pytest.approx(sum(want) / 5)
    assert m["actor/clip_frac"] == pytest.approx(2 / 5)
    assert m["actor/clip_frac_lower"] == pytest.approx(1 / 5)
    assert m["actor/approx_kl"] == pytest.approx(-sum(log_ratio) / 5)
    assert m["actor/ratio_max"] == pytest.approx(math.exp(1.5))
    assert m["actor/ratio_min"] == pytest.approx(math.exp(-0.5))
    loss.backward()
    # Clipped tokens have no gradient; the others d(-A r)/dlogp = -A r, over 5 tokens.
    assert logp.grad[0].tolist() == pytest.approx([-math.exp(0.1) / 5, 0.0, 0.0, 0.0, 2.0 / 5])


def test_ppo_clip_without_dual_clip_and_bad_c():
    old = t([[0.0]])
    logp = t([[1.5]])
    loss, m = L.ppo_clip(logp, old, t([[-1.0]]), torch.ones(1, 1), TOKEN_MEAN, clip_ratio_c=0.0)
    assert loss.item() == pytest.approx(math.exp(1.5)) and m["actor/clip_frac_lower"] == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        L.ppo_clip(logp, old, t([[-1.0]]), torch.ones(1, 1), TOKEN_MEAN, clip_ratio_c=0.5)


def test_gspo_sequence_ratio_and_sequence_clipping():
    old = t([[-1.0, -1.0], [-2.0, 0.0]])
    logp = (old + t([[0.1, 0.3], [-0.05, 0.0]])).requires_grad_(True)
    mask = t([[1, 1], [1, 0]])
    adv = t([[1.0, 1.0], [-1.0, -1.0]])
    # The aggregation mode given is ignored: GSPO always aggregates seq-mean-token-mean (verl).
    loss, m = L.gspo(logp, old, adv, mask, TOKEN_MEAN, clip_low=0.1, clip_high=0.1)
    s0, s1 = math.exp((0.1 + 0.3) / 2), math.exp(-0.05)
    seq0 = max(-1.0 * s0, -1.0 * min(max(s0, 0.9), 1.1))  # = -1.1, clipped
    seq1 = max(1.0 * s1, 1.0 * min(max(s1, 0.9), 1.1))  # inside the range
    assert loss.item() == pytest.approx((seq0 + seq1) / 2)
    assert m["actor/clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    # Sequence 0 is clipped: no gradient. Sequence 1: d(-A s)/dlogp_t = -A s / n_tokens / n_seqs.
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, s1 / 1 / 2, 0.0])


def test_sft_is_masked_nll():
    logp = t([[-1.0, -3.0], [-2.0, -9.0]]).requires_grad_(True)
    loss, m = L.sft(logp, logp.detach(), torch.zeros(2, 2), t([[1, 1], [1, 0]]), TOKEN_MEAN)
    assert loss.item() == pytest.approx((1 + 3 + 2) / 3)
    assert m["actor/nll"] == pytest.approx(2.0)


def test_policy_gradient_is_reinforce_at_ratio_one():
    logp = t([[-1.0, -2.0]]).requires_grad_(True)
    loss, _ = L.policy_gradient(logp, logp.detach(), t([[2.0, -1.0]]), torch.ones(1, 2), TOKEN_MEAN)
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 - 1.0) / 2)
    assert logp.grad[0].tolist() == pytest.approx([-1.0, 0.5])


def test_value_loss_clipped():
    values = t([[1.0, 0.0]])
    loss, m = L.value_loss(values, t([[2.0, 0.0]]), t([[0.5, 0.5]]), torch.ones(1, 2), TOKEN_MEAN, clip=0.2)
    # token 0: max((1-2)^2, (0.7-2)^2) = 1.69; token 1: max(0, (0.3-0)^2) = 0.09
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.09) / 2)
    assert m["critic/clip_frac"] == pytest.approx(1.0)
    loss0, _ = L.value_loss(values, t([[2.0, 0.0]]), t([[0.5, 0.5]]), torch.ones(1, 2), TOKEN_MEAN, clip=0.0)
    assert loss0.item() == pytest.approx(0.5 * (1.0 + 0.0) / 2)


@pytest.mark.parametrize("kind", ["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"])
def test_kl_estimators_hand_worked(kind):
    logp, ref = [-1.0, -0.5], [-1.5, -0.25]

    def expect(p, q):
        if kind in ("k1", "kl"):
            return p - q
        if kind in ("k2", "mse"):
            return 0.5 * (p - q) ** 2
        if kind == "abs":
            return abs(p - q)
        d = q - p
        return math.exp(d) - d - 1

    got = kl_penalty(t([logp]), t([ref]), kind)
    assert got[0].tolist() == pytest.approx([expect(p, q) for p, q in zip(logp, ref, strict=True)])


def test_k3_is_clamped_like_verl():
    got = kl_penalty(t([[0.0, 0.0, -1.0]]), t([[-50.0, 30.0, -1.0]]), "k3")
    # d = -50 -> clamp -20: e^-20 + 19 -> clamp 10; d = 30 -> clamp 20: e^20 - 21 -> clamp 10; d = 0 -> 0
    assert got[0].tolist() == pytest.approx([10.0, 10.0, 0.0])
    with pytest.raises(ValueError, match="kl_type"):
        kl_penalty(t([[0.0]]), t([[0.0]]), "k9")


def test_kl_estimators_vanish_when_equal_and_k3_nonnegative():
    x = torch.randn(3, 4, dtype=torch.float64)
    for kind in ("k1", "k2", "k3"):
        assert kl_penalty(x, x, kind).abs().max() == 0
    assert (kl_penalty(x, torch.randn(3, 4, dtype=torch.float64), "k3") >= 0).all()


def test_importance_weights_token_and_sequence_tis_and_mis():
    old = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]])
    rollout = t([[-1.5, -0.5, -1.0], [-1.5, -1.5, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    r = [math.exp(0.5), math.exp(-0.5), 1.0]
    w, m = importance_weights(old, rollout, mask, "tis", "token", cap=1.5)
    assert w[0].tolist() == pytest.approx([1.5, r[1], 1.0])
    assert w[1].tolist() == pytest.approx([1.5, 1.5, 0.0])  # masked tokens weigh 0
    assert m["off_policy/capped_fraction"] == pytest.approx(3 / 5)
    w, _ = importance_weights(old, rollout, mask, "mis", "token", cap=1.5)
    assert w[0].tolist() == pytest.approx([0.0, r[1], 1.0])
    # Sequence level: the product of the token ratios: row 0 -> e^0 = 1, row 1 -> e^1 > cap.
    w, _ = importance_weights(old, rollout, mask, "tis", "sequence", cap=1.5)
    assert w.flatten().tolist() == pytest.approx([1.0, 1.0, 1.0, 1.5, 1.5, 0.0])
    w, _ = importance_weights(old, rollout, mask, "mis", "sequence", cap=1.5)
    assert w.flatten().tolist() == pytest.approx([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    assert not w.requires_grad


def test_importance_weights_enter_only_the_policy_term():
    logp = t([[-1.0, -1.0]]).requires_grad_(True)
    weights = t([[2.0, 0.0]])
    loss, _ = L.policy_gradient(logp, logp.detach(), t([[1.0, 1.0]]), torch.ones(1, 2),
                                TOKEN_MEAN.with_weights(weights))
    # The weight-0 token still counts in the token-mean denominator (MIS keeps the denominator).
    assert loss.item() == pytest.approx(-(2.0 * 1.0 + 0.0) / 2)


# -- properties -----------------------------------------------------------------------------------------------

floats = st.floats(-3, 3, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(adv=st.lists(floats, min_size=1, max_size=8), lo=st.floats(0.0, 0.9), hi=st.floats(0.0, 2.0),
       c=st.sampled_from([0.0, 1.5, 3.0]), logp0=st.lists(floats, min_size=8, max_size=8))
def test_property_ppo_equals_vanilla_pg_at_ratio_one(adv, lo, hi, c, logp0):
    n = len(adv)
    logp = t([logp0[:n]]).requires_grad_(True)
    a = t([adv])
    mask = torch.ones(1, n, dtype=torch.float64)
    ppo, _ = L.ppo_clip(logp, logp.detach(), a, mask, TOKEN_MEAN, clip_low=lo, clip_high=hi, clip_ratio_c=c)
    (g_ppo,) = torch.autograd.grad(ppo, logp)
    pg, _ = L.policy_gradient(logp, logp.detach(), a, mask, TOKEN_MEAN)
    (g_pg,) = torch.autograd.grad(pg, logp)
    assert ppo.item() == pytest.approx(pg.item(), abs=1e-9)
    assert ppo.item() == pytest.approx(-sum(adv) / n, abs=1e-9)
    assert torch.allclose(g_ppo, g_pg) and torch.allclose(g_ppo, -a / n)


@settings(max_examples=80, deadline=None)
@given(adv=st.lists(floats.filter(lambda x: x != 0), min_size=1, max_size=6),
       log_ratio=st.lists(st.floats(-4, 4, allow_nan=False), min_size=6, max_size=6),
       lo=st.floats(0.05, 0.5), hi=st.floats(0.05, 0.5), c=st.sampled_from([0.0, 2.0, 3.0]))
def test_property_clipping_bounds(adv, log_ratio, lo, hi, c):
    n = len(adv)
    seen = {}

    def capture(loss_mat, mask):
        seen["mat"] = loss_mat
        return loss_mat.sum()

    old = torch.zeros(1, n, dtype=torch.float64)
    logp = t([log_ratio[:n]]).requires_grad_(True)
    loss, _ = L.ppo_clip(logp, old, t([adv]), torch.ones(1, n), capture, clip_low=lo, clip_high=hi, clip_ratio_c=c)
    (grad,) = torch.autograd.grad(loss, logp)
    for i, (a, lr) in enumerate(zip(adv, log_ratio[:n], strict=True)):
        x, r = seen["mat"][0, i].item(), math.exp(lr)
        if a > 0:
            assert x >= -a * (1 + hi) - 1e-9  # the objective gains at most (1 + clip_high) A
            if r > 1 + hi:
                assert grad[0, i] == 0  # no push beyond the clip range
        else:
            assert x >= -a * (1 - lo) - 1e-9
            if c:
                assert x <= -a * c + 1e-9  # dual clip caps the loss of a negative advantage
            if r < 1 - lo:
                assert grad[0, i] == 0

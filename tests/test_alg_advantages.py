"""Advantage estimators on hand-worked cases (expected values computed here from the formulas, with the
``statistics`` module and plain loops, not with the implementation's code) and property tests."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from milehpc.algorithms import advantages as A
from milehpc.samples import Sample, Status
from milehpc.samples.batch import to_batch

EPS = 1e-6


def make_batch(rewards, groups, lengths=None, masks=None):
    lengths = lengths or [2] * len(rewards)
    samples = []
    for i, (r, g, n) in enumerate(zip(rewards, groups, lengths, strict=True)):
        mask = masks[i] if masks else [1] * n
        samples.append(Sample(prompt_ids=[1], response_ids=[2] * n, rollout_logprobs=[-1.0] * n, loss_mask=mask,
                              reward=r, group=g, index=i))
    return to_batch(samples, 0)


def seq_adv(adv):
    return adv[:, 0].tolist()


def test_grpo_hand_worked_with_lone_and_all_equal_groups():
    b = make_batch([1.0, 0.0, 0.0, 1.0, 0.5, 1.0, 1.0], [0, 0, 0, 0, 1, 2, 2])
    adv, ret = A.grpo(b, epsilon=EPS, norm_by_std=True)
    g0 = [1.0, 0.0, 0.0, 1.0]
    mean, std = statistics.mean(g0), statistics.stdev(g0)  # unbiased std, as verl (torch.std)
    want = [(r - mean) / (std + EPS) for r in g0] + [0.5 / (1.0 + EPS)] + [0.0, 0.0]
    assert seq_adv(adv) == pytest.approx(want, rel=1e-6)
    assert torch.equal(adv, ret)
    assert not torch.isnan(adv).any()
    # Every response token carries its sequence's advantage; padding carries 0.
    assert adv[0].tolist() == pytest.approx([want[0]] * 2)


def test_dr_grpo_does_not_divide_by_std():
    b = make_batch([1.0, 0.0, 0.0, 1.0, 0.5], [0, 0, 0, 0, 1])
    adv, _ = A.grpo(b, norm_by_std=False)
    assert seq_adv(adv) == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.5])


def test_rloo_leave_one_out():
    b = make_batch([1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 2.0], [0, 0, 0, 0, 1, 2, 2])
    adv, _ = A.rloo(b)
    g0 = [1.0, 0.0, 0.0, 1.0]
    want = [r - statistics.mean(g0[:i] + g0[i + 1:]) for i, r in enumerate(g0)] + [0.5, 0.0, 0.0]
    assert seq_adv(adv) == pytest.approx(want)


def _whiten(values):
    mean, var = statistics.mean(values), statistics.variance(values)  # unbiased, as verl's masked_var
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_reinforce_pp_discounted_and_whitened():
    b = make_batch([1.0, 0.0], [0, 1], lengths=[3, 2])
    adv, ret = A.reinforce_pp(b, gamma=0.5)
    # Row 0: reward 1 on the last of 3 tokens -> returns 0.25, 0.5, 1; row 1: all 0.
    assert ret[0].tolist() == pytest.approx([0.25, 0.5, 1.0])
    assert ret[1, :2].tolist() == [0.0, 0.0]
    w = _whiten([0.25, 0.5, 1.0, 0.0, 0.0])
    assert adv[0].tolist() == pytest.approx(w[:3], rel=1e-6)
    assert adv[1].tolist() == pytest.approx(w[3:] + [0.0], rel=1e-6)


def test_reinforce_pp_carries_the_return_through_a_masked_token():
    b = make_batch([1.0], [0], lengths=[3], masks=[[1, 0, 1]])
    adv, ret = A.reinforce_pp(b, gamma=0.5)
    # t=2: G=1; t=1 (mask 0) passes G=1 through and stores 0; t=0: 0 + 0.5 * 1 = 0.5 (one model step back).
    assert ret[0].tolist() == pytest.approx([0.5, 0.0, 1.0])
    w = _whiten([0.5, 1.0])  # whitened over the masked-in tokens only
    assert adv[0].tolist() == pytest.approx([w[0], 0.0, w[1]], rel=1e-6)


def test_reinforce_pp_baseline():
    b = make_batch([1.0, 0.0, 3.0], [0, 0, 1], lengths=[2, 1, 1])
    adv, _ = A.reinforce_pp_baseline(b)
    w = _whiten([0.5, 0.5, -0.5, 3.0])  # group-mean baseline (lone group: mean 0), then batch whitening
    assert adv[0, :2].tolist() == pytest.approx(w[:2], rel=1e-6)
    assert adv[1, 0].item() == pytest.approx(w[2], rel=1e-6)
    assert adv[2, 0].item() == pytest.approx(w[3], rel=1e-6)
    assert adv[1, 1].item() == 0.0


def _gae_reference(rewards, values, mask, gamma, lam):
    """verl's recursion, written out: masked tokens pass the next value and the running GAE through."""
    next_v, last, out = 0.0, 0.0, [0.0] * len(rewards)
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_v - values[t]
        new = delta + gamma * lam * last
        if mask[t]:
            next_v, last = values[t], new
        out[t] = last
    return out


@pytest.mark.parametrize("mask", [[1, 1, 1], [1, 0, 1]])
def test_gae_hand_worked(mask):
    b = make_batch([1.0, 0.0], [0, 1], lengths=[3, 3], masks=[mask, [1, 1, 1]])
    b.values = torch.tensor([[0.5, 0.25, 0.75], [0.1, 0.2, 0.3]])
    adv, ret = A.gae(b, gamma=0.9, lam=0.8)
    raw0 = _gae_reference([0, 0, 1.0], [0.5, 0.25, 0.75], mask, 0.9, 0.8)
    raw1 = _gae_reference([0, 0, 0.0], [0.1, 0.2, 0.3], [1, 1, 1], 0.9, 0.8)
    if mask == [1, 1, 1]:
        # Written out by hand: A2 = 1 - .75 = .25; A1 = .9*.75 - .25 + .72*.25 = .605; A0 = .9*.25 - .5 + .72*.605
        assert raw0 == pytest.approx([0.225 - 0.5 + 0.72 * 0.605, 0.605, 0.25])
    assert ret[0].tolist() == pytest.approx([(a + v) * m for a, v, m in zip(raw0, [0.5, 0.25, 0.75], mask, strict=True)])
    flat = [a for a, m in zip(raw0, mask, strict=True) if m] + raw1
    w = _whiten(flat)
    got = [x for x, m in zip(adv[0].tolist(), mask, strict=True) if m] + adv[1].tolist()
    assert got == pytest.approx(w, rel=1e-5)


def test_gae_without_values_is_an_error():
    with pytest.raises(ValueError, match="values"):
        A.gae(make_batch([1.0], [0]))


def test_distill_reverse_kl_advantage():
    b = make_batch([0.0], [0], lengths=[2])
    b.teacher_logprobs = torch.tensor([[-1.0, -2.0]])
    b.old_logprobs = torch.tensor([[-1.5, -1.0]])
    adv, _ = A.distill(b, coef=2.0)
    assert adv[0].tolist() == pytest.approx([2.0 * 0.5, 2.0 * -1.0])
    b.old_logprobs = None  # falls back to the engine's logprobs (-1 each)
    adv, _ = A.distill(b, coef=1.0)
    assert adv[0].tolist() == pytest.approx([0.0, -1.0])
    b.teacher_logprobs = None
    with pytest.raises(ValueError, match="teacher"):
        A.distill(b)


def test_outcome_reward_sits_on_the_last_response_token():
    b = make_batch([1.0, 2.0], [0, 0], lengths=[3, 1])
    tr = A.token_level_rewards(b)
    assert tr.tolist() == [[0, 0, 1.0], [2.0, 0, 0]]


def test_all_equal_and_singletons_are_finite_everywhere():
    for fn in (A.grpo, A.rloo, A.reinforce_pp_baseline, A.reinforce_pp):
        for rewards, groups in (([1.0, 1.0, 1.0], [0, 0, 0]), ([0.3], [0]), ([0.0, 0.0], [0, 1])):
            adv, ret = fn(make_batch(rewards, groups))
            assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), fn.__name__
    adv, _ = A.grpo(make_batch([1.0, 1.0, 1.0], [0, 0, 0]))
    assert adv.abs().max() == 0.0


groups_strategy = st.lists(
    st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=2, max_size=6), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(groups=groups_strategy, norm=st.booleans())
def test_property_grpo_and_rloo_advantages_sum_to_zero_per_group(groups, norm):
    rewards = [r for g in groups for r in g]
    ids = [i for i, g in enumerate(groups) for _ in g]
    b = make_batch(rewards, ids)
    for adv in (A.grpo(b, norm_by_std=norm)[0], A.rloo(b)[0]):
        per_seq = adv[:, 0]
        for gid in range(len(groups)):
            scale = 1.0 + sum(abs(x) for x in per_seq[torch.tensor(ids) == gid].tolist())
            assert abs(per_seq[torch.tensor(ids) == gid].sum().item()) <= 1e-5 * scale


def test_failed_samples_join_no_group_statistics():
    samples = [Sample([1], [2, 2], reward=r, group=0, index=i) for i, r in enumerate([1.0, 0.0, 1.0])]
    samples[2].status = Status.FAILED  # e.g. its reward raised; it must not move the others' baseline
    b = to_batch(samples, 0)
    assert b.failed.tolist() == [False, False, True]
    adv, _ = A.grpo(b)
    std = statistics.stdev([1.0, 0.0])
    assert seq_adv(adv) == pytest.approx([0.5 / (std + EPS), -0.5 / (std + EPS), 0.0])
    assert adv[2].abs().sum() == 0
    adv, _ = A.rloo(b)
    assert seq_adv(adv) == pytest.approx([1.0, -1.0, 0.0])
    # A group whose every sample failed is defined too.
    only_failed = to_batch([samples[2]], 0)
    assert torch.isfinite(A.grpo(only_failed)[0]).all()

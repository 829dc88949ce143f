"""Returns and GAE across multi-turn observation spans (issue 17, item 2; verl #7278 / #7300).

In a multi-turn response the environment's tokens sit between the model's turns with loss mask 0. The running
return (REINFORCE++) and the running GAE pass through them unchanged and hold 0 on them, so the earlier turns get
the outcome reward and the discount counts the model's tokens only. Expected values are worked by hand in the
comments (and whitening with the ``statistics`` module), never with the implementation's code."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from milehpc.algorithms import advantages as A
from milehpc.samples import Sample
from milehpc.samples.batch import to_batch


def episode_batch(episodes: list[tuple[list[int], float]]) -> object:
    """One sample per ``(loss_mask, reward)``: the response has one token per mask entry."""
    samples = [Sample(prompt_ids=[1], response_ids=[2] * len(mask), rollout_logprobs=[-1.0] * len(mask),
                      loss_mask=mask, reward=r, group=i, index=i) for i, (mask, r) in enumerate(episodes)]
    return to_batch(samples, 0)


def whiten(values: list[float]) -> list[float]:
    mean, var = statistics.mean(values), statistics.variance(values)  # unbiased, as verl's masked_whiten
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


# Turn 1 (2 model tokens), an observation (2 environment tokens), turn 2 (2 model tokens), outcome reward 1.
TWO_TURNS = [1, 1, 0, 0, 1, 1]


def test_reinforce_pp_gives_the_earlier_turn_the_outcome_credit():
    # Row 0: the two-turn episode above, reward 1. Row 1: one turn of 3 tokens, reward 0. Row 2: padding only
    # after a one-token answer with reward 0 (a shorter row: trailing padding must stay 0).
    b = episode_batch([(TWO_TURNS, 1.0), ([1, 1, 1], 0.0), ([1], 0.0)])
    adv, ret = A.reinforce_pp(b, gamma=0.5)
    # Row 0, scanned from the right with gamma = 0.5 per *model* token:
    #   t=5: G = 1                      t=4: G = 0 + 0.5 * 1 = 0.5
    #   t=3, t=2 (observation): G stays 0.5, stored 0
    #   t=1: G = 0 + 0.5 * 0.5 = 0.25   t=0: G = 0.5 * 0.25 = 0.125
    # (The old reset at every mask-0 token gave [0, 0, 0, 0.25, 0.5, 1]: turn 1 lost the outcome.)
    assert ret[0].tolist() == pytest.approx([0.125, 0.25, 0.0, 0.0, 0.5, 1.0])
    assert ret[1].tolist() == [0.0] * 6 and ret[2].tolist() == [0.0] * 6
    # Whitening over the 4 + 3 + 1 = 8 model tokens of the batch; observation and padding tokens stay 0.
    w = whiten([0.125, 0.25, 0.5, 1.0] + [0.0] * 4)
    assert adv[0].tolist() == pytest.approx([w[0], w[1], 0.0, 0.0, w[2], w[3]], rel=1e-6)
    assert adv[1, :3].tolist() == pytest.approx(w[4:7], rel=1e-6)
    assert adv[1, 3:].tolist() == [0.0] * 3 and adv[2, 1:].tolist() == [0.0] * 5


def test_an_observation_span_changes_nothing_on_the_model_tokens():
    # verl #7278's reproducer: the same 4 model tokens with and without a 2-token observation between the turns
    # must get the same returns (gamma = 1 and gamma < 1 alike: the observation is no extra discount step).
    for gamma in (1.0, 0.9):
        compact = episode_batch([([1, 1, 1, 1], 1.0), ([1, 1], 0.0)])
        expanded = episode_batch([(TWO_TURNS, 1.0), ([1, 1], 0.0)])
        adv_c, ret_c = A.reinforce_pp(compact, gamma=gamma)
        adv_e, ret_e = A.reinforce_pp(expanded, gamma=gamma)
        model = [0, 1, 4, 5]
        assert ret_e[0, model].tolist() == pytest.approx(ret_c[0, :4].tolist())
        # G_t = gamma^(3 - k) for the k-th model token: 1 at gamma = 1.
        assert ret_c[0, :4].tolist() == pytest.approx([gamma ** (3 - k) for k in range(4)])
        assert adv_e[0, model].tolist() == pytest.approx(adv_c[0, :4].tolist(), rel=1e-6)
        assert adv_e[0, 2:4].tolist() == [0.0, 0.0] and ret_e[0, 2:4].tolist() == [0.0, 0.0]


def test_gae_carries_through_the_observation_span_the_same_way():
    # GAE with the same interior span: on the model tokens it equals GAE on the compacted episode with the same
    # values, whatever values the critic gives the observation tokens.
    values_model = [0.5, 0.25, 0.75, 0.6]
    compact = episode_batch([([1, 1, 1, 1], 1.0)])
    compact.values = torch.tensor([values_model])
    expanded = episode_batch([(TWO_TURNS, 1.0)])
    expanded.values = torch.tensor([[0.5, 0.25, 9.0, -9.0, 0.75, 0.6]])
    _, ret_c = A.gae(compact, gamma=0.9, lam=0.8)
    _, ret_e = A.gae(expanded, gamma=0.9, lam=0.8)
    # By hand on the compact episode (gamma 0.9, lam 0.8, so gamma * lam = 0.72):
    #   A3 = 1 - 0.6 = 0.4
    #   A2 = 0.9 * 0.6 - 0.75 + 0.72 * 0.4 = 0.078
    #   A1 = 0.9 * 0.75 - 0.25 + 0.72 * 0.078 = 0.48116
    #   A0 = 0.9 * 0.25 - 0.5 + 0.72 * 0.48116 = 0.0714352
    # returns = A + V.
    want = [0.0714352 + 0.5, 0.48116 + 0.25, 0.078 + 0.75, 0.4 + 0.6]
    assert ret_c[0].tolist() == pytest.approx(want)
    assert ret_e[0, [0, 1, 4, 5]].tolist() == pytest.approx(want)
    assert ret_e[0, 2:4].tolist() == [0.0, 0.0]


def test_the_outcome_reward_sits_on_the_last_model_token_when_an_observation_ends_the_response():
    # An episode cut after the environment's answer: the outcome goes to the model's last token (index 1), where
    # the returns can carry it back; on the mask-0 token 3 nothing would ever train on it.
    b = episode_batch([([1, 1, 0, 0], 1.0), ([0, 0], 2.0)])
    assert A.token_level_rewards(b).tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]]
    _, ret = A.reinforce_pp(b, gamma=0.5)
    assert ret[0].tolist() == pytest.approx([0.5, 1.0, 0.0, 0.0])
    # A row with no trained token keeps it on its last token: GRPO's score (the token sum) is unchanged.
    assert A.token_level_rewards(b).sum(-1).tolist() == [1.0, 2.0]

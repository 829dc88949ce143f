"""Algorithm.from_spec / from_job: plugins selected by name from a job spec with validated params; the
combined loss (policy + KL + entropy + value + off-policy weights) checked by hand; a bandit that learns."""

from __future__ import annotations

import math

import pytest
import torch

from milehpc import plugins
from milehpc.algorithms.api import Algorithm
from milehpc.config.job import AlgorithmSpec
from milehpc.config.load import job_from_dict
from milehpc.errors import ConfigError, PluginError
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import AdvantageEstimator, PolicyLoss
from milehpc.samples import Sample
from milehpc.samples.batch import to_batch


def job(**algorithm):
    return job_from_dict({"name": "t", "algorithm": algorithm}, file="job.toml")


def test_from_job_selects_plugins_by_name_with_params():
    algo = Algorithm.from_job(job(advantage="rloo", loss="ppo_clip", loss_params={"clip_high": 0.28}))
    assert algo.loss_params == {"clip_low": 0.2, "clip_high": 0.28, "clip_ratio_c": 3.0}
    assert algo.advantage_params == {}
    assert not (algo.needs_critic or algo.needs_teacher or algo.needs_ref)
    assert algo.horizon == 16  # rollout.max_new_tokens
    assert Algorithm.from_job(job(advantage="gae")).needs_critic
    assert Algorithm.from_job(job(advantage="distill")).needs_teacher
    assert Algorithm.from_job(job(kl_coef=0.1)).needs_ref
    gae = Algorithm.from_job(job(advantage="gae", gamma=0.5, lam=0.9))
    assert gae.advantage_params == {"gamma": 0.5, "lam": 0.9}
    own = Algorithm.from_job(job(advantage="reinforce_pp", gamma=0.5, advantage_params={"gamma": 0.25}))
    assert own.advantage_params == {"gamma": 0.25}  # the estimator's own param wins
    assert Algorithm.from_job(job(loss_agg_horizon=7)).horizon == 7


@pytest.mark.parametrize(("algorithm", "error", "text"), [
    ({"advantage": "grpoo"}, PluginError, "job.toml: algorithm.advantage: unknown advantage 'grpoo' (expected one of:"),
    ({"loss": "ppo"}, PluginError, "job.toml: algorithm.loss: unknown loss 'ppo'"),
    ({"advantage_params": {"eps": 0.1}}, ConfigError, "algorithm.advantage_params.eps: unknown parameter"),
    ({"loss_params": {"clip_low": "x"}}, ConfigError, "algorithm.loss_params.clip_low: expected a number"),
    ({"loss_params": {"clip_ratio_c": 0.5}}, ConfigError, "algorithm.loss_params.clip_ratio_c: expected 0 (off)"),
    ({"loss_params": {"clip_low": 1.5}}, ConfigError, "algorithm.loss_params.clip_low: expected a value in [0, 1)"),
])
def test_bad_specs_are_one_line_errors(algorithm, error, text):
    with pytest.raises(error) as info:
        Algorithm.from_spec(job(**algorithm).algorithm, file="job.toml")
    assert text in str(info.value) and "\n" not in str(info.value)


def _batch():
    samples = [
        Sample([1, 2], [3, 4], rollout_logprobs=[-1.0, -1.0], reward=1.0, group=0, index=0),
        Sample([1], [5, 6, 7], rollout_logprobs=[-1.0, -1.0, -1.0], reward=0.0, group=0, index=1),
    ]
    return to_batch(samples, 0)


def test_loss_combines_policy_kl_and_entropy_terms_by_hand():
    algo = Algorithm.from_spec(AlgorithmSpec(advantage="dr_grpo", loss="ppo_clip", kl_coef=0.1, kl_type="k1",
                                             entropy_coef=0.01))
    b = _batch()
    algo.compute_advantages(b)  # dr_grpo: +0.5 / -0.5
    b.ref_logprobs = torch.tensor([[-1.5, -0.5, 0.0], [-1.0, -2.0, -3.0]])
    logp = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    entropy = torch.tensor([[2.0, 1.0, 9.0], [1.0, 1.0, 1.0]])
    loss, m = algo.loss(logp, b, entropy=entropy)
    n = 5  # tokens in the batch
    pg = (-0.5 * 2 + 0.5 * 3) / n  # ratio 1 (no old logprobs): -A per token
    kl = ((-1 + 1.5) + (-1 + 0.5) + 0 + (-1 + 2) + (-1 + 3)) / n  # k1 = logp - ref
    ent = (2 + 1 + 1 + 1 + 1) / n
    assert m["actor/pg_loss"] == pytest.approx(pg)
    assert m["actor/kl_loss"] == pytest.approx(kl)
    assert m["actor/entropy"] == pytest.approx(ent)
    assert loss.item() == pytest.approx(pg + 0.1 * kl - 0.01 * ent)
    with pytest.raises(ValueError, match="ref_logprobs"):
        b.ref_logprobs = None
        algo.loss(logp, b)


def test_kl_in_reward_changes_the_scores():
    algo = Algorithm.from_spec(AlgorithmSpec(advantage="dr_grpo", kl_coef=0.5, kl_type="k1", kl_in_reward=True))
    b = _batch()
    b.ref_logprobs = torch.tensor([[-2.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])  # KL (k1) of row 0 = 1 + 0
    m = algo.compute_advantages(b)
    # scores: 1 - 0.5 * 1 = 0.5 and 0 - 0 = 0 -> Dr. GRPO: +0.25 / -0.25
    assert b.advantages[:, 0].tolist() == pytest.approx([0.25, -0.25])
    assert m["reward/kl_penalty"] == pytest.approx(1.0 / 5)
    assert b.token_rewards is None  # left alone: a second call gives the same advantages
    algo.compute_advantages(b)
    assert b.advantages[:, 0].tolist() == pytest.approx([0.25, -0.25])
    # The KL is in the reward, so it is not in the loss.
    _, lm = algo.loss(torch.full((2, 3), -1.0, requires_grad=True), b)
    assert "actor/kl_loss" not in lm


def test_off_policy_tis_in_the_loss():
    algo = Algorithm.from_spec(AlgorithmSpec(advantage="dr_grpo", loss="policy_gradient",
                                             off_policy_correction="tis", off_policy_cap=1.5))
    b = _batch()
    algo.compute_advantages(b)
    b.rollout_logprobs = torch.tensor([[-2.0, -1.0, 0.0], [-1.0, -1.0, -1.5]])
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    loss, m = algo.loss(logp, b)
    # weights pi_old / pi_rollout: e^1 -> capped 1.5, 1; 1, 1, e^0.5 = 1.6487 -> capped 1.5
    want = (-0.5 * (1.5 + 1.0) + 0.5 * (1.0 + 1.0 + 1.5)) / 5
    assert loss.item() == pytest.approx(want)
    assert m["off_policy/capped_fraction"] == pytest.approx(2 / 5)
    assert m["off_policy/ratio_max"] == pytest.approx(math.e)


def test_gae_value_loss_path():
    algo = Algorithm.from_spec(AlgorithmSpec(advantage="gae", loss="ppo_clip", value_clip=0.2, value_coef=0.5))
    b = _batch()
    with pytest.raises(ValueError, match="values"):
        algo.compute_advantages(b)
    b.values = torch.zeros(2, 3)
    algo.compute_advantages(b)
    assert b.returns[0].tolist() == pytest.approx([1.0, 1.0, 0.0])  # gamma = lam = 1: the outcome everywhere
    vpred = torch.full((2, 3), 0.5, requires_grad=True)
    loss, m = algo.loss(torch.full((2, 3), -1.0, requires_grad=True), b, values=vpred)
    # values clipped to 0.2 around the old 0: row 0 (return 1): max(.25, .64); row 1 (return 0): max(.25, .04)
    v = 0.5 * (2 * 0.64 + 3 * 0.25) / 5
    assert m["critic/value_loss"] == pytest.approx(v)
    assert loss.item() == pytest.approx(m["actor/pg_loss"] + 0.5 * v)


def test_sft_needs_no_advantages_and_others_do():
    sft = Algorithm.from_spec(AlgorithmSpec(advantage="none", loss="sft"))
    b = _batch()
    loss, _ = sft.loss(torch.full((2, 3), -2.0, requires_grad=True), b)
    assert loss.item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="compute_advantages"):
        Algorithm.from_spec(AlgorithmSpec()).loss(torch.zeros(2, 3), _batch())


class _MyPlugin:
    @hookimpl
    def milehpc_advantage_estimators(self):
        yield AdvantageEstimator(name="constant_adv", impl=lambda batch, value=1.0: (
            batch.response_mask * value, batch.response_mask * value), defaults={"value": 1.0})

    @hookimpl
    def milehpc_policy_losses(self):
        yield PolicyLoss(name="grpo", impl="milehpc.algorithms.losses:sft")  # clashes with nothing (a loss)


@pytest.fixture
def my_plugin():
    plugins.register(_MyPlugin(), name="test-my-plugin")
    yield
    plugins.reset_plugin_manager()


def test_a_plugin_registered_in_code_is_selectable(my_plugin):
    algo = Algorithm.from_spec(job(advantage="constant_adv", advantage_params={"value": 2.0}).algorithm)
    b = _batch()
    algo.compute_advantages(b)
    assert b.advantages.sum().item() == pytest.approx(2.0 * 5)
    assert "grpo" in plugins.registry("loss") and "grpo" in plugins.registry("advantage")


class _Clash:
    @hookimpl
    def milehpc_advantage_estimators(self):
        yield AdvantageEstimator(name="grpo", impl="x:y")


def test_a_name_clash_names_both_plugins():
    plugins.register(_Clash(), name="test-clash")
    try:
        with pytest.raises(PluginError, match="registered by two plugins: .*test-clash"):
            Algorithm.from_spec(AlgorithmSpec())
    finally:
        plugins.reset_plugin_manager()


@pytest.mark.parametrize(("advantage", "loss"), [("grpo", "ppo_clip"), ("rloo", "gspo"),
                                                 ("reinforce_pp_baseline", "policy_gradient")])
def test_a_bandit_learns(advantage, loss):
    """Four one-token answers, reward 1 for token 3: the whole API (to_batch, advantages, loss) lifts its
    probability from 0.25 to above 0.9 in 40 steps."""
    torch.manual_seed(0)
    vocab, n = 4, 16
    theta = torch.zeros(vocab, requires_grad=True)
    opt = torch.optim.Adam([theta], lr=0.1)
    algo = Algorithm.from_spec(AlgorithmSpec(advantage=advantage, loss=loss,
                                             loss_params={"clip_low": 0.2, "clip_high": 0.2} if loss != "policy_gradient"
                                             else {}))
    for step in range(40):
        with torch.no_grad():
            logp_all = torch.log_softmax(theta, -1)
            tokens = torch.multinomial(logp_all.exp(), n, replacement=True).tolist()
        samples = [Sample([0], [tok], rollout_logprobs=[float(logp_all[tok])], reward=float(tok == 3),
                          group=i // 8, index=step * n + i) for i, tok in enumerate(tokens)]
        batch = to_batch(samples, 0)
        algo.compute_advantages(batch)
        logits = theta.expand(batch.size, batch.input_ids.shape[1], vocab)
        loss_value, _ = algo.loss(batch.response_logprobs(logits), batch)
        opt.zero_grad()
        loss_value.backward()
        opt.step()
    assert torch.softmax(theta, -1)[3].item() > 0.9

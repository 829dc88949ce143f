"""RL algorithms: advantage estimators, policy losses, KL, loss aggregation, off-policy correction.

Everything here is pure PyTorch on padded ``[B, R]`` tensors (:class:`milehpc.samples.batch.Batch`); the
estimators and losses are plugins (``milehpc_advantage_estimators`` / ``milehpc_policy_losses``) and
:class:`milehpc.algorithms.api.Algorithm` puts the ones a job spec names together.

Where the widely used references differ, milehpc follows verl's ``verl/trainer/ppo/core_algos.py`` so that runs
compare across frameworks:

================================  =========================================================================
group std (GRPO)                  unbiased (``torch.std``); ``(r - mean) / (std + eps)``, eps on the std
group of one                      mean 0, std 1 (GRPO: advantage = the score); RLOO keeps the score
batch whitening (REINFORCE++,     ``(x - mean) * rsqrt(var + 1e-8)``, unbiased variance over masked tokens
GAE)                              (one masked token: variance taken as 0 here; verl divides by zero)
PPO log-ratio                     clamped to [-20, 20] before ``exp``; GSPO's to at most 10
dual clip                         on by default, ``clip_ratio_c = 3`` (0 turns it off here)
k3 / low_var_kl                   ``d = clamp(log q - log p, -20, 20)``, ``exp(d) - d - 1`` clamped to [-10, 10]
k2 / mse                          ``0.5 * (log p - log q)^2``
fully masked row                  not a sequence in the seq-mean modes; an all-masked batch gives loss 0
                                  here (verl: 0/0)
outcome reward                    placed on the last response token (here: the last one with mask 1, when a
                                  multi-turn response ends in an observation); a sequence's score is the token sum
discounted returns (REINFORCE++)  over mask-1 tokens only: an observation span passes the running return
                                  through and holds 0 (verl #7300); GAE likewise
token-sum aggregation             the masked sum times the DP size (verl #7197)
off-policy weights                ``exp(clamp(log pi_old - log pi_rollout, -20, 20))``, sequence level =
                                  product of token ratios; applied to the policy-gradient term only; a token
                                  MIS rejects keeps its place in the denominator (verl: leaves the mask)
================================  =========================================================================
"""

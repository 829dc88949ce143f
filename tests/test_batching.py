"""Issue 33 item 2 on the torch trainer, in process: mini-batches (several optimizer steps per rollout batch) and
micro-batches by token budget (milehpc.train.micro_batches); the Megatron trainer's are in tests/megatron_checks.py
(``batching``), the job rules here too."""

from __future__ import annotations

import math
import types

import pytest
import torch

from milehpc.config.load import job_from_dict
from milehpc.errors import ConfigError
from milehpc.samples import Sample
from milehpc.train import micro_batches as cut

V = 29
SHAPE = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 48}
WIDEST = max(SHAPE["hidden_size"], SHAPE["intermediate_size"], V)
DEPTH = SHAPE["num_layers"] + 2  # chained reductions of a gradient: its layers, the embedding and the head
TOKENIZER = types.SimpleNamespace(pad_id=0, eos_id=2, vocab_size=V)


def _job(**trainer: object) -> object:
    algorithm = trainer.pop("algorithm", {})
    return job_from_dict({"name": "batching", "model": SHAPE, "rollout": {"prompts_per_step": 2, "n_samples": 4},
                          "algorithm": algorithm,
                          "trainer": {"micro_batch_size": 8, "lr": 1e-2, "adam_eps": 1e-4, **trainer}})


def _samples(seed: int = 3) -> list[Sample]:
    """Two GRPO groups of 4 with prompts and responses of unlike lengths (so token bins and trimming have work)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(8):
        p = torch.randint(3, V, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(3, V, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(prompt_ids=p, response_ids=r, reward=float((i * 5) % 3), group=i // 4, index=i,
                          rollout_logprobs=[-1.0] * len(r)))
    return out


def _trainer(job: object) -> object:
    from milehpc.train.torch_trainer import TorchTrainer

    return TorchTrainer(job, TOKENIZER)


def _grads_at_step(trainer: object) -> dict[str, torch.Tensor]:
    """The gradients each optimizer step sees (the last step's kept)."""
    seen: dict[str, torch.Tensor] = {}

    def before_step(*_: object) -> None:
        seen.update({n: p.grad.detach().clone() for n, p in trainer.module.named_parameters()})

    trainer.optimizer.register_step_pre_hook(before_step)
    return seen


def grads_tolerance(samples: list[Sample]) -> float:
    """fp32 rounding of the same gradient reduced in another order (other micro-batch splits, other padded widths),
    relative to the largest gradient: the probabilistic bound of Higham & Mary (2019), lambda * sqrt(n) * u per
    reduction of n terms (u = 2**-24, lambda = 7: holds for every parameter at once with probability > 1 - 1e-5),
    n = the batch's tokens times the widest layer, chained through DEPTH reductions (tests/megatron_checks.py alike)."""
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    return 7.0 * DEPTH * math.sqrt(tokens * WIDEST) * 2.0**-24


def test_token_bins_pack_up_to_the_budget_and_trim() -> None:
    assert cut.token_bins([5, 3, 9, 2, 4], 9) == [[2], [0, 4], [1, 3]]  # first fit, longest first
    assert cut.token_bins([12, 1], 10) == [[0], [1]]  # longer than the budget: alone
    assert cut.split_rows(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    from milehpc.samples.batch import to_batch

    batch = to_batch(_samples(), 0)
    pairs = cut.micro_batches(batch, size=8, max_tokens=16)
    assert sorted(r for rows, _ in pairs for r in rows) == list(range(8))
    lengths = cut.sequence_lengths(batch)
    for rows, mb in pairs:
        assert sum(lengths[r] for r in rows) <= 16 or len(rows) == 1
        # trimmed to its own widths; the same tokens and response positions
        assert mb.prompt_width == max(len(batch.samples[r].prompt_ids) for r in rows)
        assert mb.response_width == max(len(batch.samples[r].response_ids) for r in rows)
        for i, r in enumerate(rows):
            assert torch.equal(mb.responses[i, : mb.response_width], batch.responses[r, : mb.response_width])
            assert torch.equal(mb.input_ids[i][mb.attention_mask[i].bool()],
                               batch.input_ids[r][batch.attention_mask[r].bool()])
    parts = [(rows, mb.response_mask * (torch.tensor(rows)[:, None] + 1)) for rows, mb in pairs]
    assert torch.equal(cut.assemble(parts, batch.response_mask),
                       batch.response_mask * (torch.arange(8)[:, None] + 1))


def test_one_mini_batch_is_todays_step_bit_for_bit() -> None:
    """trainer.mini_batch_size = the rollout batch (8 samples) takes today's one step: every weight and metric equal
    to the default's, bit for bit, over two steps with two epochs (old logprobs computed)."""
    samples = _samples()
    plain = _trainer(_job(algorithm={"ppo_epochs": 2}))
    mini = _trainer(_job(mini_batch_size=8, algorithm={"ppo_epochs": 2}))
    for step in range(2):
        a, b = plain.train_step(samples, step), mini.train_step(samples, step)
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
               {k: v for k, v in b.items() if not k.startswith("time/")}
    for (name, x), (_, y) in zip(plain.module.state_dict().items(), mini.module.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_token_budget_micro_batches_equal_the_plain_path() -> None:
    """Micro-batches by token budget (packed first-fit up to 16 tokens, each trimmed to its widths) against the
    whole batch in one micro-batch: the same step loss and gradients within the fp32 reordering bound, at the
    token-mean aggregation (each micro-batch normalised by the step's token count)."""
    samples = _samples()
    plain, packed = _trainer(_job()), _trainer(_job(max_tokens_per_micro_batch=16))
    from milehpc.samples.batch import to_batch

    pairs = packed.micro_batches(to_batch(samples, 0))
    assert len(pairs) >= 3 and any(mb.input_ids.shape[1] < 16 for _, mb in pairs)  # split and trimmed: not vacuous
    ga, gb = _grads_at_step(plain), _grads_at_step(packed)
    a, b = plain.train_step(samples, 0), packed.train_step(samples, 0)
    biggest = max(float(g.abs().max()) for g in ga.values())
    tol = grads_tolerance(samples) * biggest
    assert biggest > 1e-3
    worst = max(float((ga[n] - gb[n]).abs().max()) for n in ga)
    assert worst < tol, (worst, tol)
    assert abs(a["train/loss"] - b["train/loss"]) < grads_tolerance(samples) * (1 + abs(a["train/loss"]))
    assert a["train/tokens"] == b["train/tokens"]
    # compute_logprobs through the bins: each sample's logprobs back in its place
    for x, y in zip(plain.compute_logprobs(samples), packed.compute_logprobs(samples), strict=True):
        assert len(x) == len(y) and max(abs(p - q) for p, q in zip(x, y, strict=True)) < 1e-5


def _hand_logprobs(model: torch.nn.Module, batch: object) -> torch.Tensor:
    """Per-response-token logprobs written out: logits at the positions that predict each response token."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits.float()
    p = batch.prompt_width
    logp = torch.log_softmax(logits[:, p - 1 : -1], dim=-1)
    return logp.gather(-1, batch.input_ids[:, p:, None])[..., 0]


def _verl_two_steps(job: object, samples: list[Sample], *, old_per_mini_batch: bool = False) -> dict[str, torch.Tensor]:
    """verl's update_policy for one rollout batch of 8 with ppo_mini_batch_size 4 (x n = 4 samples), written out:
    old logprobs of the whole batch before any update; GRPO advantages ``(r - mean_g) / (std_g + 1e-6)`` over the
    whole batch; per mini-batch the PPO clip loss (dual clip c = 3) token-mean over the mini-batch's tokens, grad-norm
    clip 1, one AdamW step. ``old_per_mini_batch``: the wrong reading (old logprobs recomputed at each mini-batch,
    ratio 1), to show the comparison can tell the two apart."""
    from milehpc.models import build_model
    from milehpc.samples.batch import to_batch

    tr = job.trainer
    model = build_model(job.model, V, seed=job.run.seed, pad_id=0, eos_id=2)
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=(tr.adam_beta1, tr.adam_beta2), eps=tr.adam_eps,
                            weight_decay=tr.weight_decay)
    batch = to_batch(samples, 0)
    mask = batch.response_mask
    with torch.no_grad():
        old = _hand_logprobs(model, batch)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv = torch.zeros(8, dtype=torch.float64)
    for g in (0, 1):
        r = rewards[g * 4 : g * 4 + 4]
        adv[g * 4 : g * 4 + 4] = (r - r.mean()) / (r.std() + 1e-6)
    adv = adv.float()[:, None] * mask
    for rows in (slice(0, 4), slice(4, 8)):
        mb = batch.select(range(8)[rows])
        logp = _hand_logprobs(model, mb)
        if old_per_mini_batch:
            old[rows] = logp.detach()
        ratio = torch.exp(torch.clamp(logp - old[rows], -20, 20))
        a = adv[rows]
        per = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2))
        per = torch.where(a < 0, torch.minimum(per, -a * 3.0), per)
        m = mask[rows]
        loss = (per * m).sum() / m.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tr.clip_grad)
        opt.step()
        opt.zero_grad()
    return dict(model.state_dict())


def test_mini_batches_follow_verls_semantics() -> None:
    """trainer.mini_batch_size = 4 of a rollout batch of 8: two optimizer steps, the second one's importance ratio
    against the policy before the first (PPO's old policy, verl's ``old_log_prob``), not 1. The trainer's weights
    after its step equal a hand-written reference of verl's update within the fp32 bound carried through Adam (whose
    first update of a parameter moves it by about ``lr * g / (|g| + eps)``: a gradient difference d moves it by at
    most ``lr * d / eps``), and the wrong reading (old logprobs per mini-batch) is outside that bound."""
    samples = _samples()
    job = _job(mini_batch_size=4, micro_batch_size=2)
    trainer = _trainer(job)
    grads = _grads_at_step(trainer)
    metrics = trainer.train_step(samples, 0)
    assert metrics["train/actor/ratio_max"] > 1.0 + 1e-4 or metrics["train/actor/ratio_min"] < 1.0 - 1e-4
    want = _verl_two_steps(job, samples)
    wrong = _verl_two_steps(job, samples, old_per_mini_batch=True)
    got = trainer.module.state_dict()
    biggest = max(float(g.abs().max()) for g in grads.values())
    tol = 2 * job.trainer.lr * grads_tolerance(samples) * biggest / job.trainer.adam_eps
    off = max(float((got[n] - want[n]).abs().max()) for n in want)
    assert off < tol, (off, tol)
    assert max(float((wrong[n] - want[n]).abs().max()) for n in want) > 2 * tol  # measured: 4.4x


@pytest.mark.parametrize(("trainer", "field", "says"), [
    ({"mini_batch_size": 3}, "trainer.mini_batch_size", "expected a divisor of the rollout batch"),
    ({"mini_batch_size": 16}, "trainer.mini_batch_size", "expected a divisor of the rollout batch"),
    ({"recompute": "full"}, "trainer.recompute", "expected trainer.backend = 'megatron'"),
    ({"backend": "megatron", "sequence_parallel": True}, "trainer.tp", "expected trainer.tp > 1"),
    ({"backend": "megatron", "cp": 2}, "trainer.cp", "context parallelism needs transformer-engine"),
    ({"backend": "megatron", "vpp": 2}, "trainer.pp", "virtual pipeline stages interleave"),
    ({"backend": "megatron", "pp": 2, "vpp": 2, "lora": {"rank": 4}}, "trainer.vpp", "a dense policy alone"),
    ({"backend": "megatron", "pp": 2, "vpp": 4}, "trainer.vpp", "to divide model.num_layers (4)"),
])
def test_bad_batching_and_megatron_features_are_one_line(trainer: dict, field: str, says: str) -> None:
    from milehpc.config.rules import check_job_rules

    job = job_from_dict({"name": "x", "model": {"num_layers": 4}, "rollout": {"prompts_per_step": 2, "n_samples": 4},
                         "trainer": trainer})
    with pytest.raises(ConfigError) as err:
        check_job_rules(job, file="job.toml")
    text = str(err.value)
    assert field in text and says in text and "\n" not in text, text


def test_the_memory_estimate_counts_recomputation_sequence_parallelism_and_the_token_budget() -> None:
    """milehpc.memory's activations (Megatron, fp32, TP=2, micro-batches of 4 sequences): full recomputation keeps
    each layer's input and one layer; selective drops the core attention's own output (h / tp per token and layer);
    sequence parallelism splits the replicated 4h; a token budget sizes the micro-batch by its tokens. (The Megatron
    checks in tests/megatron_checks.py measure the saved bytes falling the same way on the CPU.)"""
    from milehpc import memory

    base = {"backend": "megatron", "tp": 2, "micro_batch_size": 4}

    def act(**trainer: object) -> int:
        return memory.estimate_trainer_bytes(_job(**base, **trainer), vocab_size=V)["activations"]

    job = _job(**base)
    s = memory.model_shape(job, V)[0]
    tokens = 4 * (memory.prompt_tokens(job)[0] + job.rollout.max_new_tokens)
    h, layers, fp32 = s.hidden, s.layers, 4
    plain = act()
    assert plain - act(recompute="selective") == tokens * layers * (h // 2) * fp32
    assert plain - act(sequence_parallel=True) == tokens * layers * (4 * h - 4 * h // 2) * fp32
    per_layer = 4 * h + (4 * h + 3 * s.kv_heads * s.head_dim + 4 * s.ffn) // 2
    assert plain - act(recompute="full") == tokens * (layers - 1) * (per_layer - h) * fp32 - tokens * h * fp32
    assert act(max_tokens_per_micro_batch=tokens // 2) * 2 == plain  # half the tokens, half the bytes
    rows = {i.name: i.note for i in memory.trainer_items(_job(**base, recompute="full"), s)[0]}
    assert "full recomputation" in rows["activations"]

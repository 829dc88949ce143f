"""Loss aggregation: hand-worked modes, invariance to padding, and DP consistency (the DP-mean of the ranks'
gradients equals the gradient of the single-rank loss on the union), proven both in one process and with real
DDP over gloo."""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from spawn_ranks import spawn_ranks

from milehpc.algorithms.aggregation import MODES, Aggregator, masked_whiten

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(("mode", "want"), [
    ("token-mean", (1 + 2 + 4) / 3),
    ("token-sum", 1 + 2 + 4),  # no normaliser at all (verl #7197)
    ("seq-mean-token-sum", ((1 + 2) + 4) / 2),  # the fully masked row is not a sequence (verl)
    ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
    ("seq-mean-token-sum-norm", ((1 + 2) + 4) / 2 / 3),  # horizon = the mask's width by default
])
def test_modes_hand_worked(mode, want):
    assert Aggregator(mode)(LOSS, MASK).item() == pytest.approx(want, rel=1e-6)


def test_global_counts_dp_scale_and_horizon():
    assert Aggregator("token-mean", global_tokens=14)(LOSS, MASK).item() == pytest.approx(7 / 14)
    assert Aggregator("token-mean", global_tokens=14, dp_size=2)(LOSS, MASK).item() == pytest.approx(2 * 7 / 14)
    agg = Aggregator("seq-mean-token-sum-norm", global_seqs=4, dp_size=2, horizon=10)
    assert agg(LOSS, MASK).item() == pytest.approx(7 / 4 * 2 / 10)
    # A sum needs no global count: each of 2 ranks scales its share by 2, DDP's mean gives the union's sum.
    assert Aggregator("token-sum", dp_size=2)(LOSS, MASK).item() == pytest.approx(2 * 7)
    with pytest.raises(ValueError, match="global_tokens"):
        Aggregator("token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_seqs"):
        Aggregator("seq-mean-token-mean", dp_size=2, global_tokens=3)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        Aggregator("mean")


@pytest.mark.parametrize("mode", MODES)
def test_masked_garbage_and_empty_batches_are_harmless(mode):
    junk = LOSS.clone()
    junk[2, 2] = float("inf")
    junk[0, 2] = float("nan")
    assert torch.isfinite(Aggregator(mode)(junk, MASK))
    x = torch.ones(2, 3, requires_grad=True)
    loss = Aggregator(mode)(x, torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and x.grad.abs().sum() == 0


def test_masked_whiten_matches_unbiased_formula_and_single_token():
    x = torch.tensor([[1.0, 2.0, 100.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    vals = [1.0, 2.0, 4.0]
    mean = sum(vals) / 3
    var = sum((v - mean) ** 2 for v in vals) / 2
    got = masked_whiten(x, m)
    assert got[0, 0].item() == pytest.approx((1 - mean) / (var + 1e-8) ** 0.5, rel=1e-6)
    one = masked_whiten(torch.tensor([[3.0, 7.0]]), torch.tensor([[1.0, 0.0]]))
    assert one[0, 0].item() == 0.0


def _rand_case(rng: random.Random, rows: int, width: int):
    loss = torch.tensor([[rng.uniform(-2, 2) for _ in range(width)] for _ in range(rows)], dtype=torch.float64)
    lengths = [rng.randint(0, width) for _ in range(rows)]
    mask = torch.tensor([[1.0 if (t < n and rng.random() < 0.85) else 0.0 for t in range(width)]
                         for n in lengths], dtype=torch.float64)
    return loss, mask


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 6), width=st.integers(1, 6),
       extra_cols=st.integers(0, 4), extra_rows=st.integers(0, 3), mode=st.sampled_from(MODES))
def test_property_aggregation_invariant_to_padding(seed, rows, width, extra_cols, extra_rows, mode):
    rng = random.Random(seed)
    loss, mask = _rand_case(rng, rows, width)
    agg = Aggregator(mode, horizon=8.0)
    base = agg(loss, mask)
    # More padding columns and fully padded rows, filled with junk the mask excludes.
    big_loss = torch.full((rows + extra_rows, width + extra_cols), 123.0, dtype=torch.float64)
    big_loss[:rows, :width] = loss
    big_mask = torch.zeros_like(big_loss)
    big_mask[:rows, :width] = mask
    assert agg(big_loss, big_mask).item() == pytest.approx(base.item(), rel=1e-9, abs=1e-12)


def _shard_losses(theta, feats, coefs, mask, shards, mode):
    """Per token: loss = c * theta[k]^2 (a differentiable model). Returns (union loss, per-rank losses)."""
    def mat(rows):
        return coefs[rows] * theta[feats[rows]] ** 2

    all_rows = torch.arange(feats.shape[0])
    union = Aggregator(mode, horizon=5.0)(mat(all_rows), mask)
    tokens = float(mask.sum())
    seqs = float((mask.sum(-1) > 0).sum())
    per_rank = []
    for rows in shards:
        # Each rank pads only to its own longest row: widths differ between ranks.
        width = int(max(1, max(int(torch.nonzero(mask[r]).max()) + 1 if mask[r].any() else 1 for r in rows)))
        agg = Aggregator(mode, global_tokens=tokens, global_seqs=seqs, dp_size=len(shards), horizon=5.0)
        per_rank.append(agg(mat(torch.tensor(rows))[:, :width], mask[rows][:, :width]))
    return union, per_rank


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(2, 9), dp=st.integers(1, 4), mode=st.sampled_from(MODES))
def test_property_dp_consistent_aggregation_equals_single_rank_union(seed, rows, dp, mode):
    rng = random.Random(seed)
    dp = min(dp, rows)
    width, k = 5, 4
    _, mask = _rand_case(rng, rows, width)
    feats = torch.tensor([[rng.randrange(k) for _ in range(width)] for _ in range(rows)])
    coefs = torch.tensor([[rng.uniform(-1, 1) for _ in range(width)] for _ in range(rows)], dtype=torch.float64)
    order = list(range(rows))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, rows), dp - 1)) if dp > 1 else []
    shards = [order[a:b] for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]
    theta = torch.tensor([rng.uniform(-1, 1) for _ in range(k)], dtype=torch.float64, requires_grad=True)
    union, per_rank = _shard_losses(theta, feats, coefs, mask, shards, mode)
    (g_union,) = torch.autograd.grad(union, theta)
    grads = [torch.autograd.grad(loss, theta)[0] for loss in per_rank]
    g_mean = torch.stack(grads).mean(0)  # what DDP's allreduce-mean does
    assert torch.allclose(g_mean, g_union, atol=1e-12, rtol=1e-9)
    assert torch.stack(per_rank).mean().item() == pytest.approx(union.item(), rel=1e-9, abs=1e-12)


# -- the same with real DDP over gloo: 2 ranks, the full Algorithm.loss path ---------------------------------

def _ddp_case():
    """A tiny 'language model' (next-token logits from an embedding of the current token), a batch of 6
    samples in 3 groups with rewards, and the GRPO advantages of the whole batch."""
    from milehpc.config.job import AlgorithmSpec
    from milehpc.samples import Sample

    gen = torch.Generator().manual_seed(7)
    samples = []
    for i in range(6):
        p = 1 + i % 3
        r = 1 + (i * 5) % 4
        prompt = torch.randint(1, 9, (p,), generator=gen).tolist()
        resp = torch.randint(1, 9, (r,), generator=gen).tolist()
        samples.append(Sample(prompt, resp, rollout_logprobs=[-1.0] * r, reward=float(i % 2), group=i // 2,
                              index=i, loss_mask=[1 if (j + i) % 3 else 0 for j in range(r - 1)] + [1]))
    return samples, AlgorithmSpec


def _ddp_rank(rank: int, world: int, store: str, out_dir: str, modes: list[str]) -> None:
    import torch.distributed as dist

    from milehpc.algorithms.api import Algorithm
    from milehpc.samples.batch import to_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    assert dist.get_world_size() == world
    samples, AlgorithmSpec = _ddp_case()
    for mode in modes:
        algo = Algorithm.from_spec(AlgorithmSpec(advantage="grpo", loss="ppo_clip", loss_agg_mode=mode,
                                                 kl_coef=0.0), horizon=8)
        full = to_batch(samples, 0)
        algo.compute_advantages(full)  # on the whole batch: groups are never split
        mine = [i for i in range(len(samples)) if i % world == rank]
        # Each rank pads its own share to its own widths, as the loop would.
        local = to_batch([samples[i] for i in mine], 0)
        local.advantages = full.advantages[mine][:, : local.response_width]
        counts = torch.tensor([float(local.num_tokens), float(local.num_seqs)])
        dist.all_reduce(counts)  # global counts of the step
        torch.manual_seed(0)
        model = torch.nn.Embedding(10, 10)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        logits = ddp(local.input_ids)
        loss, _ = algo.loss(local.response_logprobs(logits), local, global_tokens=float(counts[0]),
                            global_seqs=float(counts[1]), dp_size=world)
        loss.backward()  # DDP allreduce-means the gradients
        if rank == 0:
            torch.save(model.weight.grad, Path(out_dir) / f"grad-{mode}.pt")
    # Batch whitening (REINFORCE++) on each rank's share with the DP reducer = whitening the whole batch.
    def dp_sum(t):
        out = t.clone()
        dist.all_reduce(out)
        return out

    for advantage in ("reinforce_pp", "reinforce_pp_baseline"):
        algo = Algorithm.from_spec(AlgorithmSpec(advantage=advantage, loss="ppo_clip"), horizon=8)
        mine = [i for i in range(len(samples)) if i % world == rank]
        local = to_batch([samples[i] for i in mine], 0)
        algo.compute_advantages(local, dp_sum=dp_sum)
        torch.save({"rows": mine, "adv": local.advantages}, Path(out_dir) / f"{advantage}-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ddp_gloo_gradients_equal_single_rank_union(tmp_path):
    from milehpc.algorithms.api import Algorithm
    from milehpc.samples.batch import to_batch

    world, modes = 2, list(MODES)
    spawn_ranks(_ddp_rank, (world, str(tmp_path / "store"), str(tmp_path), modes), world, seconds=150,
                what="the DDP ranks")
    samples, AlgorithmSpec = _ddp_case()
    for advantage in ("reinforce_pp", "reinforce_pp_baseline"):
        full = to_batch(samples, 0)
        Algorithm.from_spec(AlgorithmSpec(advantage=advantage, loss="ppo_clip"), horizon=8).compute_advantages(full)
        for rank in range(world):
            got = torch.load(tmp_path / f"{advantage}-{rank}.pt")
            want = full.advantages[got["rows"]][:, : got["adv"].shape[1]]
            torch.testing.assert_close(got["adv"], want, rtol=1e-6, atol=1e-6)
            assert not torch.equal(got["adv"], torch.zeros_like(got["adv"]))
    for mode in modes:
        algo = Algorithm.from_spec(AlgorithmSpec(advantage="grpo", loss="ppo_clip", loss_agg_mode=mode), horizon=8)
        batch = to_batch(samples, 0)
        algo.compute_advantages(batch)
        torch.manual_seed(0)
        model = torch.nn.Embedding(10, 10)
        loss, _ = algo.loss(batch.response_logprobs(model(batch.input_ids)), batch)
        loss.backward()
        ddp_grad = torch.load(tmp_path / f"grad-{mode}.pt")
        assert ddp_grad.abs().sum() > 0
        assert torch.allclose(ddp_grad, model.weight.grad, atol=1e-6, rtol=1e-5), mode

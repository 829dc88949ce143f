"""Multi-LoRA over DP = 2 with real torch.distributed (gloo, 2 spawned processes): each adapter's gradients are
all-reduced by hand (no DDP hooks), a rank without samples of one adapter joins its step with a stand-in that trains
nothing, and an adapter without samples on any rank skips on every rank. The adapters after an SFT step and two RL
steps equal the single-rank run on the union batch (and the two ranks equal each other)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
from required import require_module
from spawn_ranks import spawn_ranks
from test_lora_multi import _randomize, multi_job

from milehpc.data.tokenizer import build_tokenizer
from milehpc.samples import Sample
from milehpc.train import lora
from milehpc.train.torch_trainer import TorchTrainer

require_module("peft")

WORLD = 2


def _sample(group: int, index: int, adapter: str) -> Sample:
    return Sample(prompt_ids=[5, 6 + group % 3, 7], response_ids=[8 + index % 3, 9, 2][: 2 + index % 2],
                  group=group, index=index, reward=float(index % 2), rollout_logprobs=[-1.0] * (2 + index % 2),
                  label="1", metadata={"adapter": adapter})


def _steps() -> list[tuple[str, list[tuple[int, list[Sample]]]]]:
    """(kind, [(rank, samples)]): rank 1 has no srt samples in the first two steps; nobody has srt in the third."""
    rev = [_sample(g, i, "rev") for g in (0, 1) for i in range(2 * g, 2 * g + 2)]
    srt = [_sample(2, i, "srt") for i in (4, 5)]
    rev2 = [_sample(g, i, "rev") for g in (3, 4) for i in range(2 * g, 2 * g + 2)]
    split = [(0, rev[:2] + srt), (1, rev[2:])]
    return [("sft", split), ("rl", split), ("rl", [(0, rev2[:2]), (1, rev2[2:])])]


def _job():
    return multi_job(algorithm={"kl_coef": 0.01})


def _run(trainer: TorchTrainer, rank: int | None) -> dict[str, object]:
    """The steps, on ``rank``'s share (None: the union, one rank); the adapters and the metrics it ends with."""
    metrics = []
    opt = trainer.sft_optimizer(1e-2)
    for kind, shares in _steps():
        samples = [s for r, part in shares for s in part if rank is None or r == rank]
        if kind == "sft":
            metrics.append(trainer.sft_step(samples, opt))
            trainer.freeze_reference()
        else:
            metrics.append(trainer.train_step(samples, 0))
        if kind == "rl" and len(metrics) == 2:
            after_two = {n: p.detach().clone() for n, p in lora.trainable(trainer.module, ["srt"])}
    return {"params": {n: p.detach().clone() for n, p in lora.trainable(trainer.module, trainer.adapters)},
            "srt_after_two": after_two, "metrics": metrics,
            "srt_schedule": trainer.schedulers["srt"].last_epoch}


def _rank(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    trainer = TorchTrainer(_job(), build_tokenizer("toy"))
    assert trainer.dp_size == WORLD and trainer.model is trainer.module  # no DDP wrapper
    _randomize(trainer, 4)
    torch.save(_run(trainer, rank), Path(out_dir) / f"rank-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dp2_multi_lora_equals_the_single_rank_union(tmp_path: Path) -> None:
    spawn_ranks(_rank, (str(tmp_path / "store"), str(tmp_path)), WORLD, seconds=150, what="the multi-LoRA DP ranks")
    single = TorchTrainer(_job(), build_tokenizer("toy"))
    _randomize(single, 4)
    start = {n: p.detach().clone() for n, p in lora.trainable(single.module, single.adapters)}
    want = _run(single, None)
    got = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=False) for r in range(WORLD)]
    for name in ("rev", "srt"):  # both adapters moved
        assert any(not torch.equal(want["params"][k], start[k]) for k in start if f".{name}." in k), name
    for r, out in enumerate(got):
        for k, t in want["params"].items():
            torch.testing.assert_close(out["params"][k], t, rtol=1e-5, atol=1e-6, msg=f"rank {r}: {k}")
        # third step: srt had no samples on any rank: skipped everywhere (its schedule still counts the step)
        assert all(torch.equal(out["params"][k], t) for k, t in out["srt_after_two"].items())
        assert out["srt_schedule"] == want["srt_schedule"] == 2
        for step, (m, w) in enumerate(zip(out["metrics"], want["metrics"], strict=True)):
            keys = [k for k in w if k.startswith("adapter/") or k in ("train/tokens", "sft/loss")]
            assert keys and sorted(k for k in m if k.startswith("adapter/")) == sorted(
                k for k in w if k.startswith("adapter/")), step
            for k in keys:
                assert m[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), (r, step, k)

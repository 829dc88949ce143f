"""Issue 30, fault 9: an SGLang LoRA sync at a real adapter size spans more buckets than the two receive buffers the
weight stream reuses, so the rollout rank must own each adapter tensor as it arrives. The real broadcast (MPI +
gloo, 4 KiB buckets) is in tests/test_runtime_mpi.py (``lora_equal``); here: how many buckets a real adapter takes,
and the stream's contract (a tensor is valid until the next one is asked for) held against split_adapters."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Qwen2-7B: hidden 3584, MLP 18944, 28 layers, 4 KV heads of 128.
QWEN2_7B = {"hidden": 3584, "mlp": 18944, "layers": 28, "kv": 4 * 128}


def adapter_shapes(rank: int, hidden: int, mlp: int, layers: int, kv: int) -> list[tuple[str, tuple[int, int]]]:
    """The trainer's wire names (milehpc.train.lora.export) and shapes of a rank-``rank`` adapter on every linear
    layer SGLang can adapt."""
    outs = {"q_proj": hidden, "k_proj": kv, "v_proj": kv, "o_proj": hidden, "gate_proj": mlp, "up_proj": mlp,
            "down_proj": hidden}
    ins = {"o_proj": hidden, "down_proj": mlp}
    out = []
    for i in range(layers):
        for m, n_out in outs.items():
            block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            pre = f"model.layers.{i}.{block}.{m}"
            out += [(f"{pre}.lora_A.weight", (rank, ins.get(m, hidden))), (f"{pre}.lora_B.weight", (n_out, rank))]
    return out


def test_a_real_adapter_spans_more_buckets_than_the_two_receive_buffers() -> None:
    import torch

    from milehpc.weights.broadcast import DEFAULT_BUCKET_BYTES, plan_buckets

    for rank, at_least in ((32, 80), (64, 80)):
        named = [(n, torch.empty(s, dtype=torch.bfloat16, device="meta")) for n, s in adapter_shapes(rank, **QWEN2_7B)]
        _, buckets = plan_buckets(named, DEFAULT_BUCKET_BYTES)
        # Every MLP matrix of 18944 x rank (>= 1 MiB in bf16) is a bucket of its own: 3 per layer.
        assert len(buckets) >= at_least > 2, (rank, len(buckets))


def reused_buffer_stream(named: list[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """What a WeightStream hands out: views of a buffer that is overwritten once the next tensor is asked for."""
    import torch

    buf = torch.empty(max(t.numel() for _, t in named))
    for name, t in named:
        view = buf[: t.numel()].view(t.shape)
        view.copy_(t)
        yield name, view


def test_split_adapters_owns_each_tensor_as_it_arrives() -> None:
    import torch

    from milehpc.rollout import sglang_lora

    gen = torch.Generator().manual_seed(0)
    sent = [("lora.scaling.a", torch.tensor([2.0], dtype=torch.float64))]
    sent += [(f"model.layers.{i}.self_attn.q_proj.lora_{x}.a.weight", torch.randn(4, 8, generator=gen))
             for i in range(3) for x in "AB"]
    got = sglang_lora.split_adapters(reused_buffer_stream([(n, t.float()) for n, t in sent]))
    want = sglang_lora.split_adapters(sent)
    assert [n for n, _ in got["a"]] == [n for n, _ in want["a"]]
    assert all(torch.equal(g, w.float()) for (_, g), (_, w) in zip(got["a"], want["a"], strict=True))

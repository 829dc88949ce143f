"""Samples to padded tensors and back (no re-tokenising)."""

from __future__ import annotations

import pytest
import torch

from milehpc.samples import Sample, Status
from milehpc.samples.batch import Batch, from_batch, to_batch

PAD = 0


def _samples() -> list[Sample]:
    return [
        Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9], rollout_logprobs=[-0.5, -0.25], reward=1.0, group=0,
               index=0, label="a", response_text="xy", metadata={"k": 1}),
        Sample(prompt_ids=[5], response_ids=[10, 11, 12, 13], rollout_logprobs=[-1.0, -2.0, -0.125, -0.75],
               loss_mask=[1, 0, 0, 1], reward={"score": 0.5, "fmt": 1.0}, group=0, index=1,
               status=Status.TRUNCATED),
        Sample(prompt_ids=[1, 2], response_ids=[3], rollout_logprobs=[-3.0], reward=None, group=1, index=2,
               status=Status.FAILED),
    ]


def test_layout_left_padded_prompts_right_padded_responses():
    b = to_batch(_samples(), PAD)
    assert b.prompt_width == 3 and b.response_width == 4
    assert b.input_ids.tolist() == [
        [5, 6, 7, 8, 9, 0, 0],
        [0, 0, 5, 10, 11, 12, 13],
        [0, 1, 2, 3, 0, 0, 0],
    ]
    assert b.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1, 1],
        [0, 1, 1, 1, 0, 0, 0],
    ]
    # Positions count only real tokens: left padding shifts nothing.
    assert b.position_ids[1, 2:].tolist() == [0, 1, 2, 3, 4]
    assert b.position_ids[0, :5].tolist() == [0, 1, 2, 3, 4]
    assert b.position_ids[2, 1:4].tolist() == [0, 1, 2]
    # The multi-turn loss mask is kept; a FAILED sample trains on nothing.
    assert b.response_mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 1], [0, 0, 0, 0]]
    assert b.rollout_logprobs[1].tolist() == [-1.0, -2.0, -0.125, -0.75]
    assert b.rewards.tolist() == [1.0, 0.5, 0.0]  # dict reward -> its score; failed -> 0
    assert b.group_ids.tolist() == [0, 0, 1]
    assert b.responses[0].tolist() == [8, 9, 0, 0]
    assert b.num_tokens == 4 and b.num_seqs == 2


def test_roundtrip_keeps_tokens_logprobs_masks_and_fields():
    samples = _samples()
    back = from_batch(to_batch(samples, PAD))
    for a, b in zip(samples, back, strict=True):
        assert b.prompt_ids == a.prompt_ids
        assert b.response_ids == a.response_ids
        assert b.rollout_logprobs == a.rollout_logprobs  # the values above are exact in float32
        assert b.loss_mask == a.loss_mask
        assert (b.reward, b.status, b.group, b.index, b.label, b.metadata) == (
            a.reward, a.status, a.group, a.index, a.label, a.metadata)


def test_roundtrip_without_samples_attached_rebuilds_from_tensors():
    b = to_batch(_samples()[:2], PAD)
    b.samples = None
    back = from_batch(b)
    assert [s.response_ids for s in back] == [[8, 9], [10, 11, 12, 13]]
    assert [s.prompt_ids for s in back] == [[5, 6, 7], [5]]
    assert back[1].loss_mask == [1, 0, 0, 1]
    assert [s.reward for s in back] == [1.0, 0.5]


def test_fixed_widths_and_errors():
    b = to_batch(_samples(), PAD, prompt_width=5, response_width=6)
    assert b.input_ids.shape == (3, 11) and b.response_mask.shape == (3, 6)
    assert from_batch(b)[1].response_ids == [10, 11, 12, 13]
    with pytest.raises(ValueError, match="longer than the widths"):
        to_batch(_samples(), PAD, response_width=3)
    with pytest.raises(ValueError, match="loss_mask"):
        to_batch([Sample([1], [2, 3], loss_mask=[1])], PAD)
    with pytest.raises(ValueError, match="rollout logprobs"):
        to_batch([Sample([1], [2, 3], rollout_logprobs=[-1.0])], PAD)
    assert to_batch([Sample([1], [2])], PAD).rollout_logprobs is None


def test_select_split_and_to_carry_optional_tensors():
    b = to_batch(_samples(), PAD)
    b.advantages = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    parts = b.split(2)
    assert [p.size for p in parts] == [2, 1]
    assert parts[1].advantages.tolist() == [[8, 9, 10, 11]]
    assert parts[1].samples[0].index == 2 and parts[1].prompt_width == 3
    sub = b.select([2, 0])
    assert sub.group_ids.tolist() == [1, 0] and sub.input_ids[1, 3].item() == 8
    assert b.to("cpu").advantages is not None


def test_response_logprobs_align_with_next_token_logits():
    b = to_batch(_samples(), PAD)
    vocab = 16
    torch.manual_seed(0)
    logits = torch.randn(b.size, b.input_ids.shape[1], vocab)
    got = b.response_logprobs(logits)
    # Row 0: response token j (at position 3 + j) is predicted by the logits at position 2 + j.
    for j, tok in enumerate([8, 9]):
        want = torch.log_softmax(logits[0, 2 + j], -1)[tok]
        assert torch.isclose(got[0, j], want)
    got_t = b.response_logprobs(logits, temperature=2.0)
    assert torch.isclose(got_t[1, 0], torch.log_softmax(logits[1, 2] / 2.0, -1)[10])
    ent = b.response_entropy(logits)
    p = torch.softmax(logits[0, 2], -1)
    assert torch.isclose(ent[0, 0], -(p * p.log()).sum())


def test_batch_is_a_dataclass_with_len():
    b = to_batch(_samples(), PAD)
    assert isinstance(b, Batch) and len(b) == 3
    with pytest.raises(ValueError):
        to_batch([], PAD)


def test_routed_experts_for_moe_routing_replay_roundtrip():
    a = Sample([1], [2, 3], routed_experts=[[[0, 1], [2, 3]], [[1, 0], [3, 2]]])  # 2 tokens, 2 layers, top-2
    b = Sample([1, 2], [4], routed_experts=[[[5, 6], [7, 0]]])
    batch = to_batch([a, b], PAD)
    assert batch.routed_experts.shape == (2, 2, 2, 2)
    assert batch.routed_experts[1, 1].tolist() == [[-1, -1], [-1, -1]]  # padding
    back = from_batch(batch)
    assert back[0].routed_experts == a.routed_experts and back[1].routed_experts == b.routed_experts
    assert to_batch([Sample([1], [2])], PAD).routed_experts is None
    with pytest.raises(ValueError, match="routed_experts"):
        to_batch([Sample([1], [2, 3], routed_experts=[[[0, 1]]])], PAD)

"""The critic model both trainers start from (milehpc.models.build_model with ``value_head=True``): its values do not
depend on the random stream (no dropout before the head, in train mode too), and a critic on a checkpoint folder
(which has no value head) gets the same seeded head on every rank and in both trainers (issue 17 item 1)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from milehpc.config.load import job_from_dict
from milehpc.models import build_model

MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 48}
V = 23


def _values(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits[..., 0]


def test_critic_values_are_deterministic_and_its_head_seeded(tmp_path: Path) -> None:
    spec = job_from_dict({"name": "c", "model": MODEL}).model
    build_model(spec, V, seed=3).save_pretrained(tmp_path)
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(0))
    for source in (spec, dataclasses.replace(spec, path=str(tmp_path))):
        critic = build_model(source, V, seed=5, value_head=True).train()  # the torch trainer trains it in train mode
        with torch.no_grad():
            assert torch.equal(_values(critic, ids), _values(critic, ids)), source
        torch.manual_seed(1234)  # another process RNG state: the head's init is the seed's alone
        again = build_model(source, V, seed=5, value_head=True)
        assert torch.equal(critic.score.weight, again.score.weight)
        assert not torch.equal(critic.score.weight, build_model(source, V, seed=6, value_head=True).score.weight)

"""Issue 33 item 1, the faults the 0.5B-shape figures showed in the weight sync: the torch trainer sent a tied
``lm_head`` a second time (+27% bytes at Qwen2.5-0.5B's shape). (The streamed send's O(bucket) memory is checked in
the existing MPI launch: tests/test_runtime_mpi.py, ``streamed``; the Megatron export's laziness in
tests/megatron_checks.py.)"""

from __future__ import annotations

import torch

from milehpc.config.job import JobSpec, ModelSpec
from milehpc.data.tokenizer import CharTokenizer
from milehpc.models import build_model
from milehpc.rollout.reference import ReferenceEngine

TOK = CharTokenizer()


def test_a_tied_lm_head_is_sent_once_and_the_engine_ties_it_itself() -> None:
    from milehpc.train.torch_trainer import TorchTrainer

    spec = ModelSpec(arch="qwen2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                     tie_word_embeddings=True)
    trainer = TorchTrainer(JobSpec(name="tied", model=spec), TOK)
    with torch.no_grad():  # trained weights the engine does not have yet
        trainer.module.model.embed_tokens.weight.mul_(1.5)
    named = list(trainer.export_weights())
    names = [n for n, _ in named]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    embedding = trainer.module.model.embed_tokens.weight
    assert trainer.sync_bytes == sum(t.numel() * t.element_size() for _, t in named)
    engine = ReferenceEngine(build_model(spec, TOK.vocab_size, seed=7), TOK, seed=0)
    engine.update_weights(named, 1)
    # The engine's output layer follows the embedding it was sent: it is the same storage.
    assert torch.equal(engine.model.lm_head.weight, embedding)
    ids = torch.tensor([TOK.encode_prompt("12 3")])
    assert torch.equal(engine.model(ids).logits, trainer.module(ids).logits)

"""The inputs the shipped examples read from a cluster's file system, made here: a login node checks every input
before the queue (milehpc.config.inputs), so a test that plans ``examples/frontier-grpo.toml`` points its Lustre paths
at these with ``--set`` overrides (what a user does after replacing PROJECT)."""

from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path

# Qwen2.5-7B-Instruct's config.json shape fields (the example's [model] table says the same: they must agree).
QWEN25_7B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
             "max_position_embeddings": 32768, "vocab_size": 152064, "tie_word_embeddings": False}


@lru_cache(maxsize=1)
def frontier_sets() -> tuple[str, ...]:
    """``--set`` overrides that give examples/frontier-grpo.toml a model folder and a prompt file (made once)."""
    root = Path(tempfile.mkdtemp(prefix="milehpc-lustre-"))
    model = root / "models" / "Qwen2.5-7B-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(QWEN25_7B))
    data = root / "data" / "math-train.jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    return (f"model.path='{model}'", f"model.tokenizer='{model}'", f"data.source='{data}'")

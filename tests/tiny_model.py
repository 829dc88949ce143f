"""The tiny Qwen2-shaped model several end-to-end tests train (2 layers, hidden 32, GQA 4/2): small enough for
Megatron at TP=2 and PP=2 on 2 cores."""

TINY_MODEL = """
[model]
hidden_size = 32
num_layers = 2
num_heads = 4
num_kv_heads = 2
intermediate_size = 64
max_position_embeddings = 32
"""

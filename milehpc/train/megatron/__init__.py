"""The Megatron-core trainer: model (GPTModel from HF configs), convert (Megatron <-> HF), trainer, checkpoint
(dist_checkpointing), cpu_adapt (running megatron-core without a GPU) and fixes (upstream work-arounds)."""

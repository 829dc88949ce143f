"""``milehpc export``: a checkpoint of a finished (or running) run as a Hugging Face folder — safetensors, config,
generation config, the run's tokenizer and ``milehpc_export.json`` (run, step, weight version, source checkpoint) —
that ``transformers`` loads, SGLang serves and ``huggingface-cli upload`` publishes; or a LoRA run's adapter as a
peft folder.

Modules: ``source`` (which checkpoint, the trainer state in it, FSDP2 shards joined), ``megatron`` (a dist checkpoint
of any TP/PP/EP loaded in one process and converted to HF names), ``folder`` (staged writing, the HF model files,
provenance), ``tokenizer_files`` (the job's tokenizer as HF files), ``run`` (the command's logic).
"""

from milehpc.export.run import Exported, export_run

__all__ = ["Exported", "export_run"]

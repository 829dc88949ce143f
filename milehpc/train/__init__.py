"""Trainers (the ``Trainer`` protocol the loop calls, in ``base``): the torch trainer (DDP / FSDP2) and the
Megatron-core trainer (``megatron/``)."""

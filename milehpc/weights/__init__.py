"""Trained weights from the trainer ranks to the rollout engines: the bucketed broadcast over a weight-sync group
(``broadcast``), one sync on every rank incl. the colocated in-place load (``sync``), SGLang's own update groups
for engines that receive the bytes directly (``sglang``), the equality check (``check``) and converters between a
trainer's and an engine's names (``converters``)."""

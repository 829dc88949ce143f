"""The wall-time requeue needs time: Slurm signals the batch shell ``checkpoint.signal_lead_s`` before the limit
(``--signal=B:USR1@lead``), and in that time the ranks must write a checkpoint. This checks the lead against the
checkpoint's estimated write time on the site's shared file system (``fs_write_gib_s``), on the login node.

The checkpoint holds the trained weights and Adam's two fp32 moments (plus an fp32 master copy of bf16 weights), for
the model's parameters as :mod:`milehpc.memory` counts them; with LoRA only the adapters are written (not checked).
The write time is a lower bound (the step in flight finishes first): the lead must be at least twice it.
"""

from __future__ import annotations

from milehpc import memory
from milehpc.config.job import JobSpec
from milehpc.config.site import Partition
from milehpc.errors import ConfigError

MARGIN = 2.0  # the write, and as long again for the step in flight to reach its boundary (its length is not known)


def checkpoint_bytes(job: JobSpec) -> int:
    """Bytes of one full checkpoint of the policy: weights at their training dtype, Adam's moments, a master copy."""
    shape, _ = memory.model_shape(job)
    params = memory.engine_weights(shape)
    low = job.trainer.precision != "fp32" or job.model.dtype != "float32"
    per_param = (2 + 4 if low else 4) + 8  # weights (+ fp32 master), two fp32 moments
    return params * per_param


def check_signal_lead(job: JobSpec, partition: Partition, *, file: str | None = None) -> None:
    """One line when ``checkpoint.signal_lead_s`` is shorter than :data:`MARGIN` times the estimated write time."""
    rate = partition.fs_write_gib_s
    if rate is None or partition.scheduler != "slurm" or job.trainer.lora is not None:
        return
    size = checkpoint_bytes(job)
    write_s = size / (rate * memory.GIB)
    need = int(MARGIN * write_s) + 1
    if job.checkpoint.signal_lead_s < need:
        raise ConfigError(f"expected at least {need} s: a checkpoint of {size / memory.GIB:.1f} GiB (weights and Adam "
                          f"state) takes {write_s:.0f} s at the site's fs_write_gib_s = {rate:g} GiB/s, and the step in "
                          f"flight must end first (x{MARGIN:g}); got {job.checkpoint.signal_lead_s}", file=file,
                          field="checkpoint.signal_lead_s")

"""The records every layer shares: :class:`Sample` (token ids in, token ids out), the padded :class:`Batch` the
trainers and algorithms compute on (``samples.batch``), and how samples are stored in HDF5 (``samples.h5``: the one
codec, used by the rollout dumps in ``samples.dumps`` and by checkpoints)."""

from milehpc.samples.sample import ADAPTER_KEY, Group, Sample, Status, samples_of

__all__ = ["ADAPTER_KEY", "Group", "Sample", "Status", "samples_of"]

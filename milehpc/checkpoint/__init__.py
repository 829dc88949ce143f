"""Atomic, checksummed checkpoints of everything that determines a run's future, and finding one to resume.

Layout of ``<checkpoint.dir>`` (default ``RUN_DIR/checkpoints``)::

    step-00000040/               a complete checkpoint (only complete ones carry this name)
        rank-00000.pt            rank 0's state: {"state": what the loop gave, "rng": python/numpy/torch RNG}
        rank-00000.h5            rank 0's sample buffers (partial rollouts, over-sampled groups, outbox), if any
        rank-00001.pt ...        one shard per rank, as trained (never gathered)
        rank-00000.sums.json     each rank's checksums of its own files (merged into the manifest)
        manifest.json            written last: format, step, layout, meta, sha256 + size of every file
    .tmp-step-00000050/          a checkpoint being written (or half-written by a job that was killed)

Writing is a collective over all ranks (:meth:`Checkpointer.save`): rank 0 clears and creates the temporary
directory; every rank writes and fsyncs its files and its checksums; rank 0 merges the checksums into
``manifest.json`` (written last, fsynced), renames the directory to ``step-N`` (atomic on POSIX file systems),
fsyncs the parent and deletes all but the newest ``keep``. A job killed at any moment leaves either the
previous complete checkpoints untouched or a new complete one — never a damaged ``step-N``.

Resuming (:meth:`Checkpointer.find_latest`) takes the newest ``step-N`` whose manifest is valid and whose files
all exist with the recorded sizes; every rank then verifies the sha256 of its own files, so verification is
spread over the ranks, and if any rank finds a mismatch all ranks fall back to the next older checkpoint.
Half-written ones are skipped with a warning. The manifest's layout record (parallel layout + model shape) must
match the job's, else one clear line refuses the resume — unless the backend says it can reshard.

Modules: ``files`` (names, sha256, durable writes), ``collective`` (barrier/max over one process or mpi4py),
``rng`` (the process RNG: captured per shard, restored once), ``layout`` (what a checkpoint's shards depend on and
whether a job may load them), ``manifest`` (finding complete checkpoints), ``checkpointer`` (save / find / load),
``resume`` (the checkpoint directory of a job and ``milehpc submit --resume`` on the login node). Sample buffers
are stored with the HDF5 codec of :mod:`milehpc.samples.h5`. What the RL loop puts into a checkpoint, and when,
is :mod:`milehpc.runtime.loop.checkpointing`.

Login-node code imports this package (``milehpc submit --resume``): torch, numpy and h5py are imported lazily.
"""

from milehpc.checkpoint.checkpointer import Checkpointer, Decision, Restored
from milehpc.checkpoint.collective import Collective, MPICollective, Solo
from milehpc.checkpoint.files import MANIFEST, rank_file, step_dir_name
from milehpc.checkpoint.layout import check_layout, layout_record, reshard_check
from milehpc.checkpoint.manifest import CheckpointInfo, list_checkpoints
from milehpc.checkpoint.resume import checkpoint_root, resume_run_dir
from milehpc.checkpoint.rng import capture_rng, derive_rng, restore_rng

__all__ = ["MANIFEST", "CheckpointInfo", "Checkpointer", "Collective", "Decision", "MPICollective", "Restored", "Solo",
           "capture_rng", "check_layout", "checkpoint_root", "derive_rng", "layout_record", "list_checkpoints",
           "rank_file", "reshard_check", "restore_rng", "resume_run_dir", "step_dir_name"]

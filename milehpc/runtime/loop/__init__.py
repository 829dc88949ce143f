"""The RL loop that runs inside the job: rollout ranks generate and score, trainer ranks learn, weights go back.

Layouts (from the plan), one driver each:

* **separate groups** (trainer ranks 0..T-1, rollout ranks after): ``separate_rollout`` (engine leaders generate and
  send batches, take weight notices between generations) and ``separate_trainer`` (rank 0 deals whole groups to the
  DP ranks, every trainer rank steps, the stage leaders send the weights). Loop modes ``sync`` (staleness 0),
  ``one_step_off`` (batch k+1 generated while step k trains) and ``async`` (at most ``run.max_staleness`` ahead;
  stale groups dropped or kept for off-policy correction) differ only in which weights a batch must wait for
  (``schedule``).
* **colocated** (every rank both): ``colocated``; sync only.
* **local** (one process, no MPI): ``local.run_local``, for tests, notebooks and benchmarks.

The pieces: ``protocol`` (tags, message kinds, the mailbox), ``state`` (what the loop carries across a restart),
``schedule`` (pure: versions, staleness, dealing, target reward), ``rollout_side`` and ``trainer_side`` (one rank's
work on each side, used by every driver), ``rollout_metrics`` (the engines' counters → ``rollout/*`` metrics),
``checkpointing`` (resume and step-boundary checkpoints), ``evaluation`` (``run.eval_every`` on the held-out prompts),
``entry`` (``milehpc.runtime.loop:run``, what ``milehpc launch`` calls).
"""

from milehpc.runtime.loop.entry import run
from milehpc.runtime.loop.local import run_local

__all__ = ["run", "run_local"]

"""Elastic rollout (``resources.elastic_rollout``): a rollout node that dies costs its engines, not the job.

Why not inside the job's one MPI world: a node's death ends the whole step whatever the MPI's fault tolerance
(Slurm's PMIx plugin cancels the step, PRRTE ends the job; tests/cluster/README.md), while separate job steps are
independent. So the job script starts the trainer ranks as one srun step (their own MPI world) and each rollout
node's engines as a step of their own, one process per engine, no MPI between them
(:func:`milehpc.runtime.elastic.engine.run_engine`). Every engine joins trainer rank 0 over an authenticated TCP
channel (:mod:`milehpc.comm.channel`; the secret is a file of the private run directory) and a weight-sync group of
its own (the trainer's TCPStore, a fresh name per join), into which the weights go by the engine's own update path
(SGLang's schedulers take the buckets themselves: :mod:`.weights`). Each engine is built by the job's
engine plugin, as a rollout rank's is (:mod:`.seat`).

Each step trainer rank 0 hands the step's prompt indices out to the live engines (:mod:`.hub`,
:class:`~milehpc.runtime.elastic.trainer.ElasticTrainer`); an engine returns one group per prompt, sampled with a
seed of the prompt's own (:func:`prompt_seed`), so a prompt's group does not depend on which engine made it. An
engine whose connection drops or whose heartbeat stops for ``resources.collective_timeout_s`` is dropped, named in
one line, and its unfinished prompts go to the others: every prompt index of a step is trained exactly once. Engines
that (re)join (a spare node's, started by the job script after a rollout step failed) get the current weights and
work from the next step on.
"""

from __future__ import annotations

ADDRESS_FILE = ".milehpc/elastic.json"  # trainer rank 0's channel and store address, for the engines
LOST_FILE = ".milehpc/elastic-lost"  # a line per lost engine: its host (the job script starts a spare)
SECRET_FILE = "elastic.secret"  # in RUN_DIR/.milehpc, mode 0600
HEARTBEAT_S = 1.0
ENGINE_KEY = "elastic_engine"  # a sample's metadata: the id of the engine that generated it


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of the prompt at stream position ``index``: the same on whichever engine generates it."""
    return (seed * 1_000_003 + index * 7_919 + 12_345) % (2**63 - 1)

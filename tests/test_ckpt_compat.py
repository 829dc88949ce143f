"""A checkpoint written before the loop became a package (the rollout side's outbox beside, not inside, its state;
the loop state still carrying its own RNG, an unused async buffer and empty sample lists) still resumes: same prompt
stream, same outbox, same engine sampling state. (Sample buffers of that release's HDF5 layout: test_samples_h5.)"""

from __future__ import annotations

import random

import torch
from test_loop_local import rollout_side, tiny_job

from milehpc.checkpoint import Checkpointer, checkpoint_root
from milehpc.runtime.loop.checkpointing import LoopCheckpoint


def _old_format_state(side) -> dict:
    """What the previous release's LoopCheckpoint wrote for a rollout rank (its RolloutSide.state_dict layout)."""
    st = side.state
    loop = {"step": st.step, "weight_version": st.weight_version, "data": dict(st.data), "carry": [], "ready": [],
            "pending": [], "sft_done": st.sft_done, "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}}
    rollout = {"loop": loop, "cursor": side._cursor, "engine": side.engine.state_dict()}
    return {"rollout": rollout, "outbox": [(o.batch, o.stats) for o in side.outbox]}


def test_a_checkpoint_of_the_previous_layout_resumes_the_rollout_side(tmp_path) -> None:
    job = tiny_job(rollout={"partial_rollout": True, "max_new_tokens": 6, "options": {"partial_chunk": 2}})
    a = rollout_side(job)
    for b in range(2):  # two batches generated and sent, not yet trained: the outbox holds both
        groups, stats = a.produce()
        a.sent(b, groups, stats)
    assert a.state.carry, "partial rollouts carried over (the test needs a non-empty carry)"
    Checkpointer.for_job(job, None, tmp_path).save(2, _old_format_state(a), samples=a.sample_buffers())
    assert (checkpoint_root(job, tmp_path) / "step-00000002").is_dir()

    b = rollout_side(job)
    assert LoopCheckpoint(job, tmp_path).restore(rollout=b)
    assert [(o.batch, o.stats) for o in b.outbox] == [(o.batch, o.stats) for o in a.outbox]
    assert [o.groups for o in b.outbox] == [o.groups for o in a.outbox]
    assert b.state.carry == a.state.carry and b.state.step == a.state.step == 2
    assert b.produce()[0] == a.produce()[0]  # same prompts, same engine RNG: the same next batch

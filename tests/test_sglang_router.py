"""milehpc's load balancing over rollout engines (pure: no torch, no MPI)."""

from __future__ import annotations

import random

import pytest

from milehpc.rollout.router import GroupCost, Router, split_prompts


def test_groups_stay_whole_and_load_is_balanced():
    rng = random.Random(0)
    prompts = [[1] * rng.randint(4, 200) for _ in range(64)]
    parts = split_prompts(prompts, n=8, max_new_tokens=64, engines=4)
    assigned = sorted(i for p in parts for i in p)
    assert assigned == list(range(64))  # every group exactly once, never split across engines
    loads = [sum(8 * (len(prompts[i]) + 64) for i in p) for p in parts]
    biggest = max(8 * (len(p) + 64) for p in prompts)
    # LPT: the spread between engines is at most one group's cost.
    assert max(loads) - min(loads) <= biggest
    assert all(p == sorted(p) for p in parts)  # each engine keeps the prompt order


def test_outstanding_load_steers_new_work():
    router = Router(3)
    router.load = [1000, 0, 0]
    placed = router.assign([GroupCost(0, 10, 2, 10), GroupCost(1, 10, 2, 10)])
    assert placed[0] == [] and sorted(placed[1] + placed[2]) == [0, 1]
    router.finished(1, 40)
    assert router.load[1] == 0


def test_dead_engine_gets_nothing_and_its_work_moves():
    router = Router(3)
    first = router.assign([GroupCost(g, 5, 4, 8) for g in range(6)])
    lost = [GroupCost(g, 5, 4, 8, done_tokens=10) for g in first[1]]
    moved = router.reassign(1, lost)
    assert 1 not in moved and sorted(g for gs in moved.values() for g in gs) == sorted(first[1])
    assert lost[0].tokens == 4 * (5 + 8) - 10  # tokens already generated cost nothing
    router.mark_dead(0)
    router.mark_dead(2)
    with pytest.raises(RuntimeError, match="no live rollout engine"):
        router.assign([GroupCost(9, 1, 1, 1)])

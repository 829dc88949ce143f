"""Invariants of the rank layout (milehpc.plan), on random small layouts (hypothesis) and on a 10,000-node x
8-GPU layout: every GPU is used once, the trainer and rollout groups are disjoint (identical when colocated),
the counts match the spec, TP/PP/DP coordinates are a bijection, engines never straddle nodes, and there is
one weight-sync group per pipeline stage."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from milehpc.config.load import job_from_dict
from milehpc.config.schema import build
from milehpc.config.site import Partition
from milehpc.errors import ConfigError
from milehpc.plan import BOTH, ROLLOUT, TRAINER, Plan, make_plan

# Node shapes: (GPUs per node, ranks per node). 0 GPUs = a CPU partition where a "slot" is a rank.
SHAPES = [(0, 4), (4, 4), (8, 8)]


def partition(gpus: int, ranks: int, max_nodes: int = 10_000) -> Partition:
    data = {"cpus_per_node": 64, "cpus_per_task": 1, "max_nodes": max_nodes, "ranks_per_node": ranks}
    if gpus:
        data["devices"] = {"vendor": "nvidia", "arch": "sm_90", "count": gpus}
    return build(Partition, data, file="<test>", prefix="site")


def job(tp: int, pp: int, dp: int, engines: int, gpe: int, colocate: bool, nodes: int | None = None):
    resources: dict = {"colocate": colocate}
    if nodes is not None:
        resources["nodes"] = nodes
    return job_from_dict({
        "name": "inv",
        "model": {"hidden_size": 64, "num_layers": 8, "num_heads": 16, "num_kv_heads": 8},
        "trainer": {"tp": tp, "pp": pp, "dp": dp},
        "rollout": {"engines": engines, "gpus_per_engine": gpe},
        "resources": resources,
    })


def check_invariants(plan: Plan, gpus_per_node: int) -> None:
    world = plan.world_size
    per_node = plan.ranks_per_node
    trainer = list(plan.trainer_group())
    rollout = list(plan.rollout_group())

    # Counts match the spec.
    assert len(trainer) == plan.trainer_ranks == plan.tp * plan.pp * plan.dp
    assert len(rollout) == plan.rollout_ranks == plan.engines * plan.gpus_per_engine
    if plan.colocated:
        assert trainer == rollout == list(range(world)), "colocated: every rank is both"
    else:
        assert world == len(trainer) + len(rollout)
        assert not set(trainer) & set(rollout), "trainer and rollout groups are disjoint"
        assert sorted(trainer + rollout) == list(range(world)), "every rank has a role"
    assert plan.nodes * per_node >= world, "the nodes hold every rank"

    # Every GPU (or CPU slot) is used exactly once, within its node.
    used: Counter = Counter()
    coords = set()
    engine_nodes: dict[int, set[int]] = {}
    engine_members: dict[int, list[int]] = {}
    for rank in range(world):
        info = plan.info(rank)
        assert 0 <= info.node < plan.nodes
        assert 0 <= info.local_rank < per_node
        if gpus_per_node:
            assert len(info.gpus) == plan.gpus_per_rank == 1
            assert all(0 <= g < gpus_per_node for g in info.gpus)
            used.update((info.node, g) for g in info.gpus)
        else:
            assert info.gpus == ()
            used[(info.node, info.local_rank)] += 1
        expected_role = BOTH if plan.colocated else (TRAINER if rank < plan.trainer_ranks else ROLLOUT)
        assert info.role == expected_role
        if info.role in (TRAINER, BOTH):
            coord = (info.tp, info.dp, info.pp)
            assert 0 <= info.tp < plan.tp and 0 <= info.dp < plan.dp and 0 <= info.pp < plan.pp
            assert plan.trainer_rank(*coord) == rank, "trainer_rank inverts trainer_coords"
            coords.add(coord)
        if info.role in (ROLLOUT, BOTH):
            engine_nodes.setdefault(info.engine, set()).add(info.node)
            engine_members.setdefault(info.engine, []).append(rank)
            assert 0 <= info.engine_rank < plan.gpus_per_engine
    assert all(n == 1 for n in used.values()), "no GPU (slot) is used twice"
    assert sum(used.values()) == world

    # TP/PP/DP coordinates: a bijection between trainer ranks and the tp x dp x pp grid.
    assert len(coords) == len(trainer) == plan.tp * plan.dp * plan.pp

    # Engines: the right number, each of gpus_per_engine consecutive ranks, never straddling a node (or, when
    # larger than a node, made of whole nodes).
    assert sorted(engine_members) == list(range(plan.engines))
    for engine, members in engine_members.items():
        assert members == list(range(members[0], members[0] + plan.gpus_per_engine))
        nodes = engine_nodes[engine]
        if plan.gpus_per_engine <= per_node:
            assert len(nodes) == 1, f"engine {engine} straddles nodes {sorted(nodes)}"
        else:
            assert members[0] % per_node == 0 and len(nodes) == plan.gpus_per_engine // per_node
    assert plan.engine_leaders() == [m[0] for _, m in sorted(engine_members.items())]

    # Weight sync: one group per pipeline stage, sourced by that stage's (tp=0, dp=0) rank, reaching every
    # rollout rank; none when colocated (weights are updated in place).
    groups = plan.weight_sync_groups()
    if plan.colocated:
        assert groups == []
    else:
        assert [g["stage"] for g in groups] == list(range(plan.pp))
        for g in groups:
            src = g["source"]
            assert plan.trainer_coords(src) == (0, 0, g["stage"])
            assert g["ranks"][0] == src and g["ranks"][1:] == rollout
        assert len({g["source"] for g in groups}) == plan.pp

    # The plan survives its JSON form.
    assert Plan.from_dict(plan.to_dict()) == plan


# ---- small layouts ---------------------------------------------------------------------------------------

@st.composite
def layouts(draw):
    gpus, ranks = draw(st.sampled_from(SHAPES))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    pp = draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.integers(1, 4))
    colocate = draw(st.booleans())
    trainer = tp * pp * dp
    if colocate:
        gpe = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if trainer % d == 0]))
        engines = trainer // gpe
    else:
        gpe = draw(st.sampled_from([1, 2, 4, 8, 16]))
        engines = draw(st.integers(1, 4))
    extra_nodes = draw(st.sampled_from([None, 0, 1]))
    return gpus, ranks, tp, pp, dp, engines, gpe, colocate, extra_nodes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(layouts())
def test_invariants_small_layouts(layout) -> None:
    gpus, ranks, tp, pp, dp, engines, gpe, colocate, extra_nodes = layout
    part = partition(gpus, ranks, max_nodes=64)
    spec = job(tp, pp, dp, engines, gpe, colocate)
    try:
        plan = make_plan(spec, part, site="test", partition_name="p")
    except ConfigError as err:
        # Only the documented impossibilities are refused.
        assert any(k in str(err) for k in ("trainer.tp", "gpus_per_engine", "resources.nodes")), str(err)
        assume(False)
    if extra_nodes == 0:  # asking for exactly the nodes the layout needs changes nothing
        same = make_plan(job(tp, pp, dp, engines, gpe, colocate, nodes=plan.nodes), part, site="test",
                         partition_name="p")
        assert same == plan
    elif extra_nodes:  # more nodes than the layout needs would sit idle: refused (issue 31), never silently
        with pytest.raises(ConfigError, match=rf"expected resources.nodes = {plan.nodes} .* would sit idle"):
            make_plan(job(tp, pp, dp, engines, gpe, colocate, nodes=plan.nodes + extra_nodes), part, site="test",
                      partition_name="p")
    assert (plan.nodes - 1) * plan.ranks_per_node < plan.world_size, "no node is left empty"
    check_invariants(plan, gpus)


@pytest.mark.parametrize("gpus,ranks", SHAPES)
def test_every_node_is_full_when_the_layout_fills_it(gpus: int, ranks: int) -> None:
    plan = make_plan(job(2, 2, 1, 2, 2, False), partition(gpus, ranks), site="test", partition_name="p")
    check_invariants(plan, gpus)
    assert plan.world_size == 8 and plan.nodes == 8 // ranks


def test_layout_exhaustive_on_two_eight_gpu_nodes() -> None:
    """Every trainer/rollout split of up to 2 nodes x 8 GPUs the plan accepts satisfies the invariants."""
    part = partition(8, 8, max_nodes=2)
    accepted = 0
    for tp, pp, dp, engines, gpe in itertools.product([1, 2, 4, 8], [1, 2, 4], [1, 2, 3, 4], [1, 2, 3, 4],
                                                      [1, 2, 4, 8]):
        try:
            plan = make_plan(job(tp, pp, dp, engines, gpe, False), part, site="test", partition_name="p")
        except ConfigError:
            continue
        check_invariants(plan, 8)
        accepted += 1
    assert accepted > 50


# ---- 10,000 nodes x 8 GPUs -----------------------------------------------------------------------------

def test_invariants_ten_thousand_nodes() -> None:
    # Trainer: TP=8 (one node) x PP=4 x DP=1250 = 40,000 GPUs on 5,000 nodes;
    # rollout: 5,000 engines of 8 GPUs on the other 5,000 nodes.
    part = partition(8, 8, max_nodes=10_000)
    plan = make_plan(job(8, 4, 1250, 5000, 8, False), part, site="test", partition_name="p")
    assert (plan.nodes, plan.world_size) == (10_000, 80_000)
    check_invariants(plan, 8)
    # The plan stores the layout's parameters, not per-rank tables: its JSON form stays small.
    assert len(str(plan.to_dict())) < 2_000


def test_invariants_ten_thousand_nodes_colocated() -> None:
    part = partition(8, 8, max_nodes=10_000)
    plan = make_plan(job(8, 4, 2500, 10_000, 8, True), part, site="test", partition_name="p")
    assert (plan.nodes, plan.world_size) == (10_000, 80_000)
    check_invariants(plan, 8)


def test_ten_thousand_and_one_nodes_are_refused() -> None:
    part = partition(8, 8, max_nodes=10_000)
    with pytest.raises(ConfigError, match="allows 10000"):
        make_plan(job(8, 4, 1250, 5001, 8, False), part, site="test", partition_name="p")

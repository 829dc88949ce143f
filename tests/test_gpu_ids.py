"""Which GPU each SGLang engine's scheduler takes, for every shipped site and every GPU binding mode, computed by
SGLang's own code: the installed sglang's ``Engine._launch_scheduler_processes`` runs with milehpc's server
arguments and only its process start is recorded (the ``gpu_id`` it hands each scheduler), instead of a copy of
its formula (``base_gpu_id + (pp_rank % pp_size_per_node) * tp_size_per_node + (tp_rank % tp_size_per_node) *
gpu_id_step`` in sglang 0.5.23 ``entrypoints/engine.py``).

The rank's own device is what :func:`milehpc.comm.devices.choose_device` picks from the visibility Slurm sets for
the binding mode (per-task: one GPU per task; per-node: every task sees the node's GPUs), as the trainer binds it.
Issue 30 fault 2: ``base_gpu_id`` was 0 (or SGLang's default 0), so under per-node binding every engine of a node
took GPU 0, and a colocated engine sat on GPU 0 beside its trainer on GPU ``local_rank``.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from required import require_module

from milehpc.comm.devices import choose_device
from milehpc.config.load import job_from_dict, load_site
from milehpc.config.precision import resolve_precision
from milehpc.config.sglang_options import parse_options
from milehpc.plan import make_plan
from milehpc.rollout import sglang_mapping as sm
from milehpc.rollout.sglang_engine import base_gpu_id

ROOT = Path(__file__).resolve().parents[1]
SITES = sorted(p.stem for p in (ROOT / "site-configs").glob("*.toml"))
BINDINGS = ("per-task", "per-node", "none")
# The ServerArgs fields that place an engine's schedulers on GPUs (all SGLang reads for it).
PLACEMENT = ("tp_size", "nnodes", "node_rank", "dist_init_addr", "base_gpu_id", "gpu_id_step")


def gpu_partitions() -> list[tuple[str, str]]:
    out = []
    for name in SITES:
        site, _ = load_site(name)
        for part_name, part in site.partitions.items():
            if part.devices.count:
                out.append((name, part_name))
    return out


def _partition(site: str, part_name: str, binding: str) -> Any:
    part = load_site(site, job_from_dict({"name": "t", "resources": {"partition": part_name}}))[1]
    return dataclasses.replace(part, launcher=dataclasses.replace(part.launcher, gpu_binding=binding))


def _job(per_node: int, *, colocate: bool, gpus_per_engine: int) -> Any:
    """Two full nodes: colocated, both nodes' ranks are engines (the second node's start again from its first GPU);
    separate, the trainer fills node 0 and the engines node 1."""
    rollout_ranks = 2 * per_node if colocate else per_node
    rollout = {"engine": "sglang", "engines": rollout_ranks // gpus_per_engine, "gpus_per_engine": gpus_per_engine}
    trainer = {"dp": 2 * per_node if colocate else per_node}
    return job_from_dict({"name": "gpus", "rollout": rollout, "trainer": trainer,
                          "resources": {"colocate": colocate, "nodes": 2}, "run": {"loop": "sync"}})


def _visible(vendor: str, binding: str, physical: int, count: int) -> dict[str, str]:
    """What Slurm sets for a task whose GPU is ``physical``: per-task binding (``--gpus-per-task=1``) lists the task's
    GPU alone; per-node (``--gpus-per-node``) or no binding lists all of the node's."""
    var = "ROCR_VISIBLE_DEVICES" if vendor == "amd" else "CUDA_VISIBLE_DEVICES"
    ids = [physical] if binding == "per-task" else range(count)
    return {var: ",".join(map(str, ids))}


@pytest.fixture(scope="module")
def sglang_gpus(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``server_args -> [gpu_id of each scheduler this rank starts]``, by the installed sglang's launch code."""
    require_module("sglang")
    from sglang.srt import runtime_context as rc
    from sglang.srt.entrypoints import engine as eng
    from sglang.srt.server_args import ServerArgs
    from transformers import Qwen2Config

    model = tmp_path_factory.mktemp("cfg")
    Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, architectures=["Qwen2ForCausalLM"]).save_pretrained(model)

    @functools.cache
    def launch(placement: tuple[tuple[str, Any], ...]) -> tuple[int, ...]:
        args = ServerArgs(model_path=str(model), device="cpu", attention_backend="torch_native",
                          skip_tokenizer_init=True, **dict(placement))
        args.resolve_once()
        started: list[tuple[Any, ...]] = []

        class Recorder:  # the scheduler process, recorded instead of started
            def __init__(self, target: Any = None, args: tuple[Any, ...] = (), kwargs: Any = None) -> None:
                started.append(args)
                self.pid = None

            def start(self) -> None:
                pass

        before = rc.snapshot_context()
        real_mp = eng.mp
        try:
            rc.publish(args, role="tokenizer")
            eng.mp = SimpleNamespace(Process=Recorder, Pipe=multiprocessing.Pipe)
            eng.Engine._launch_scheduler_processes(args, None, lambda *a: None)
        finally:
            eng.mp = real_mp
            rc.restore_context(before)
        # (server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe): fail here if sglang moved gpu_id
        assert started and all(len(a) == 7 and a[0] is args for a in started), started
        return tuple(int(a[2]) for a in started)

    def gpus(server_args: dict[str, Any]) -> list[int]:
        return list(launch(tuple((k, server_args[k]) for k in PLACEMENT if k in server_args)))

    return gpus


@pytest.mark.parametrize("binding", BINDINGS)
@pytest.mark.parametrize(("site", "part_name"), gpu_partitions())
def test_each_engine_schedules_on_its_ranks_own_gpu(site: str, part_name: str, binding: str, sglang_gpus: Any,
                                                     ) -> None:
    """Every shipped GPU partition, in every binding mode, colocated or not, with engines of 1 and 2 ranks: each
    rollout rank's SGLang scheduler takes the GPU its rank was bound to (the trainer's GPU when colocated), which is
    the plan's GPU for that rank, and no two engines of a node share one."""
    part = _partition(site, part_name, binding)
    per_node, count = part.slots_per_node, part.devices.count
    checked = 0
    for colocate in (True, False):
        for gpus_per_engine in (1, 2):
            job = _job(per_node, colocate=colocate, gpus_per_engine=gpus_per_engine)
            plan = make_plan(job, part, site=site, partition_name=part_name)
            opts, precision = parse_options(job.rollout.options), resolve_precision(job)
            taken: dict[int, dict[int, int]] = {}  # node -> physical GPU -> rank
            for rank in plan.rollout_group():
                info = plan.info(rank)
                mine = info.gpus[0]  # the node-local GPU the plan gives this rank
                env = _visible(plan.device_vendor, binding, mine, count)
                bound = choose_device(plan.device_vendor, info.local_rank, plan.ranks_per_node, env)
                assert plan.device_index(rank) == bound.index, (rank, bound.why)
                # What the rank's engine factory computes: from the device the rank was bound to, or from the plan.
                for device in (SimpleNamespace(type="cuda", index=bound.index), None):
                    ctx = SimpleNamespace(plan=plan, comms=SimpleNamespace(rank=rank, device=device))
                    layout = sm.EngineLayout(engine=info.engine, engine_rank=info.engine_rank,
                                             gpus_per_engine=plan.gpus_per_engine, port=30000,
                                             dist_init_addr="127.0.0.1:5000" if plan.gpus_per_engine > 1 else None,
                                             base_gpu_id=base_gpu_id(ctx))
                    args = sm.server_args(job, opts, precision, layout, model_path="/m", tokenizer_path=None)
                    (gpu,) = sglang_gpus(args)  # one SGLang "node" of one GPU per rank
                    assert gpu == bound.index, (site, binding, rank, args)
                    visible = env[next(iter(env))].split(",")
                    assert int(visible[gpu]) == mine, (site, binding, rank, visible, gpu)
                owner = taken.setdefault(info.node, {}).setdefault(mine, rank)
                assert owner == rank, f"ranks {owner} and {rank} both on GPU {mine} of node {info.node}"
                checked += 1
    assert checked > 0


def test_the_old_base_gpu_id_puts_every_engine_of_a_node_on_gpu_0(sglang_gpus: Any) -> None:
    """The check above can fail: with base_gpu_id = 0 (what milehpc passed before) on a per-node site, SGLang puts the
    schedulers of all eight engines of a DGX node on GPU 0."""
    args = {"tp_size": 1, "base_gpu_id": 0}
    assert {sglang_gpus(args)[0] for _ in range(8)} == {0}
    assert sglang_gpus({"tp_size": 2, "nnodes": 2, "node_rank": 1, "dist_init_addr": "127.0.0.1:5000",
                        "base_gpu_id": 5}) == [5]
    assert sglang_gpus({"tp_size": 2, "base_gpu_id": 4}) == [4, 5]  # one SGLang node of two GPUs: consecutive

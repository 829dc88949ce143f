"""The rank layout of a job: a pure function of the job spec and the site partition (no I/O).

One MPI world holds both groups. Without colocation the trainer ranks come first (ranks 0..T-1, Megatron's
order: TP fastest, then DP, then PP) and the rollout ranks follow (R = engines * gpus_per_engine, engine by
engine), then the reward-model ranks when the job has ``[reward_model]`` ranks of its own (W = engines *
gpus_per_engine; its ``colocate = "rollout"`` puts the scorer on the rollout ranks instead). With colocation every
trainer rank is also a rollout rank. Each rank drives one GPU (none on CPU sites). The plan stores
only the layout's parameters, so a 10,000-node plan is as small as a 1-node one; per-rank facts are computed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from milehpc.config.job import JobSpec
from milehpc.config.shape import ModelShape, table_shape
from milehpc.config.site import Partition
from milehpc.errors import ConfigError

TRAINER, ROLLOUT, BOTH, REWARD = "trainer", "rollout", "both", "reward"


@dataclass(frozen=True)
class RankInfo:
    rank: int
    role: str
    node: int
    local_rank: int
    gpus: tuple[int, ...]  # node-local GPU indices this rank drives
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    engine: int | None = None  # rollout (or reward-model) engine index
    engine_rank: int | None = None  # rank within the engine


@dataclass(frozen=True)
class Plan:
    job_name: str
    site: str
    partition: str
    nodes: int
    ranks_per_node: int
    world_size: int
    colocated: bool
    device_vendor: str  # nvidia | amd | none
    backend: str  # nccl | gloo
    gpus_per_rank: int
    trainer_ranks: int
    tp: int
    pp: int
    dp: int
    ep: int
    rollout_first: int
    rollout_ranks: int
    engines: int
    gpus_per_engine: int
    # The site launcher's GPU binding (config.site.Launcher.gpu_binding): what each rank's process sees. Defaulted so
    # a plan.json written before the field existed still loads (it then means Slurm's usual per-task binding).
    gpu_binding: str = "per-task"
    # The reward-model group ([reward_model]): ranks of its own after the rollout ranks, or (reward_colocated) its
    # scorer on each rollout engine leader. Defaulted: a plan.json from before the group existed has none.
    reward_first: int = 0
    reward_ranks: int = 0
    reward_engines: int = 0
    reward_gpus_per_engine: int = 1
    reward_colocated: bool = False
    # resources.elastic_rollout: the trainer ranks are one MPI world (one srun step) and each rollout node's engines a
    # step of their own, joining trainer rank 0 over TCP (milehpc.runtime.elastic); spare_nodes are allocated beyond
    # the layout for engines started again after a rollout step failed.
    elastic: bool = False
    spare_nodes: int = 0

    # ---- per-rank facts -------------------------------------------------
    def role(self, rank: int) -> str:
        self._check(rank)
        if self.reward_ranks and rank >= self.reward_first:
            return REWARD
        if self.colocated:
            return BOTH
        return TRAINER if rank < self.trainer_ranks else ROLLOUT

    def is_trainer(self, rank: int) -> bool:
        return self.role(rank) in (TRAINER, BOTH)

    def is_rollout(self, rank: int) -> bool:
        return self.role(rank) in (ROLLOUT, BOTH)

    def is_reward(self, rank: int) -> bool:
        """A rank of the reward-model group's own (not a rollout rank that scores beside its engine)."""
        return self.role(rank) == REWARD

    def node_of(self, rank: int) -> int:
        self._check(rank)
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def trainer_coords(self, rank: int) -> tuple[int, int, int]:
        """(tp, dp, pp) of a trainer rank, in Megatron's default order (tp fastest, then dp, then pp)."""
        if not self.is_trainer(rank):
            raise ValueError(f"rank {rank} is not a trainer rank")
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def trainer_rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def engine_of(self, rank: int) -> tuple[int, int]:
        """(engine index, rank within the engine) of a rollout rank."""
        if not self.is_rollout(rank):
            raise ValueError(f"rank {rank} is not a rollout rank")
        offset = rank - self.rollout_first
        return offset // self.gpus_per_engine, offset % self.gpus_per_engine

    def reward_engine_of(self, rank: int) -> tuple[int, int]:
        """(reward-model engine index, rank within it) of a reward rank."""
        if not self.is_reward(rank):
            raise ValueError(f"rank {rank} is not a reward rank")
        offset = rank - self.reward_first
        return offset // self.reward_gpus_per_engine, offset % self.reward_gpus_per_engine

    def reward_leaders(self) -> list[int]:
        """The reward ranks that run a scorer (each engine's first)."""
        return [self.reward_first + e * self.reward_gpus_per_engine
                for e in range(self.reward_engines if self.reward_ranks else 0)]

    def reward_leader_for(self, engine: int) -> int:
        """The reward rank that scores rollout engine ``engine``'s samples (engines dealt round-robin)."""
        return self.reward_leaders()[engine % self.reward_engines]

    def device_index(self, rank: int) -> int | None:
        """The index of this rank's GPU among the devices its process sees (None without GPUs): what
        ``torch.cuda.set_device`` and SGLang's ``base_gpu_id`` take. Per-task binding shows each rank its own GPU
        alone (index 0); per-node binding, or none, shows the node's GPUs (the rank's node-local one, as
        :func:`milehpc.comm.devices.choose_device` picks it)."""
        if not self.gpus_per_rank:
            return None
        return 0 if self.gpu_binding == "per-task" else self.info(rank).gpus[0]

    def engine_leaders(self) -> list[int]:
        return [self.rollout_first + e * self.gpus_per_engine for e in range(self.engines)]

    def info(self, rank: int) -> RankInfo:
        role = self.role(rank)
        local = self.local_rank(rank)
        gpus = tuple(range(local * self.gpus_per_rank, (local + 1) * self.gpus_per_rank))
        tp = pp = dp = engine = engine_rank = None
        if role in (TRAINER, BOTH):
            tp, dp, pp = self.trainer_coords(rank)
        if role in (ROLLOUT, BOTH):
            engine, engine_rank = self.engine_of(rank)
        if role == REWARD:
            engine, engine_rank = self.reward_engine_of(rank)
        return RankInfo(rank, role, self.node_of(rank), local, gpus, tp, pp, dp, engine, engine_rank)

    # ---- groups -----------------------------------------------------------
    def trainer_group(self) -> range:
        return range(0, self.trainer_ranks)

    def rollout_group(self) -> range:
        return range(self.rollout_first, self.rollout_first + self.rollout_ranks)

    def reward_group(self) -> range:
        return range(self.reward_first, self.reward_first + self.reward_ranks)

    def weight_sync_groups(self) -> list[dict[str, Any]]:
        """One group per pipeline stage (as slime does): that stage's leader (tp=0, dp=0) and every rollout rank.
        Colocated runs update in place and have none."""
        if self.colocated or not self.rollout_ranks:
            return []
        return [
            {"stage": pp, "source": self.trainer_rank(0, 0, pp), "ranks": [self.trainer_rank(0, 0, pp),
                                                                         *self.rollout_group()]}
            for pp in range(self.pp)
        ]

    # ---- elastic rollout ---------------------------------------------------
    def trainer_only(self) -> Plan:
        """The trainer step's own world (elastic rollout): the trainer ranks alone, no rollout rank in it."""
        return replace(self, world_size=self.trainer_ranks, rollout_first=self.trainer_ranks, rollout_ranks=0,
                       engines=0, nodes=math.ceil(self.trainer_ranks / self.ranks_per_node), spare_nodes=0,
                       reward_first=self.trainer_ranks, reward_ranks=0, reward_engines=0)

    def rollout_steps(self) -> list[tuple[int, int, int]]:
        """Elastic rollout: one ``(node, first engine, engines)`` per rollout node (node = index in the allocation)."""
        out = []
        for e in range(0, self.engines, self.ranks_per_node):
            out.append((self.node_of(self.rollout_first + e), e, min(self.ranks_per_node, self.engines - e)))
        return out

    # ---- (de)serialisation ---------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(**data)

    def summary(self) -> dict[str, Any]:
        if self.elastic:  # the engines join over TCP, each with a weight-sync group of its own
            return {**self._summary(), "weight_sync_groups": "one per engine (elastic)",
                    "elastic_rollout": f"a job step per rollout node, {self.spare_nodes} spare node(s)"}
        return self._summary()

    def _summary(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
            "trainer": f"ranks 0-{self.trainer_ranks - 1} (tp={self.tp} pp={self.pp} dp={self.dp} ep={self.ep})",
            "rollout": (f"ranks {self.rollout_first}-{self.rollout_first + self.rollout_ranks - 1} "
                        f"({self.engines} engine(s) x {self.gpus_per_engine})"),
            **({"reward": self.reward_text()} if self.reward_ranks or self.reward_colocated else {}),
            "colocated": self.colocated, "backend": self.backend,
            "weight_sync_groups": len(self.weight_sync_groups()),
        }

    def reward_text(self) -> str:
        """Where the reward model runs, in words (``plan``'s summary and the job script's header)."""
        if self.reward_colocated:
            return f"on the rollout engine leaders ({self.engines} scorer(s))"
        last = self.reward_first + self.reward_ranks - 1
        return f"ranks {self.reward_first}-{last} ({self.reward_engines} engine(s) x {self.reward_gpus_per_engine})"

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")


def make_plan(job: JobSpec, partition: Partition, *, site: str, partition_name: str, file: str | None = None,
              shape: ModelShape | None = None) -> Plan:
    """Lay out ranks for ``job`` on ``partition``; impossible layouts raise a one-line ConfigError. ``shape`` is the
    model's (:func:`milehpc.config.shape.model_shape`: a checkpoint folder's config.json); None = the [model]
    table's (this function reads no file)."""
    tr, ro = job.trainer, job.rollout
    per_node = partition.slots_per_node
    gpus = partition.devices.count
    gpus_per_rank = 1 if gpus else 0
    if gpus and per_node > gpus:
        raise ConfigError(f"expected at most {gpus} ranks per node (one per GPU), got {per_node}",
                          file=file, field="site.ranks_per_node")
    if tr.tp > per_node:
        raise ConfigError(f"expected trainer.tp <= the {per_node} GPUs (ranks) of one node, got {tr.tp}",
                          file=file, field="trainer.tp")
    rm = job.reward_model
    _check_engine_size(ro.gpus_per_engine, per_node, "rollout.gpus_per_engine", file)
    if rm.own_ranks:
        _check_engine_size(rm.gpus_per_engine, per_node, "reward_model.gpus_per_engine", file)
    if tr.ep > 1 and (tr.dp * tr.tp) % tr.ep:
        raise ConfigError(f"expected trainer.ep to divide dp*tp ({tr.dp * tr.tp}), got {tr.ep}",
                          file=file, field="trainer.ep")
    check_shape(job, shape or table_shape(job.model), file=file)
    trainer_ranks = tr.ranks
    rollout_ranks = ro.engines * ro.gpus_per_engine
    if job.resources.colocate:
        world, rollout_first = trainer_ranks, 0
    else:
        rollout_first = trainer_ranks
        _check_engine_start(trainer_ranks, ro.gpus_per_engine, per_node, "rollout", f"the trainer's {trainer_ranks}",
                            "make the trainer ranks a multiple of", file)
        world = trainer_ranks + rollout_ranks
    reward_first, reward_ranks = world, rm.engines * rm.gpus_per_engine if rm.own_ranks else 0
    if reward_ranks:
        _check_engine_start(world, rm.gpus_per_engine, per_node, "reward_model", f"the {world} trainer and rollout",
                            "make the trainer and rollout ranks together a multiple of", file)
        world += reward_ranks
    elastic = job.resources.elastic_rollout and not job.resources.colocate
    if elastic and partition.scheduler == "slurm" and trainer_ranks % per_node:
        raise ConfigError(f"expected the trainer's ranks to fill whole nodes of {per_node} with "
                          f"resources.elastic_rollout (a rollout node is a job step of its own), got {trainer_ranks}",
                          file=file, field="trainer.dp")
    nodes = math.ceil(world / per_node)
    if job.resources.nodes is not None:
        if job.resources.nodes < nodes:
            raise ConfigError(f"the layout needs {nodes} node(s) of {per_node} ranks, got {job.resources.nodes}",
                              file=file, field="resources.nodes")
        if job.resources.nodes > partition.max_nodes:
            raise ConfigError(f"the layout needs {job.resources.nodes} node(s); partition '{partition_name}' allows "
                              f"{partition.max_nodes}", file=file, field="resources.nodes")
        if job.resources.nodes > nodes:  # Slurm would allocate them and no rank would run there
            raise ConfigError(f"expected resources.nodes = {nodes} (the layout's {world} ranks fill {nodes} node(s) "
                              f"of {per_node}; {job.resources.nodes - nodes} more would sit idle): add rollout engines "
                              f"or trainer ranks to use them, or leave resources.nodes unset, got {job.resources.nodes}",
                              file=file, field="resources.nodes")
    if nodes > partition.max_nodes:
        raise ConfigError(f"the layout needs {nodes} node(s); partition '{partition_name}' allows {partition.max_nodes}",
                          file=file, field="resources.nodes")
    spare = job.resources.spare_nodes if elastic else 0
    if nodes + spare > partition.max_nodes:
        raise ConfigError(f"the layout's {nodes} node(s) and {spare} spare(s) exceed the {partition.max_nodes} of "
                          f"partition '{partition_name}'", file=file, field="resources.spare_nodes")
    backend = "nccl" if partition.devices.vendor in ("nvidia", "amd") else "gloo"
    return Plan(
        job_name=job.name, site=site, partition=partition_name, nodes=nodes, ranks_per_node=per_node,
        world_size=world, colocated=job.resources.colocate, device_vendor=partition.devices.vendor,
        backend=backend, gpus_per_rank=gpus_per_rank, trainer_ranks=trainer_ranks, tp=tr.tp, pp=tr.pp, dp=tr.dp,
        ep=tr.ep, rollout_first=rollout_first, rollout_ranks=rollout_ranks, engines=ro.engines,
        gpus_per_engine=ro.gpus_per_engine, gpu_binding=partition.launcher.gpu_binding,
        reward_first=reward_first, reward_ranks=reward_ranks, reward_engines=rm.engines if reward_ranks else 0,
        reward_gpus_per_engine=rm.gpus_per_engine if reward_ranks else 1,
        reward_colocated=rm.enabled and rm.colocate == "rollout",
        elastic=elastic, spare_nodes=job.resources.spare_nodes if elastic else 0,
    )


def _check_engine_size(g: int, per_node: int, field: str, file: str | None) -> None:
    """An engine of ``g`` ranks fills part of one node evenly, or whole nodes."""
    if g > per_node and g % per_node:
        raise ConfigError(f"expected {field} to fit a node ({per_node}) or be a multiple of it, got {g}",
                          file=file, field=field)
    if g <= per_node and per_node % g:
        raise ConfigError(f"expected {field} to divide the {per_node} GPUs (ranks) of a node, got {g}",
                          file=file, field=field)


def _check_engine_start(first: int, g: int, per_node: int, table: str, before: str, fix: str,
                        file: str | None) -> None:
    """Engines must not straddle nodes: the group's first rank ``first`` must lie on a boundary of an engine's size."""
    align = min(g, per_node)
    if first % align:
        raise ConfigError(f"{before} ranks leave part of a node that {table.replace('_', ' ')} engines of {g} GPUs "
                          f"cannot fill; {fix} {align}", file=file, field=f"{table}.gpus_per_engine")


def check_shape(job: JobSpec, shape: ModelShape, *, file: str | None = None) -> None:
    """The trainer's and the engines' splits against the model's shape: TP over the attention heads (and the KV
    heads: split, or replicated when TP is a multiple of them), PP over the layers, EP over the experts, each engine's
    TP likewise, and top-k within the experts. Messages name where the shape came from (config.json or [model])."""
    tr, ro, src = job.trainer, job.rollout, shape.source
    heads, kv = shape.num_heads, shape.num_kv_heads
    splits = [("trainer.tp", tr.tp)]
    if ro.engine in ("sglang", "vllm"):  # an engine of N ranks runs TP = N (the reference engine keeps a whole copy)
        splits.append(("rollout.gpus_per_engine", ro.gpus_per_engine))
    for field, tp in splits:
        if heads % tp:
            raise ConfigError(f"expected {field} to divide the model's {heads} attention heads ({src}), got {tp}",
                              file=file, field=field)
        if kv % tp and tp % kv:
            raise ConfigError(f"expected {field} to divide the model's {kv} KV heads ({src}), or be a multiple of them "
                              f"(each rank then keeps a copy), got {tp}", file=file, field=field)
    if shape.num_layers % tr.pp:
        raise ConfigError(f"expected trainer.pp to divide the model's {shape.num_layers} layers ({src}), got {tr.pp}",
                          file=file, field="trainer.pp")
    experts = shape.num_experts
    if tr.ep > 1 and not experts:
        raise ConfigError(f"expected trainer.ep = 1 for a dense model ({src} has no experts), got {tr.ep}",
                          file=file, field="trainer.ep")
    if experts and tr.ep > experts:  # divisibility: milehpc.config.rules.megatron_ep_divides_the_experts
        raise ConfigError(f"expected trainer.ep <= the model's {experts} experts ({src}), got {tr.ep}",
                          file=file, field="trainer.ep")
    if experts and shape.moe_top_k > experts:
        raise ConfigError(f"expected at most the model's {experts} experts per token ({src}), got {shape.moe_top_k}",
                          file=file, field="model.moe_top_k")

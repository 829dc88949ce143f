"""One rollout rank's side of the loop: take prompts, generate (partial rollouts, over-sampling, the dynamic
filter), score, and keep what was sent to the trainer until it is trained (the outbox).

Engine leaders produce batches; the other ranks of a multi-rank engine only take part in weight updates.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from milehpc.config.job import ROLLOUT_LOOP_OPTIONS
from milehpc.data.images import prompt_images
from milehpc.faults import maybe_fail
from milehpc.runtime.loop.rollout_metrics import PART, new_stats
from milehpc.runtime.loop.state import LoopState
from milehpc.samples import Group, Sample, Status
from milehpc.samples.sample import AGENT_COUNTS

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec
    from milehpc.rollout.engine import Engine
    from milehpc.weights.converters import NamedTensors


@dataclass
class SentBatch:
    """A batch sent to the trainer and not yet known to be trained (kept for a checkpoint to hold it)."""

    batch: int
    groups: list[Group]
    stats: dict[str, float]


def generator_context(generator: Callable[..., Any], tokenizer: Any, file: str | None,
                      job: JobSpec | None = None) -> dict[str, Any]:
    """What a generator may ask for by keyword: ``run_dir`` (the private run directory, None in a local run),
    ``tokenizer`` (the job's; the agent generator's endpoint renders chat templates with it) and ``model_type`` (the
    model's family: the agent generator's default tool-call parser)."""
    import inspect
    from pathlib import Path

    accepts = inspect.signature(generator).parameters
    known: dict[str, Any] = {"run_dir": str(Path(file).parent) if file else None, "tokenizer": tokenizer}
    if "model_type" in accepts and job is not None:
        from milehpc.config.families import job_model_type

        known["model_type"] = job_model_type(job)
    return {k: v for k, v in known.items() if k in accepts}


class RemoteScoring(Protocol):
    """Scoring outside the plain generate-then-score (:class:`milehpc.runtime.loop.reward_side.RewardClient`: on
    reward ranks; :class:`milehpc.runtime.loop.colocated_reward.ColocatedScoring`: here, the RM released while the
    engine generates): generates ``prompts`` with ``side`` and returns the finished groups, scored."""

    def generate_and_score(self, side: RolloutSide, prompts: list[Any], stats: dict[str, float]) -> list[Group]: ...


class RolloutSide:
    """One rollout rank (see the module docstring)."""

    def __init__(self, job: JobSpec, engine: Engine, *, engine_index: int = 0, num_engines: int = 1,
                 leader: bool = True, file: str | None = None) -> None:
        from milehpc import plugins
        from milehpc.config.schema import merge_params
        from milehpc.data.source import build_source, task_reward_name
        from milehpc.data.tokenizer import build_tokenizer
        from milehpc.rewards.routing import reward_scorer
        from milehpc.rollout.reference import sampling_from_spec

        self.job, self.engine, self.leader = job, engine, leader
        self.e, self.E = engine_index, num_engines
        ro = job.rollout
        self.tokenizer = build_tokenizer(job.model.tokenizer)
        # Multi-LoRA: the adapters' own streams, mixed per step; each adapter's reward (rewards.routing)
        self.multi = job.trainer.lora is not None and bool(job.trainer.lora.adapters)
        if self.multi:
            from milehpc.data.adapters import adapter_mix
            from milehpc.rewards.routing import adapter_scorer

            self.source: Any = adapter_mix(job, self.tokenizer, file=file)
            self.scorer: Any = adapter_scorer(job, file=file)
        else:
            self.source = build_source(job.data, self.tokenizer, file=file)
            self.scorer = reward_scorer(job.reward, task_reward_name(job.data) or None,
                                        sources=self.source.data_sources, file=file)
        if leader and engine_index == 0 and self.source.summary:  # once per job: what was read, what was dropped
            print(self.source.summary, flush=True)
        self.sampling = sampling_from_spec(ro, self.tokenizer)
        self.generator: Callable[..., list[Sample]] | None = None
        self.generator_params: dict[str, Any] = {}
        self.generator_context: dict[str, Any] = {}
        if ro.generator:
            spec = plugins.lookup("generator", ro.generator, file=file, field="rollout.generator")
            self.generator_params = merge_params(spec.defaults, ro.generator_params)  # checked on the login node
            self.generator = plugins.load("generator", ro.generator)
            self.generator_context = generator_context(self.generator, self.tokenizer, file, job)
        self.options = {**ROLLOUT_LOOP_OPTIONS, **ro.options}
        self.state = LoopState()
        # This engine's quota of each step's prompts.
        self.quota = ro.prompts_per_step // num_engines + (engine_index < ro.prompts_per_step % num_engines)
        self._cursor = 0  # this engine's own prompt counter; global position = cursor * E + e
        self.outbox: list[SentBatch] = []  # sent to the trainer, not yet trained
        # [reward_model] ranks of their own: the samples are scored there (runtime.loop.reward_side), else here
        self.remote: RemoteScoring | None = None
        # [reward_model] colocate = "rollout": the RM beside the engine, off the device while it generates
        if leader and job.reward_model.enabled and job.reward_model.colocate == "rollout":
            from milehpc.runtime.loop.colocated_reward import ColocatedScoring

            self.remote = ColocatedScoring(self)
        # Seconds the driver spent on weights since the last batch (waiting, loading): reported with the next one.
        self.weight_times: dict[str, float] = {}

    # -- prompts --
    def _take(self, k: int) -> list[Any]:
        out = [self.source.peek(c * self.E + self.e) for c in range(self._cursor, self._cursor + k)]
        self._cursor += k
        return out

    # -- one batch --
    def produce(self) -> tuple[list[Group], dict[str, float]]:
        """Groups for the next step (scored, filtered) and raw counters for the metrics."""
        ro = self.job.rollout
        maybe_fail("generate", self.state.step)
        stats = new_stats()
        stats.update(self.weight_times)
        self.weight_times = {}
        need = self.quota
        groups, self.state.ready = self.state.ready[:need], self.state.ready[need:]
        rounds = 0
        while len(groups) < need and rounds < int(self.options["max_filter_rounds"]):
            rounds += 1
            want = need - len(groups)
            k = math.ceil(want * ro.over_sample) if ro.dynamic_filter or ro.over_sample > 1 else want
            if self.remote is not None:
                finished = self.remote.generate_and_score(self, self._take(k), stats)
            else:
                t0 = time.perf_counter()
                finished = self._generate(self._take(k), stats)
                stats["time_gen"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                self._score([s for g in finished for s in g if s.reward is None])
                stats["time_reward"] += time.perf_counter() - t0
            for g in finished:
                self._count(g, stats)
                rewards = {round(s.scalar_reward, 9) for s in g if s.status is not Status.FAILED}
                if ro.dynamic_filter and len(rewards) <= 1:
                    stats["filtered"] += 1
                else:
                    groups.append(g)
            if not ro.dynamic_filter and not ro.partial_rollout:
                break
        if len(groups) > need:
            self.state.ready.extend(groups[need:])
            groups = groups[:need]
        stats["groups"] = len(groups)
        stats["carried"] = len(self.state.carry)
        stats["engine_restarts"] = float(getattr(self.engine, "restarts", 0))  # in place, since this process began
        self.state.step += 1
        self.state.data = {"cursor": self._cursor}  # (multi-LoRA: the cursor alone positions every adapter's stream)
        return groups, stats

    def generate_one(self, prompt: Any, seed: int) -> tuple[Group, dict[str, float]]:
        """One prompt's group, sampled from ``seed`` alone (elastic rollout: whichever engine generates it), scored;
        and its raw counters for the metrics."""
        stats = new_stats()
        base = self.sampling
        self.sampling = replace(base, seed=seed)
        t0 = time.perf_counter()
        try:
            [group] = self._generate([prompt], stats)
        finally:
            self.sampling = base
        stats["time_gen"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        self._score([s for s in group if s.reward is None])
        stats["time_reward"] += time.perf_counter() - t0
        self._count(group, stats)
        stats["groups"] = 1
        return group, stats

    def _count(self, group: Group, stats: dict[str, float]) -> None:
        if self.multi:
            from milehpc.runtime.loop.adapter_streams import count_by_adapter

            count_by_adapter(group, stats)
        for s in group:
            for key, value in s.metadata.get(AGENT_COUNTS, {}).items():  # the agent generator's episode counts
                stats[f"agent/{key}"] = stats.get(f"agent/{key}", 0.0) + value
            stats["samples"] += 1
            stats["resp_tokens"] += len(s.response_ids)
            stats["failed"] += s.status is Status.FAILED
            stats["truncated"] += s.status is Status.TRUNCATED
            if s.status is not Status.FAILED:
                r = s.scalar_reward
                stats["reward_sum"] += r
                stats["reward_sq"] += r * r
                stats["scored"] += 1
                if isinstance(s.reward, dict):  # a reward's parts (combine, model scores): reward/<part> metrics
                    for key, value in s.reward.items():
                        if key != "score":
                            stats[f"{PART}{key}"] = stats.get(f"{PART}{key}", 0.0) + value

    def _generate(self, prompts: list[Any], stats: dict[str, float]) -> list[Group]:
        """Generate for ``prompts`` (and continue partial rollouts); returns the groups that finished."""
        ro = self.job.rollout
        version = self.state.weight_version
        before = self.engine.tokens_generated
        if self.generator is not None:
            out = self.generator(self.engine, prompts, self.sampling, **self.generator_params,
                                 **self.generator_context)
        else:
            sp = self.sampling
            if ro.partial_rollout:
                chunk = int(self.options["partial_chunk"]) or max(1, ro.max_new_tokens // 2)
                sp = replace(sp, max_new_tokens=chunk)
                cont = [s for s in self.state.carry if s.status is Status.ABORTED]
                if cont:
                    self.engine.generate([], replace(sp, n=1), samples=cont)
            if self.multi:  # every prompt with its adapter, in one engine call
                from milehpc.samples import ADAPTER_KEY

                sp = replace(sp, adapters=[p.metadata[ADAPTER_KEY] for p in prompts])
            if (shown := prompt_images(prompts)) is not None:  # a VL model's image prompts (by reference)
                sp = replace(sp, images=shown)
            out = self.engine.generate([p.ids for p in prompts], sp) if prompts else []
        for s in out:  # engine-local group index → the prompt's stream position
            p = prompts[s.group]
            s.group, s.label, s.prompt_text = p.index, p.label, p.text
            s.metadata.update(p.metadata)
            s.weight_version = version
        for j, s in enumerate(out):
            s.index = s.group * ro.n_samples + j % ro.n_samples
        if self.generator is None:  # a generator sets its own text (e.g. with the environment's turns)
            for s in out:
                s.response_text = self.tokenizer.decode(s.response_ids)
        stats["gen_tokens"] += self.engine.tokens_generated - before
        if not ro.partial_rollout:
            groups: dict[int, Group] = {}
            for s in out:
                groups.setdefault(s.group, []).append(s)
            return list(groups.values())
        return self._regroup(self.state.carry + out)

    def _regroup(self, samples: list[Sample]) -> list[Group]:
        """Partial rollouts: a sample cut at the chunk budget is ABORTED and carried; a group is finished (and
        leaves the carry) once all its samples are."""
        cap = self.job.rollout.max_new_tokens
        for s in samples:
            if len(s.response_ids) > cap:  # a continuation may overshoot the total budget: cut it back
                s.response_ids, s.rollout_logprobs = s.response_ids[:cap], s.rollout_logprobs[:cap]
                s.loss_mask = s.loss_mask[:cap]
                s.response_text = self.tokenizer.decode(s.response_ids)
                s.status = Status.TRUNCATED
            elif s.status is Status.TRUNCATED and len(s.response_ids) < cap:
                s.status = Status.ABORTED
            elif s.status is Status.ABORTED and len(s.response_ids) >= cap:
                s.status = Status.TRUNCATED
        by_group: dict[int, Group] = {}
        for s in samples:
            by_group.setdefault(s.group, []).append(s)
        finished, carry = [], []
        for g in by_group.values():
            if any(s.status is Status.ABORTED for s in g):
                carry.extend(g)
            else:
                finished.append(g)
        self.state.carry = carry
        return finished

    def _score(self, samples: list[Sample]) -> None:
        if samples:
            self.scorer.score(samples)

    # -- weights --
    def update_weights(self, named: NamedTensors, version: int) -> None:
        """Hand received weights to the engine and record their version (a weight sink for ``weights.sync``)."""
        self.engine.update_weights(named, version)
        self.state.weight_version = version

    # -- the outbox (separate groups) --
    def add_time(self, key: str, seconds: float) -> None:
        """Count ``seconds`` of weight handling (``time_wait_weights``, ``time_load_weights``) into the next batch's
        stats."""
        self.weight_times[key] = self.weight_times.get(key, 0.0) + seconds

    def sent(self, batch: int, groups: list[Group], stats: dict[str, float]) -> None:
        """A batch went to the trainer: keep it until it is trained."""
        self.outbox.append(SentBatch(batch, groups, stats))

    def trained(self, version: int) -> None:
        """Weights of ``version`` arrived: the trainer has trained every batch before ``version``."""
        self.outbox = [o for o in self.outbox if o.batch >= version]

    # -- checkpoint --
    def state_dict(self) -> dict[str, Any]:
        """Scalars and the engine's state (its sampling RNG); the samples are in :meth:`sample_buffers`."""
        return {"loop": self.state.state_dict(), "cursor": self._cursor, "engine": self.engine.state_dict(),
                "outbox": [(o.batch, o.stats) for o in self.outbox]}

    def sample_buffers(self) -> dict[str, Any]:
        """The sample buffers of this rank: partial rollouts, over-sampled groups and each outbox batch."""
        return {**self.state.sample_buffers(), **{f"outbox_{o.batch}": o.groups for o in self.outbox}}

    def load_state_dict(self, state: dict[str, Any], buffers: dict[str, Any]) -> None:
        self.state.load_state_dict(state["loop"], buffers)
        self._cursor = int(state["cursor"])
        if "engine" in state:
            self.engine.load_state_dict(state["engine"])
        self.outbox = [SentBatch(b, buffers[f"outbox_{b}"], stats) for b, stats in state.get("outbox", [])]

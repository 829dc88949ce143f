"""The RL loop that runs inside the job: rollout ranks generate and score, trainer ranks learn, weights go back.

Layouts (from the plan):

* **separate groups** (trainer ranks 0..T-1, rollout ranks after): engine leaders generate their share of each
  step's prompts, score them and send the finished groups to trainer rank 0 over MPI; rank 0 deals whole groups
  to the DP ranks, every trainer rank takes one optimizer step, and the stage leader(s) broadcast the new weights
  to the rollout ranks (``runtime.weights``). Loop modes:

  - ``sync``: batch k is generated with the weights after step k-1 (staleness 0);
  - ``one_step_off``: batch k+1 is generated while step k trains, with the weights after step k-1; the rollout
    side takes new weights only between generations, never during one (the Miles rule), at fixed points;
  - ``async``: the rollout side keeps generating and picks up whatever weights have arrived between generations,
    running at most ``run.max_staleness`` batches ahead; the trainer drops (``stale_policy = "drop"``) or keeps for
    off-policy correction (``"correct"``) groups whose samples are older than that, and counts them.

  Every weight update is announced by a small MPI notice (version, or stop) before the broadcast, so a rollout
  rank can poll for it between generations without blocking; the final notice is a stop, answered by a "bye"
  from each engine leader after its last batch, so nothing is left in flight at shutdown.
* **colocated** (every rank both): each rank generates its share, trains on it (DP over all ranks), and loads the
  new weights into its engine in place. Only ``sync`` makes sense here.
* **local** (:func:`run_local`): the colocated loop in one process without MPI, for tests, notebooks and
  benchmarks.

All loop state of a rank (step, data cursor, partial rollouts, over-sampled groups, async buffer, weight version,
RNG) lives in one :class:`LoopState` with ``state_dict``/``load_state_dict``; each side's ``state_dict`` adds the
engine's or trainer's own state, for the checkpoint code to save and restore. ``checkpoint_hook(side, step)`` is
called after every step on every rank when set.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError, RuntimeFailure
from milehpc.rollout.sample import Sample, Status

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec

TAG_BATCH, TAG_NOTICE, TAG_SHARE = 32101, 32102, 32103
TAG_RESYNC, TAG_ALIVE = 32104, 32105  # SGLang: re-sync of a restarted engine; engine leaders' health per step
TARGET_WINDOW = 10  # steps averaged for run.target_reward
SFT_SEED_OFFSET = 7919  # SFT warm-up draws from its own prompt stream, so RL sees the same prompts either way

Group = list[Sample]


# ---- state ------------------------------------------------------------------------------------------------
@dataclass
class LoopState:
    """Everything the loop itself must carry across a restart (engine/trainer state is added by the sides)."""

    step: int = 0  # rollout side: next batch to generate; trainer side: next step to train
    weight_version: int = 0  # rollout: weights loaded in the engine; trainer: optimizer steps since RL began
    data: dict[str, Any] = field(default_factory=dict)  # prompt cursor
    carry: list[Sample] = field(default_factory=list)  # partial rollouts: samples of unfinished groups
    ready: list[Group] = field(default_factory=list)  # finished groups beyond a step's need (over-sampling)
    pending: list[Any] = field(default_factory=list)  # async buffer: batches received, not yet trained
    sft_done: bool = False
    rng: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "weight_version": self.weight_version, "data": dict(self.data),
            "carry": [s.to_dict() for s in self.carry],
            "ready": [[s.to_dict() for s in g] for g in self.ready],
            "pending": [(m[0], m[1], [[s.to_dict() for s in g] for g in m[2]], m[3]) for m in self.pending],
            "sft_done": self.sft_done, "rng": capture_rng(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.weight_version = int(state["step"]), int(state["weight_version"])
        self.data = dict(state["data"])
        self.carry = [Sample.from_dict(d) for d in state["carry"]]
        self.ready = [[Sample.from_dict(d) for d in g] for g in state["ready"]]
        self.pending = [(m[0], m[1], [[Sample.from_dict(d) for d in g] for g in m[2]], m[3])
                        for m in state["pending"]]
        self.sft_done = bool(state.get("sft_done", False))
        self.rng = dict(state.get("rng") or {})
        if self.rng:
            restore_rng(self.rng)


def capture_rng() -> dict[str, Any]:
    import torch

    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def merge_rollout_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """Sum the engines' raw counters (times take the max: the engines run side by side)."""
    out: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = max(out.get(k, 0.0), v) if k.startswith("time") else out.get(k, 0.0) + v
    return out


def rollout_metrics(stats: dict[str, float]) -> dict[str, float]:
    """Raw counters → the reported ``rollout/*`` metrics."""
    n = max(stats.get("scored", 0.0), 1.0)
    mean = stats.get("reward_sum", 0.0) / n
    var = max(stats.get("reward_sq", 0.0) / n - mean * mean, 0.0)
    out = {
        "rollout/reward_mean": mean, "rollout/reward_std": math.sqrt(var),
        "rollout/response_length": stats.get("resp_tokens", 0.0) / max(stats.get("samples", 0.0), 1.0),
        "rollout/samples": stats.get("samples", 0.0), "rollout/failed": stats.get("failed", 0.0),
        "rollout/truncated": stats.get("truncated", 0.0),
        "rollout/filtered_groups": stats.get("filtered", 0.0), "rollout/carried_samples": stats.get("carried", 0.0),
        "rollout/groups": stats.get("groups", 0.0), "time/gen": stats.get("time_gen", 0.0),
        "time/reward": stats.get("time_reward", 0.0),
    }
    if stats.get("time_gen", 0.0) > 0:
        out["perf/gen_tokens_per_s"] = stats.get("gen_tokens", 0.0) / stats["time_gen"]
    return out


def deal_groups(groups: list[Group], dp_size: int) -> list[list[Group]]:
    """Whole groups to DP ranks, balancing sample counts (largest first onto the lightest rank)."""
    shares: list[list[Group]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for g in sorted(groups, key=lambda g: (-len(g), g[0].group)):
        r = load.index(min(load))
        shares[r].append(g)
        load[r] += len(g)
    return shares


def sync_versions(job: JobSpec) -> list[int]:
    """Weight versions that are sent to the engines during RL (after steps 0..steps-2, every interval)."""
    k = job.run.update_weights_interval
    return [v for v in range(1, job.run.steps) if v % k == 0]


def required_version(job: JobSpec, batch: int) -> int:
    """The newest weights batch ``batch`` must be generated with (sync: lag 0, one-step-off: lag 1, async:
    ``max_staleness``)."""
    lag = {"sync": 0, "one_step_off": 1, "async": job.run.max_staleness}[job.run.loop]
    synced = [v for v in sync_versions(job) if v <= batch - lag]
    return synced[-1] if synced else 0


# ---- rollout side -----------------------------------------------------------------------------------------
class RolloutSide:
    """One rollout rank. Engine leaders produce batches; other engine ranks only take part in weight updates."""

    def __init__(self, job: JobSpec, engine: Any, *, engine_index: int = 0, num_engines: int = 1,
                 leader: bool = True, file: str | None = None) -> None:
        from milehpc import plugins
        from milehpc.config.schema import check_params
        from milehpc.data.source import build_source, task_reward_name
        from milehpc.data.tokenizer import build_tokenizer
        from milehpc.rewards.api import RewardRunner
        from milehpc.rollout.reference import sampling_from_spec

        self.job, self.engine, self.leader = job, engine, leader
        self.e, self.E = engine_index, num_engines
        ro = job.rollout
        self.tokenizer = getattr(engine, "tokenizer", None) or build_tokenizer(job.model.tokenizer)
        self.source = build_source(job.data, self.tokenizer, file=file)
        self.scorer = RewardRunner.from_spec(job.reward, task_reward_name(job.data) or None, file=file)
        self.sampling = sampling_from_spec(ro, self.tokenizer)
        self.generator: Callable[..., list[Sample]] | None = None
        self.generator_params: dict[str, Any] = {}
        if ro.generator:
            spec = plugins.lookup("generator", ro.generator, file=file, field="rollout.generator")
            self.generator_params = check_params(spec.defaults, ro.generator_params, file=file,
                                                 prefix="rollout.generator_params")
            self.generator = plugins.load("generator", ro.generator)
            if ro.partial_rollout:
                raise ConfigError("partial_rollout cannot be combined with a custom generator", file=file,
                                  field="rollout.partial_rollout")
        self.options = {"partial_chunk": 0, "max_filter_rounds": 4, **ro.options}
        self.state = LoopState()
        # This engine's quota of each step's prompts.
        self.quota = ro.prompts_per_step // num_engines + (engine_index < ro.prompts_per_step % num_engines)
        self._cursor = 0  # this engine's own prompt counter; global position = cursor * E + e

    # -- prompts --
    def _take(self, k: int) -> list[Any]:
        out = [self.source.peek(c * self.E + self.e) for c in range(self._cursor, self._cursor + k)]
        self._cursor += k
        return out

    # -- one batch --
    def produce(self) -> tuple[list[Group], dict[str, float]]:
        """Groups for the next step (scored, filtered) and raw counters for the metrics."""
        ro = self.job.rollout
        stats = {k: 0.0 for k in ("reward_sum", "reward_sq", "scored", "samples", "failed", "truncated",
                                  "filtered", "carried", "resp_tokens", "gen_tokens", "groups", "time_gen",
                                  "time_reward")}
        need = self.quota
        groups, self.state.ready = self.state.ready[:need], self.state.ready[need:]
        rounds = 0
        while len(groups) < need and rounds < int(self.options["max_filter_rounds"]):
            rounds += 1
            want = need - len(groups)
            k = math.ceil(want * ro.over_sample) if ro.dynamic_filter or ro.over_sample > 1 else want
            t0 = time.perf_counter()
            finished = self._generate(self._take(k), stats)
            stats["time_gen"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            self._score([s for g in finished for s in g if s.reward is None])
            stats["time_reward"] += time.perf_counter() - t0
            for g in finished:
                for s in g:
                    stats["samples"] += 1
                    stats["resp_tokens"] += len(s.response_ids)
                    stats["failed"] += s.status is Status.FAILED
                    stats["truncated"] += s.status is Status.TRUNCATED
                    if s.status is not Status.FAILED:
                        r = s.scalar_reward
                        stats["reward_sum"] += r
                        stats["reward_sq"] += r * r
                        stats["scored"] += 1
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
        self.state.step += 1
        self.state.data = {"cursor": self._cursor}
        return groups, stats

    def _generate(self, prompts: list[Any], stats: dict[str, float]) -> list[Group]:
        """Generate for ``prompts`` (and continue partial rollouts); returns the groups that finished."""
        ro = self.job.rollout
        version = self.state.weight_version
        before = getattr(self.engine, "tokens_generated", None)
        if self.generator is not None:
            out = self.generator(self.engine, prompts, self.sampling, **self.generator_params)
        else:
            sp = self.sampling
            if ro.partial_rollout:
                chunk = int(self.options["partial_chunk"]) or max(1, ro.max_new_tokens // 2)
                sp = replace(sp, max_new_tokens=chunk)
                cont = [s for s in self.state.carry if s.status is Status.ABORTED]
                if cont:
                    self.engine.generate([], replace(sp, n=1), samples=cont)
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
        if before is not None:
            stats["gen_tokens"] += self.engine.tokens_generated - before
        else:
            stats["gen_tokens"] += sum(len(s.response_ids) for s in out)
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
    def load_weights(self, named: Any, version: int) -> None:
        self.engine.update_weights(named, version)
        self.state.weight_version = version

    def state_dict(self) -> dict[str, Any]:
        state = {"loop": self.state.state_dict(), "cursor": self._cursor}
        if hasattr(self.engine, "state_dict"):
            state["engine"] = self.engine.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state["loop"])
        self._cursor = int(state["cursor"])
        if "engine" in state and hasattr(self.engine, "load_state_dict"):
            self.engine.load_state_dict(state["engine"])


# ---- trainer side -----------------------------------------------------------------------------------------
class TrainerSide:
    """One trainer rank: the trainer, plus (on the trainer leader) metrics, dumps and the batch inbox."""

    def __init__(self, job: JobSpec, trainer: Any, *, run_dir: Path | None, rank: int = 0, dp_rank: int = 0,
                 dp_size: int = 1, leader: bool = True, file: str | None = None, progress: bool = True) -> None:
        from milehpc.data.tokenizer import build_tokenizer

        self.job, self.trainer, self.run_dir = job, trainer, run_dir
        self.rank, self.dp_rank, self.dp_size, self.leader = rank, dp_rank, dp_size, leader
        self.tokenizer = getattr(trainer, "tokenizer", None) or build_tokenizer(job.model.tokenizer)
        self.state = LoopState()
        self.file = file
        self.metrics = None
        if leader and run_dir is not None:
            from milehpc.runtime.metrics import MetricsLogger

            self.metrics = MetricsLogger(run_dir, job.run.steps, progress=progress)
        self.started = time.time()
        self.history: list[dict[str, float]] = []
        self.static: dict[str, float] = {}  # logged with the first step (world layout facts)

    # -- SFT warm-up --
    def sft_batches(self) -> Any:
        """This DP rank's labelled samples for each warm-up step (prompt + label + EOS, all trained on)."""
        from milehpc.data.source import build_source

        job = self.job
        source = build_source(job.data, self.tokenizer, seed_offset=SFT_SEED_OFFSET, file=self.file)
        per_step = job.rollout.prompts_per_step * job.rollout.n_samples
        for _ in range(job.trainer.sft_warmup_steps):
            prompts = source.take(per_step)[self.dp_rank::self.dp_size]
            yield [Sample(prompt_ids=p.ids, response_ids=[*self.tokenizer.encode(str(p.label)), self.tokenizer.eos_id],
                          group=p.index, index=p.index, label=p.label, prompt_text=p.text) for p in prompts]

    def warmup(self) -> None:
        job = self.job
        if self.state.sft_done or job.trainer.sft_warmup_steps == 0:
            self.state.sft_done = True
            self.trainer.freeze_reference() if hasattr(self.trainer, "freeze_reference") else None
            return
        t0 = time.perf_counter()
        opt = self.trainer._adamw(self.trainer.model.parameters(), job.trainer.sft_lr or job.trainer.lr)
        last: dict[str, float] = {}
        for samples in self.sft_batches():
            last = self.trainer.sft_step(samples, opt)
        self.state.sft_done = True
        if hasattr(self.trainer, "freeze_reference"):
            self.trainer.freeze_reference()
        if self.metrics is not None:
            self.metrics.message(f"SFT warm-up: {job.trainer.sft_warmup_steps} steps in "
                                 f"{time.perf_counter() - t0:.1f}s, final loss {last.get('sft/loss', 0):.3f}")

    # -- one RL step --
    def filter_stale(self, groups: list[Group]) -> tuple[list[Group], dict[str, float]]:
        """Staleness = trainer version − the version that generated a sample; too old → dropped or kept."""
        version = self.trainer.version if hasattr(self.trainer, "version") else self.state.weight_version
        keep, dropped, worst, total = [], 0, 0, 0.0
        n = 0
        for g in groups:
            st = [version - s.weight_version for s in g]
            worst = max(worst, *st)
            total += sum(st)
            n += len(st)
            if self.job.run.loop == "async" and max(st) > self.job.run.max_staleness \
                    and self.job.run.stale_policy == "drop":
                dropped += 1
            else:
                keep.append(g)
        return keep, {"async/staleness_max": float(worst), "async/staleness_mean": total / max(n, 1),
                      "async/dropped_groups": float(dropped)}

    def train(self, step: int, samples: list[Sample]) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.trainer.train_step(samples, step) if samples else {}
        metrics["time/train"] = time.perf_counter() - t0
        if not samples and hasattr(self.trainer, "version"):
            self.trainer.version += 1  # keep the version schedule even when a step had nothing to learn from
        self.state.weight_version = getattr(self.trainer, "version", self.state.weight_version + 1)
        self.state.step = step + 1
        return metrics

    def report(self, step: int, metrics: dict[str, float], groups: list[Group]) -> None:
        """Leader: metrics, progress line, HDF5 dump."""
        if not self.leader:
            return
        tokens = metrics.get("train/tokens", 0.0)
        if metrics.get("time/step"):
            metrics["perf/tokens_per_s"] = (tokens + metrics.get("rollout/gen_tokens", 0.0)) / metrics["time/step"]
        metrics["time/elapsed"] = time.time() - self.started
        if not self.history:
            metrics.update(self.static)
        self.history.append({"step": step, **metrics})
        if self.metrics is not None:
            self.metrics.log(step, metrics)
            if self.job.run.check_logprobs and "train/logprob_diff_max" in metrics:
                self.metrics.message(f"step {step}: rollout vs trainer logprobs max |diff| "
                                     f"{metrics['train/logprob_diff_max']:.2e} mean "
                                     f"{metrics['train/logprob_diff_mean']:.2e}")
        if self.job.run.dump_rollouts and self.run_dir is not None and groups:
            from milehpc.data.store import write_rollouts

            write_rollouts(self.run_dir, step, [s for g in groups for s in g],
                           {"trainer_version": self.state.weight_version})

    def target_reached(self, metrics: dict[str, float], window: int = TARGET_WINDOW) -> bool:
        """``run.target_reward`` reached by the mean reward of the last ``window`` steps (this one included):
        one lucky batch does not end a run."""
        t = self.job.run.target_reward
        if t is None or "rollout/reward_mean" not in metrics:
            return False
        recent = [h["rollout/reward_mean"] for h in self.history[-(window - 1):] if "rollout/reward_mean" in h]
        recent.append(metrics["rollout/reward_mean"])
        return len(recent) >= min(window, self.job.run.steps) and sum(recent) / len(recent) >= t

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    def state_dict(self) -> dict[str, Any]:
        return {"loop": self.state.state_dict(), "trainer": self.trainer.state_dict_for_checkpoint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state["loop"])
        self.trainer.load_checkpoint_state(state["trainer"])


def _samples(groups: list[Group]) -> list[Sample]:
    return [s for g in groups for s in g]


# ---- local (one process) ----------------------------------------------------------------------------------
def run_local(job: JobSpec, run_dir: str | Path | None = None, *, progress: bool = False,
              on_step: Callable[[int, dict[str, float]], None] | None = None,
              checkpointing: bool = False) -> list[dict[str, float]]:
    """The sync loop in this process (engine and trainer side by side, weights loaded in place). Returns the
    per-step metrics. No MPI, no torch.distributed."""
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.rollout.reference import ReferenceEngine
    from milehpc.train.model import build_model
    from milehpc.train.torch_trainer import TorchTrainer

    if job.run.loop != "sync":
        raise ConfigError("a single-process run supports only run.loop = 'sync'", field="run.loop")
    random.seed(job.run.seed)
    tok = build_tokenizer(job.model.tokenizer)
    trainer = TorchTrainer(job, tok)
    engine_model = build_model(job.model, tok.vocab_size, seed=job.run.seed, pad_id=tok.pad_id, eos_id=tok.eos_id)
    engine = ReferenceEngine(engine_model, tok, seed=job.run.seed * 100_003)
    rollout = RolloutSide(job, engine)
    side = TrainerSide(job, trainer, run_dir=Path(run_dir) if run_dir else None, progress=progress)
    ckpt = None
    if checkpointing and run_dir is not None:  # resume from / write RUN_DIR's checkpoints (runtime.checkpoint)
        from milehpc.runtime.checkpoint import LoopCheckpoint

        ckpt = LoopCheckpoint(job, run_dir)
    try:
        if ckpt is not None:
            ckpt.restore(trainer=side, rollout=rollout)
        side.warmup()
        rollout.load_weights(trainer.export_weights(), trainer.version)
        for step in range(side.state.step, job.run.steps):
            t0 = time.perf_counter()
            groups, stats = rollout.produce()
            metrics = rollout_metrics(stats)
            groups, st = side.filter_stale(groups)
            metrics.update(st)
            metrics.update(side.train(step, _samples(groups)))
            t1 = time.perf_counter()
            rollout.load_weights(trainer.export_weights(), trainer.version)
            metrics["time/sync"] = time.perf_counter() - t1
            metrics["time/step"] = time.perf_counter() - t0
            metrics["rollout/gen_tokens"] = stats["gen_tokens"]
            side.report(step, metrics, groups)
            if on_step is not None:
                on_step(step, metrics)
            if ckpt is not None:
                ckpt.hook(side, step, rollout)
            if side.target_reached(metrics):
                break
    finally:
        side.close()
    return side.history


def _world_facts(comms: Any) -> dict[str, float]:
    """What the run really ran on: the MPI world and the torch.distributed (trainer) world."""
    import torch.distributed as dist

    facts = {"dist/mpi_world_size": float(comms.world.Get_size()),
             "dist/rollout_ranks": float(comms.plan.rollout_ranks)}
    if dist.is_available() and dist.is_initialized():
        facts["dist/trainer_world_size"] = float(dist.get_world_size())
    return facts


# ---- MPI: separate trainer and rollout groups -------------------------------------------------------------
def _send(comms: Any, obj: Any, dest: int, tag: int, what: str, pending: list[Any]) -> None:
    """Nonblocking send. Requests are kept (finished ones dropped here) and waited for, with the deadline, by
    :func:`_flush` at the end: a blocking send could deadlock against a peer that is busy in a weight broadcast."""
    pending[:] = [p for p in pending if not p[0].Test()]
    pending.append((comms.ctrl.isend(obj, dest, tag), dest, what))


def _flush(comms: Any, pending: list[Any]) -> None:
    while pending:
        req, dest, what = pending[0]
        comms.poll(req.Test, comms.timeout, lambda d=dest, w=what: f"{w}: rank {d} did not take the message "
                                                                  f"within {comms.timeout:.0f} s", lambda d=dest: [d])
        pending.pop(0)


def _recv(comms: Any, src: int, tag: int, what: str, timeout: float | None = None) -> Any:
    box: list[Any] = []
    timeout = comms.timeout if timeout is None else timeout

    def probe() -> bool:
        msg = comms.ctrl.improbe(src, tag)
        if msg is not None:
            box.append(msg.recv())
        return bool(box)

    comms.poll(probe, timeout, lambda: f"{what}: rank {comms.rank} heard nothing from rank {src} within "
                                       f"{timeout:.0f} s", lambda: [src])
    return box[0]


def _poll(comms: Any, src: int, tag: int) -> Any:
    msg = comms.ctrl.improbe(src, tag)
    return None if msg is None else (msg.recv(),)


def _rollout_main(ctx: Any, job: JobSpec, engine: Any) -> None:
    comms, plan = ctx.comms, ctx.plan
    e, er = plan.engine_of(comms.rank)
    side = RolloutSide(job, engine, engine_index=e, num_engines=plan.engines, leader=er == 0,
                       file=str(ctx.run_dir / "job.toml"))
    pending: list[Any] = []
    mode = job.run.loop
    ckpt = getattr(ctx, "checkpointing", None)
    resumed = ckpt is not None and ckpt.restore(rollout=side)
    direct = _direct_sync(job)

    def take_update(block: bool) -> bool:
        """Apply one weight notice if there is one (or wait for it). Returns False on stop."""
        if block and direct:  # serve other engines' re-syncs while waiting (the trainer may be in one)
            got = (_wait_serving(comms, side, engine, lambda: _poll(comms, 0, TAG_NOTICE),
                                 "waiting for new weights from trainer rank 0"),)
        else:
            got = (_recv(comms, 0, TAG_NOTICE, "waiting for new weights from trainer rank 0"),) if block \
                else _poll(comms, 0, TAG_NOTICE)
        return True if got is None else _apply_notice(comms, side, engine, got[0])

    # The warmed-up weights (version 0), or after a resume the trainer's restored weights; SGLang always starts
    # with them (its engine may have started from random "dummy" weights).
    if (job.trainer.sft_warmup_steps > 0 or resumed or direct) and not take_update(block=True):
        return
    for b, groups, stats in getattr(side, "outbox", [])[:] if resumed else []:
        # Batches generated before the checkpoint that the trainer had not trained yet: send them again.
        _send(comms, ("batch", b, groups, stats), 0, TAG_BATCH, f"batch {b} to trainer rank 0", pending)
    running = True
    while running:
        b = side.state.step
        # Between generations only: take updates that are due (or, async, any that arrived).
        while running:
            if b >= job.run.steps:
                running = take_update(block=True)
                continue
            need = required_version(job, b)
            if side.state.weight_version < need:
                running = take_update(block=True)
            elif mode == "async" and (got := _poll(comms, 0, TAG_NOTICE)) is not None:
                running = _apply_notice(comms, side, engine, got[0])
            else:
                break
        if not running:
            break
        if side.leader:
            if direct:
                _engine_turn(comms, side, engine, b, pending)
            groups, stats = side.produce()
            _send(comms, ("batch", b, groups, stats), 0, TAG_BATCH, f"batch {b} to trainer rank 0", pending)
            if ckpt is not None:
                ckpt.sent(side, b, groups, stats)
        else:
            side.state.step += 1
            if direct:
                _serve_resyncs(comms, side, engine)
    if side.leader:
        _send(comms, ("bye", side.state.step, [], {}), 0, TAG_BATCH, "end of rollouts", pending)
    _flush(comms, pending)


def _apply_notice(comms: Any, side: RolloutSide, engine: Any, notice: tuple[str, int]) -> bool:
    kind, version = notice
    if kind == "stop":
        return False
    ckpt = getattr(side, "checkpointing", None)
    if kind == "checkpoint":  # from trainer rank 0 (runtime.checkpoint.LoopCheckpoint)
        ckpt.on_notice(side, version)
        return True
    if ckpt is not None:
        ckpt.trained(side, version)
    if _direct_sync(side.job):  # SGLang: the bytes go into its schedulers through its own update group
        from milehpc.rollout.sglang_sync import sync_weights as sglang_sync

        if getattr(engine, "is_leader", False) and not engine.health():
            engine.restart()  # died since the last generation: this sync rebuilds its group and fills it
        sglang_sync(comms, version, engine=engine)
        side.state.weight_version = version
        return True
    from milehpc.runtime.weights import sync_weights

    sync_weights(comms, version, engine=_VersionedEngine(side, engine))
    return True


def _serve_resyncs(comms: Any, side: RolloutSide, engine: Any) -> bool:
    """Take part in every re-sync the trainer has announced (after some engine restarted). Every sync has the
    same protocol, so it does not matter whether a re-sync or a regular one is taken first. False on stop."""
    while (got := _poll(comms, 0, TAG_RESYNC)) is not None:
        if not _apply_notice(comms, side, engine, got[0]):
            return False
    return True


def _wait_serving(comms: Any, side: RolloutSide, engine: Any, probe: Callable[[], Any], what: str) -> Any:
    """Wait (with the comms' timeout) until ``probe()`` returns something, serving re-syncs meanwhile."""
    box: list[Any] = []

    def done() -> bool:
        if not _serve_resyncs(comms, side, engine):
            box.append(("stop", -1))
        elif (got := probe()) is not None:
            box.append(got[0])
        return bool(box)

    comms.poll(done, comms.timeout, lambda: f"{what}: rank {comms.rank} heard nothing within "
                                            f"{comms.timeout:.0f} s", lambda: [0])
    return box[0]


def _engine_turn(comms: Any, side: RolloutSide, engine: Any, b: int, pending: list[Any]) -> None:
    """SGLang engine leader, before generating batch ``b``: the engine leaders swap health flags, this engine's
    share of the step's prompt groups comes from the router over the live engines (a dead one gets none this
    step), and a dead engine is restarted in place and re-synced to the trainer's current weights."""
    from milehpc.rollout.router import Router, split_prompts

    plan, ro = comms.plan, side.job.rollout
    healthy = engine.health() if hasattr(engine, "health") else True
    leaders = plan.engine_leaders()
    alive = [healthy]
    if len(leaders) > 1:
        for r in leaders:
            if r != comms.rank:
                _send(comms, (b, healthy), r, TAG_ALIVE, f"engine health to rank {r}", pending)
        flags = {comms.rank: healthy}
        for r in leaders:
            while r not in flags:
                got = _wait_serving(comms, side, engine, lambda r=r: _poll(comms, r, TAG_ALIVE),
                                    f"health of engine leader {r} for batch {b}")
                if got == ("stop", -1):
                    return
                if got[0] == b:  # flags of an older batch cannot arrive after this one (FIFO per pair)
                    flags[r] = got[1]
        alive = [flags[r] for r in leaders]
    if any(alive):
        router = Router(len(leaders))
        for e, ok in enumerate(alive):
            if not ok:
                router.mark_dead(e)
        # Token cost of the step's prompts at their stream positions (the same on every leader, so every leader
        # computes the same split); each engine then takes its count from its own part of the stream.
        costs = [side.source.peek(b * ro.prompts_per_step + i).ids for i in range(ro.prompts_per_step)]
        side.quota = len(split_prompts(costs, ro.n_samples, ro.max_new_tokens, len(leaders), router)[side.e])
    if not healthy:
        engine.restart()
        _send(comms, ("resync", b, [], {}), 0, TAG_BATCH, "re-sync request to trainer rank 0", pending)
        _wait_serving(comms, side, engine, lambda: None if engine.needs_weight_sync else (True,),
                      f"re-sync of restarted engine {side.e}")


def _direct_sync(job: JobSpec) -> bool:
    """Separate-ranks SGLang: weights go trainer stage leaders → SGLang's TP schedulers directly
    (:mod:`milehpc.rollout.sglang_sync`), not through the rollout rank's ``update_weights``."""
    return job.rollout.engine == "sglang" and not job.resources.colocate


class _VersionedEngine:
    """Hands received weights to the engine and records the version in the loop state."""

    def __init__(self, side: RolloutSide, engine: Any) -> None:
        self.side, self.engine = side, engine

    def update_weights(self, named: Any, version: int) -> None:
        self.side.load_weights(named, version)


def _trainer_main(ctx: Any, job: JobSpec, trainer: Any, *, progress: bool) -> list[dict[str, float]]:
    comms, plan = ctx.comms, ctx.plan
    _, dp, _ = plan.trainer_coords(comms.rank)
    leader = comms.rank == 0
    side = TrainerSide(job, trainer, run_dir=ctx.run_dir, rank=comms.rank, dp_rank=dp, dp_size=plan.dp,
                       leader=leader, file=str(ctx.run_dir / "job.toml"), progress=progress)
    leaders = plan.engine_leaders()
    rollout_ranks = list(plan.rollout_group())
    trainers = list(plan.trainer_group())
    collective_export = bool(getattr(trainer, "export_is_collective", False))
    side.static = _world_facts(comms)
    pending: list[Any] = []
    checkpoint_hook = getattr(ctx, "checkpoint_hook", None)

    def push_weights(version: int, tag: int = TAG_NOTICE) -> float:
        if _direct_sync(job):
            from milehpc.rollout.sglang_sync import sync_weights
        else:
            from milehpc.runtime.weights import sync_weights

        t0 = time.perf_counter()
        if leader:
            for r in rollout_ranks:
                _send(comms, ("weights", version), r, tag, f"weight notice to rank {r}", pending)
        source = any(g.is_source for g in comms.sync_groups.values())
        if source or collective_export:
            named = list(trainer.export_weights())
            if source:
                sync_weights(comms, version, named_tensors=named)
        return time.perf_counter() - t0

    try:
        ckpt = getattr(ctx, "checkpointing", None)
        resumed = ckpt is not None and ckpt.restore(trainer=side)
        side.warmup()
        if job.trainer.sft_warmup_steps > 0 or resumed or _direct_sync(job):  # resumed: the engines were rebuilt
            push_weights(trainer.version)
        step = side.state.step
        last = False
        while step < job.run.steps:
            t0 = time.perf_counter()
            if leader:
                parts, groups = [], []
                for src in leaders:
                    kind, b, g, stats = _recv(comms, src, TAG_BATCH, f"batch {step} from engine leader {src}")
                    while kind == "resync":  # that engine restarted: every engine gets the current weights again
                        for r in trainers[1:]:
                            _send(comms, (step, "resync", side.state.weight_version), r, TAG_SHARE,
                                  f"re-sync notice to rank {r}", pending)
                        push_weights(side.state.weight_version, TAG_RESYNC)
                        kind, b, g, stats = _recv(comms, src, TAG_BATCH, f"batch {step} from engine leader {src}")
                    if kind != "batch" or b != step:
                        raise RuntimeFailure(f"trainer rank 0 expected batch {step} from rank {src}, got {kind} {b}")
                    groups += g
                    parts.append(stats)
                t_wait = time.perf_counter() - t0
                stats = merge_rollout_stats(parts)
                metrics = rollout_metrics(stats)
                metrics["rollout/gen_tokens"] = stats.get("gen_tokens", 0.0)
                metrics["time/wait_batch"] = t_wait
                groups, st = side.filter_stale(groups)
                metrics.update(st)
                last = step == job.run.steps - 1 or side.target_reached(metrics)
                shares = deal_groups(groups, plan.dp)
                if plan.dp > 1 and not all(shares):
                    # A DP rank without data cannot join the gradient all-reduce: nobody trains this step.
                    metrics["train/skipped_groups"] = float(len(groups))
                    shares = [[] for _ in shares]
                for r in trainers[1:]:
                    _, rdp, _ = plan.trainer_coords(r)
                    _send(comms, (step, shares[rdp], last), r, TAG_SHARE, f"step {step} share to rank {r}", pending)
                mine = shares[dp]
            else:
                _, mine, last = _recv(comms, 0, TAG_SHARE, f"step {step} share from trainer rank 0")
                while mine == "resync":  # an engine restarted (see above): `last` carries the version
                    push_weights(last, TAG_RESYNC)
                    _, mine, last = _recv(comms, 0, TAG_SHARE, f"step {step} share from trainer rank 0")
                metrics = {}
            metrics.update(side.train(step, _samples(mine)))
            version = side.state.weight_version
            if not last and version in sync_versions(job):
                metrics["time/sync"] = push_weights(version)
            metrics["time/step"] = time.perf_counter() - t0
            if leader:
                side.report(step, metrics, groups)
            if checkpoint_hook is not None:
                checkpoint_hook(side, step)
            step += 1
            if last:
                break
    except BaseException:
        side.close()
        raise
    if leader:
        # Stop the rollout ranks and drain what they still send, so nothing is in flight at shutdown.
        for r in rollout_ranks:
            _send(comms, ("stop", -1), r, TAG_NOTICE, f"stop notice to rank {r}", pending)
        for src in leaders:
            while (kind := _recv(comms, src, TAG_BATCH, f"end of rollouts from rank {src}")[0]) != "bye":
                if kind == "resync":  # too late to re-sync: release the waiting engine leader
                    _send(comms, ("stop", -1), src, TAG_RESYNC, f"stop to rank {src}", pending)
        _flush(comms, pending)
    side.close()
    return side.history


# ---- MPI: colocated ---------------------------------------------------------------------------------------
def _colocated_main(ctx: Any, job: JobSpec, engine: Any, trainer: Any, *, progress: bool) -> list[dict[str, float]]:
    from milehpc.runtime.weights import sync_weights

    comms, plan = ctx.comms, ctx.plan
    if job.run.loop != "sync":
        raise ConfigError("colocated runs support only run.loop = 'sync' (one process cannot overlap "
                          "generation and training)", field="run.loop")
    e, _ = plan.engine_of(comms.rank)
    _, dp, _ = plan.trainer_coords(comms.rank)
    leader = comms.rank == 0
    colo = getattr(ctx, "colocate", None)  # SGLang + torch_memory_saver (runtime.colocate); None otherwise
    rollout = RolloutSide(job, engine, engine_index=e, num_engines=plan.engines, file=str(ctx.run_dir / "job.toml"))
    side = TrainerSide(job, trainer, run_dir=ctx.run_dir, rank=comms.rank, dp_rank=dp, dp_size=plan.dp,
                       leader=leader, file=str(ctx.run_dir / "job.toml"), progress=progress)
    everyone = list(range(plan.world_size))
    side.static = _world_facts(comms)
    try:
        if getattr(ctx, "checkpointing", None) is not None:
            ctx.checkpointing.restore(trainer=side, rollout=rollout)
        if colo is None:
            side.warmup()
            sync_weights(comms, trainer.version, named_tensors=trainer.export_weights(),
                         engine=_VersionedEngine(rollout, engine))
        else:
            with colo.train_region():
                side.warmup()
            colo.initial_sync(trainer.version)
            rollout.state.weight_version = trainer.version
        for step in range(side.state.step, job.run.steps):
            t0 = time.perf_counter()
            groups, stats = rollout.produce() if colo is None else _colo_generate(colo, rollout, trainer)
            gathered = comms.gather((groups, stats), 0, everyone, what=f"step {step} rollouts")
            metrics: dict[str, float] = {}
            if leader:
                all_groups = [g for part in gathered for g in part[0]]
                merged = merge_rollout_stats([part[1] for part in gathered])
                metrics = rollout_metrics(merged)
                metrics["rollout/gen_tokens"] = merged.get("gen_tokens", 0.0)
            counts = comms.allgather(len(groups), everyone, what=f"step {step} group counts")
            # A rank without data cannot join the gradient all-reduce: then nobody trains this step.
            if colo is None:
                metrics.update(side.train(step, _samples(groups) if min(counts) > 0 else []))
                t1 = time.perf_counter()
                sync_weights(comms, trainer.version, named_tensors=trainer.export_weights(),
                             engine=_VersionedEngine(rollout, engine))
                metrics["time/sync"] = time.perf_counter() - t1
            else:
                metrics.update(_colo_train_update(colo, side, rollout, step,
                                                  _samples(groups) if min(counts) > 0 else []))
            metrics["time/step"] = time.perf_counter() - t0
            stop = comms.bcast(leader and side.target_reached(metrics), 0, everyone, what="stop flag")
            if leader:
                side.report(step, metrics, all_groups)
            if getattr(ctx, "checkpoint_hook", None) is not None:
                ctx.checkpoint_hook(side, step, rollout)
            if stop:
                break
    finally:
        side.close()
    return side.history


def _colo_generate(colo: Any, rollout: RolloutSide, trainer: Any) -> tuple[list[Group], dict[str, float]]:
    """Colocated SGLang, first half of a step: (restart + re-sync a dead engine), generate, offload rollout."""
    from milehpc.runtime.colocate import StepReport

    colo.report = StepReport()
    engine = colo.engine
    if hasattr(engine, "health") and not engine.health():
        engine.restart()  # comes back resident, with the checkpoint's (or random) weights
        colo.update_weights(trainer.version)  # the last snapshot: the trainer's current weights
        rollout.state.weight_version = trainer.version
    out = colo.timed("generate", rollout.produce)
    colo.offload_rollout()
    return out


def _colo_train_update(colo: Any, side: TrainerSide, rollout: RolloutSide, step: int,
                       samples: list[Sample]) -> dict[str, float]:
    """Colocated SGLang, second half: train → offload train → onload weights → update weights → onload KV cache."""
    colo.onload_train()

    def train() -> dict[str, float]:
        with colo.train_region():  # optimizer state created at the first step must be pausable too
            metrics = side.train(step, samples)
        colo.snapshot()
        return metrics

    metrics = colo.timed("train", train)
    colo.offload_train()
    colo.onload_weights()
    colo.update_weights(side.trainer.version)
    rollout.state.weight_version = side.trainer.version
    colo.onload_kv()
    metrics["time/sync"] = colo.report.times.get("update_weights", 0.0)
    metrics.update(colo.report.metrics())
    return metrics


def check_job(job: JobSpec, *, file: str | None = None) -> None:
    """Loop settings that only make sense together (one clear line otherwise)."""
    if job.run.loop == "async" and job.run.stale_policy == "correct" and job.algorithm.off_policy_correction == "none":
        raise ConfigError("stale_policy = 'correct' keeps stale samples for importance correction: set "
                          "algorithm.off_policy_correction = 'tis' or 'mis'", file=file, field="run.stale_policy")
    if job.rollout.generator and job.rollout.partial_rollout:
        raise ConfigError("partial_rollout cannot be combined with a custom generator", file=file,
                          field="rollout.partial_rollout")


# ---- entry --------------------------------------------------------------------------------------------------
def run(ctx: Any, *, progress: bool = True) -> list[dict[str, float]]:
    """The loop on this rank (called by ``milehpc launch`` on every rank). Returns the leader's metrics history."""
    from milehpc import plugins

    job, plan, comms = ctx.job, ctx.plan, ctx.comms
    random.seed(job.run.seed + comms.rank)
    file = str(ctx.run_dir / "job.toml")
    check_job(job, file=file)
    engine = trainer = None
    if plan.is_rollout(comms.rank):
        engine = plugins.load("engine", job.rollout.engine, file=file, field="rollout.engine")(ctx)
    colo = None
    if plan.colocated and engine is not None:
        from milehpc.runtime.colocate import for_job

        colo = ctx.colocate = for_job(job, engine, device=comms.device)  # None for the reference engine
    if plan.is_trainer(comms.rank):
        make_trainer = plugins.load("trainer", job.trainer.backend, file=file, field="trainer.backend")
        if colo is not None:  # parameters and optimizer state in the pausable region
            with colo.train_region():
                trainer = colo.trainer = make_trainer(ctx)
        else:
            trainer = make_trainer(ctx)
    if getattr(ctx, "checkpointing", None) is None:  # resume + checkpoints + requeue (runtime.checkpoint)
        from milehpc.runtime.checkpoint import LoopCheckpoint

        ctx.checkpointing = LoopCheckpoint.for_context(ctx)
        if getattr(ctx, "checkpoint_hook", None) is None:
            ctx.checkpoint_hook = ctx.checkpointing.hook
    if plan.colocated:
        return _colocated_main(ctx, job, engine, trainer, progress=progress)
    if trainer is not None:
        return _trainer_main(ctx, job, trainer, progress=progress)
    _rollout_main(ctx, job, engine)
    return []

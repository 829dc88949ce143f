"""One trainer rank's side of the loop: the supervised warm-up, one RL step on this DP rank's share, and on the
trainer leader the metrics, the progress line and the rollout dumps."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.runtime.loop import schedule
from milehpc.runtime.loop.state import LoopState
from milehpc.samples import Group, Sample, samples_of

if TYPE_CHECKING:
    from milehpc.comm.world import Comms
    from milehpc.config.job import JobSpec
    from milehpc.train.base import Trainer

SFT_SEED_OFFSET = 7919  # SFT warm-up draws from its own prompt stream, so RL sees the same prompts either way


class TrainerSide:
    """One trainer rank: the trainer, plus (on the trainer leader) metrics and dumps."""

    def __init__(self, job: JobSpec, trainer: Trainer, *, run_dir: Path | None, dp_rank: int = 0, dp_size: int = 1,
                 leader: bool = True, file: str | None = None, progress: bool = True) -> None:
        from milehpc.data.tokenizer import build_tokenizer

        self.job, self.trainer, self.run_dir = job, trainer, run_dir
        self.dp_rank, self.dp_size, self.leader = dp_rank, dp_size, leader
        self.tokenizer = build_tokenizer(job.model.tokenizer)
        self.state = LoopState()
        self.file = file
        self.metrics = None
        if leader and run_dir is not None:
            from milehpc.runtime.metrics import MetricsLogger

            self.metrics = MetricsLogger.for_job(job, run_dir, progress=progress, file=file)
        self.started = time.time()
        self.history: list[dict[str, float]] = []
        self.static: dict[str, float] = {}  # logged with the first step (world layout facts)
        # this step's metrics when a checkpoint is written before report() (colocated: while the trainer is resident)
        self.unreported: dict[str, float] | None = None

    # -- SFT warm-up --
    def sft_batches(self) -> Iterator[list[Sample]]:
        """This DP rank's labelled samples for each warm-up step (:func:`~milehpc.runtime.loop.sft_samples.sft_sample`:
        a text label all trained on; a multi-turn one with its non-assistant messages masked)."""
        from milehpc.data.source import build_source
        from milehpc.runtime.loop.sft_samples import sft_sample

        job = self.job
        source: Any
        if job.trainer.lora is not None and job.trainer.lora.adapters:  # each adapter's labels from its own stream
            from milehpc.data.adapters import adapter_mix

            source = adapter_mix(job, self.tokenizer, seed_offset=SFT_SEED_OFFSET, file=self.file)
        else:
            source = build_source(job.data, self.tokenizer, seed_offset=SFT_SEED_OFFSET, file=self.file)
        per_step = job.rollout.prompts_per_step * job.rollout.n_samples
        for _ in range(job.trainer.sft_warmup_steps):
            prompts = source.take(per_step)[self.dp_rank::self.dp_size]
            yield [sft_sample(self.tokenizer, p, file=job.data.source, field=job.data.label_key) for p in prompts]

    def warmup(self) -> None:
        """The supervised warm-up (once per run: a resumed run skips it), then the KL reference is frozen."""
        job = self.job
        if self.state.sft_done or job.trainer.sft_warmup_steps == 0:
            self.state.sft_done = True
            self.trainer.freeze_reference()
            return
        t0 = time.perf_counter()
        opt = self.trainer.sft_optimizer(job.trainer.sft_lr or job.trainer.lr)
        last: dict[str, float] = {}
        for samples in self.sft_batches():
            last = self.trainer.sft_step(samples, opt)
        self.state.sft_done = True
        self.trainer.freeze_reference()
        if self.metrics is not None:
            self.metrics.message(f"SFT warm-up: {job.trainer.sft_warmup_steps} steps in "
                                 f"{time.perf_counter() - t0:.1f}s, final loss {last.get('sft/loss', 0):.3f}")

    # -- one RL step --
    def filter_stale(self, groups: list[Group]) -> tuple[list[Group], dict[str, float]]:
        """Too-stale groups dropped or kept (:func:`schedule.filter_stale`), against the trainer's version."""
        return schedule.filter_stale(self.job, groups, self.trainer.version)

    def train(self, step: int, samples: list[Sample]) -> dict[str, float]:
        t0 = time.perf_counter()
        if samples:
            metrics = self.trainer.train_step(samples, step)
        else:
            metrics = {}
            self.trainer.skip_step()
        metrics["time/train"] = time.perf_counter() - t0
        self.state.weight_version = self.trainer.version
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
        if self.static:  # once per process: a resumed run records the layout it resumed at too
            metrics.update(self.static)
            self.static = {}
        self.history.append({"step": step, **metrics})
        self.unreported = None
        if self.metrics is not None:
            self.metrics.log(step, metrics)
            if self.job.run.check_logprobs and "train/logprob_diff_max" in metrics:
                self.metrics.message(f"step {step}: rollout vs trainer logprobs max |diff| "
                                     f"{metrics['train/logprob_diff_max']:.2e} mean "
                                     f"{metrics['train/logprob_diff_mean']:.2e}")
        if self.job.run.dump_rollouts and self.run_dir is not None and groups:
            from milehpc.samples.dumps import write_rollouts

            write_rollouts(self.run_dir, step, samples_of(groups),
                           {"trainer_version": self.state.weight_version})

    def target_reached(self, metrics: dict[str, float]) -> bool:
        """``run.target_reward`` reached over the last steps (:func:`schedule.target_reached`)."""
        return schedule.target_reached(self.job, self.history, metrics)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    # -- checkpoint --
    def state_dict(self) -> dict[str, Any]:
        rows = self.history + ([self.unreported] if self.unreported is not None else [])
        out = {"loop": self.state.state_dict(), "trainer": self.trainer.state_dict_for_checkpoint(),
               # the last steps' rewards: a resumed run judges run.target_reward over the same window
               "recent": [{"step": h["step"], "rollout/reward_mean": h["rollout/reward_mean"],
                           **{k: h[k] for k in schedule.target_keys(h)}}
                          for h in rows[-schedule.TARGET_WINDOW:] if "rollout/reward_mean" in h]}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state["loop"])
        self.trainer.load_checkpoint_state(state["trainer"])
        self.history = [dict(h) for h in state.get("recent", [])]
        self.drop_records_from(self.state.step)

    def drop_records_from(self, step: int) -> None:
        """This run logs and dumps ``step`` and later again: an earlier attempt's records of those steps go (a
        resumed run: from the restored step; a rerun with no checkpoint to resume: all of them)."""
        if self.metrics is not None:
            self.metrics.continue_from(step)
        if self.leader and self.run_dir is not None:
            from milehpc.samples.dumps import drop_from

            drop_from(self.run_dir, step)


def world_facts(comms: Comms) -> dict[str, float]:
    """What the run really ran on (logged with the first step): the MPI world and the torch.distributed (trainer)
    world."""
    import torch.distributed as dist

    facts = {"dist/mpi_world_size": float(comms.world.Get_size()),
             "dist/rollout_ranks": float(comms.plan.rollout_ranks)}
    if comms.plan.reward_ranks:
        facts["dist/reward_ranks"] = float(comms.plan.reward_ranks)
    if dist.is_available() and dist.is_initialized():
        facts["dist/trainer_world_size"] = float(dist.get_world_size())
    return facts

"""Pure scheduling of the loop: which weights each batch must be generated with, which samples are too stale,
how whole groups are dealt to DP ranks, when the target reward is reached, and the rollout metrics."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from milehpc.samples import Group

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec

TARGET_WINDOW = 10  # steps averaged for run.target_reward


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


def filter_stale(job: JobSpec, groups: list[Group], version: int) -> tuple[list[Group], dict[str, float]]:
    """Staleness = ``version`` (the trainer's) − the version that generated a sample. In the async loop a group
    older than ``run.max_staleness`` is dropped (``stale_policy = "drop"``) or kept for off-policy correction."""
    keep, dropped, worst, total = [], 0, 0, 0.0
    n = 0
    for g in groups:
        st = [version - s.weight_version for s in g]
        worst = max(worst, *st)
        total += sum(st)
        n += len(st)
        if job.run.loop == "async" and max(st) > job.run.max_staleness and job.run.stale_policy == "drop":
            dropped += 1
        else:
            keep.append(g)
    return keep, {"async/staleness_max": float(worst), "async/staleness_mean": total / max(n, 1),
                  "async/dropped_groups": float(dropped)}


def deal_groups(groups: list[Group], dp_size: int) -> list[list[Group]]:
    """Whole groups to DP ranks, balancing sample counts (largest first onto the lightest rank)."""
    shares: list[list[Group]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for g in sorted(groups, key=lambda g: (-len(g), g[0].group)):
        r = load.index(min(load))
        shares[r].append(g)
        load[r] += len(g)
    return shares


def target_reached(job: JobSpec, history: list[dict[str, float]], metrics: dict[str, float],
                   window: int = TARGET_WINDOW) -> bool:
    """``run.target_reward`` reached by the mean reward of the last ``window`` steps (``history`` and this step's
    ``metrics``): one lucky batch does not end a run."""
    t = job.run.target_reward
    if t is None or "rollout/reward_mean" not in metrics:
        return False
    recent = [h["rollout/reward_mean"] for h in history[-(window - 1):] if "rollout/reward_mean" in h]
    recent.append(metrics["rollout/reward_mean"])
    return len(recent) >= min(window, job.run.steps) and sum(recent) / len(recent) >= t


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


def samples_of(groups: list[Group]) -> list:
    """The samples of ``groups``, in order."""
    return [s for g in groups for s in g]

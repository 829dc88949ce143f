"""Pure scheduling of the loop: which weights each batch must be generated with, which samples are too stale,
how whole groups are dealt to DP ranks, and when the target reward is reached."""

from __future__ import annotations

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
    ``metrics``): one lucky batch does not end a run. Several adapters: by every adapter's own mean reward."""
    t = job.run.target_reward
    if t is None or "rollout/reward_mean" not in metrics:
        return False
    for key in target_keys(metrics):
        recent = [h[key] for h in history[-(window - 1):] if key in h]
        recent.append(metrics[key])
        if len(recent) < min(window, job.run.steps) or sum(recent) / len(recent) < t:
            return False
    return True


def target_keys(metrics: dict[str, float]) -> list[str]:
    """The rewards ``run.target_reward`` judges: each adapter's (multi-LoRA), else the step's."""
    return [k for k in metrics if k.startswith("adapter/") and k.endswith("/reward_mean")] or ["rollout/reward_mean"]

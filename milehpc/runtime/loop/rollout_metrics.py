"""The rollout side's raw counters of a step (summed over the engines) and the ``rollout/*`` metrics reported from
them; the trainer side's metrics come from the trainer (``train/*``) and the drivers (``time/*``)."""

from __future__ import annotations

import math

COUNTERS = ("reward_sum", "reward_sq", "scored", "samples", "failed", "truncated", "filtered", "carried",
            "resp_tokens", "gen_tokens", "groups", "time_gen", "time_reward", "engine_restarts")
PART = "reward_part/"  # the sum of a dict reward's entry over the scored samples: reported as reward/<entry>


def new_stats() -> dict[str, float]:
    """One engine's raw counters of a step, all zero (the rollout side fills them)."""
    return dict.fromkeys(COUNTERS, 0.0)


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
    out["rollout/gen_tokens"] = stats.get("gen_tokens", 0.0)
    out["rollout/engine_restarts"] = stats.get("engine_restarts", 0.0)
    for key in ("wait_weights", "load_weights", "rm_offload", "rm_onload"):  # separate rollout ranks; colocated RM
        if f"time_{key}" in stats:
            out[f"time/{key}"] = stats[f"time_{key}"]
    if stats.get("time_gen", 0.0) > 0:
        out["perf/gen_tokens_per_s"] = stats.get("gen_tokens", 0.0) / stats["time_gen"]
    for key in ("failed", "dropped", "rescored", "restarts", "offloaded_gib"):  # [reward_model]: its scorer's counts
        if f"reward_{key}" in stats:
            out[f"reward/{key}"] = stats[f"reward_{key}"]
    for key, total in stats.items():
        if key.startswith(PART):  # e.g. combine's parts: the exact-match score beside the reward model's
            out["reward/" + key.removeprefix(PART)] = total / n
    for key, total in stats.items():
        if key.startswith("agent/"):  # the agent generator's counts (summed): episodes, divergences, timeouts...
            out[key] = total
    if any(k.startswith("adapter/") for k in stats):  # multi-LoRA: adapter/<NAME>/reward_mean, .../samples
        from milehpc.runtime.loop.adapter_streams import adapter_metrics

        out.update(adapter_metrics(stats))
    return out

"""Load balancing over several rollout engines (milehpc's own).

sglang-router balances HTTP requests over SGLang *servers*; milehpc runs each engine in-process on its leader rank
(see :mod:`milehpc.rollout.sglang_engine`), so there is nothing for sglang-router to route to. Balancing happens
where the loop hands work to engine leaders over MPI, with the two policies that matter for RL rollouts:

* **group affinity** — all ``n`` samples of a prompt go to the same engine, so its radix cache computes the
  prompt's KV cache once (what sglang-router's cache-aware policy approximates with prefix trees);
* **least outstanding tokens** — a group costs ``n * (prompt_len + max_new_tokens)`` tokens (an upper bound that
  is known before generation); each group goes to the engine with the least work assigned, largest groups first
  (LPT scheduling: within 4/3 of the optimum makespan).

Dead engines (failed health check) get nothing until restarted; their unfinished work is re-planned onto the rest.
Pure Python: no torch, no MPI.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GroupCost:
    """One prompt group to place."""

    group: int
    prompt_len: int
    n: int
    max_new_tokens: int
    done_tokens: int = 0  # partial rollouts: tokens already generated (they cost no new work)

    @property
    def tokens(self) -> int:
        return max(0, self.n * (self.prompt_len + self.max_new_tokens) - self.done_tokens)


@dataclass
class Router:
    """Assign prompt groups to engines; tracks the work in flight per engine."""

    engines: int
    load: list[int] = field(default_factory=list)
    alive: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError("a router needs at least one engine")
        self.load = self.load or [0] * self.engines
        self.alive = self.alive or [True] * self.engines

    def mark_dead(self, engine: int) -> None:
        self.alive[engine] = False
        self.load[engine] = 0

    def mark_alive(self, engine: int) -> None:
        self.alive[engine] = True

    def assign(self, groups: Sequence[GroupCost]) -> dict[int, list[int]]:
        """Engine index → group ids (in the order given); adds the work to :attr:`load`."""
        live = [e for e in range(self.engines) if self.alive[e]]
        if not live:
            raise RuntimeError("no live rollout engine to assign work to")
        heap = [(self.load[e], e) for e in live]
        heapq.heapify(heap)
        placed: dict[int, list[int]] = {e: [] for e in live}
        order = {g.group: i for i, g in enumerate(groups)}
        for g in sorted(groups, key=lambda g: (-g.tokens, order[g.group])):
            load, e = heapq.heappop(heap)
            placed[e].append(g.group)
            self.load[e] = load + g.tokens
            heapq.heappush(heap, (self.load[e], e))
        for e in placed:
            placed[e].sort(key=order.__getitem__)
        return placed

    def finished(self, engine: int, tokens: int) -> None:
        """Engine ``engine`` completed ``tokens`` of its assigned work."""
        self.load[engine] = max(0, self.load[engine] - tokens)

    def reassign(self, dead: int, groups: Sequence[GroupCost]) -> dict[int, list[int]]:
        """Engine ``dead`` failed with ``groups`` unfinished: place them on the live engines."""
        self.mark_dead(dead)
        return self.assign(groups)


def split_prompts(prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, engines: int,
                  router: Router | None = None) -> list[list[int]]:
    """Per engine, the indices of ``prompts`` it generates (whole groups, balanced by token cost)."""
    router = router or Router(engines)
    costs = [GroupCost(i, len(p), n, max_new_tokens) for i, p in enumerate(prompts)]
    placed = router.assign(costs)
    return [placed.get(e, []) for e in range(engines)]

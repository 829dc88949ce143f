"""examples/frontier-grpo.toml's vLLM engines (issue 34): the KV budget the example sets (vLLM's cache is an explicit
``rollout.options.kv_cache_gib``, not a share of the GCD) holds each engine's share of a step decoded at once, and
`milehpc plan --site frontier-like` counts that budget and finds the rank within an MI250X GCD (64 GiB). The
example's default budget (0.5 GiB, before this test) held 6 of the engine's 32 sequences: the rest queued."""

from __future__ import annotations

import json
import math
from pathlib import Path

from click.testing import CliRunner
from example_inputs import frontier_sets

from milehpc import memory
from milehpc.cli import cli
from milehpc.config.load import load_job
from milehpc.config.vllm_options import parse_options

ROOT = Path(__file__).resolve().parents[1]
FRONTIER = ROOT / "examples" / "frontier-grpo.toml"
GIB = 2**30
GCD_GIB = 64.0  # an MI250X GCD (site-configs/frontier-like.toml devices.memory_gib)


def test_the_frontier_examples_kv_budget_holds_a_step_and_plan_counts_it() -> None:
    job = load_job(FRONTIER, frontier_sets())
    ro, m = job.rollout, job.model
    assert ro.engine == "vllm" and ro.gpus_per_engine == 1
    # Each engine's share of a step, every sequence at its longest (plan's prompt length + max_new_tokens), at the
    # bf16 K and V of every layer's KV heads: computed from the example's own [model] table.
    sequences = math.ceil(ro.prompts_per_step / ro.engines) * ro.n_samples
    tokens = sequences * (memory.prompt_tokens(job)[0] + ro.max_new_tokens)
    per_token = 2 * m.num_layers * m.num_kv_heads * (m.hidden_size // m.num_heads) * 2
    budget = parse_options(ro.options).kv_cache_gib * GIB
    assert budget >= tokens * per_token, (budget / GIB, tokens * per_token / GIB)
    res = CliRunner().invoke(cli, ["plan", str(FRONTIER), "--site", "frontier-like", "--json",
                                   *(a for s in frontier_sets() for a in ("--set", s))])
    assert res.exit_code == 0, res.output
    rows = [r for r in json.loads(res.stdout)["memory"] if r["rank"] == "rollout"]
    kv = next(r for r in rows if r["item"] == "KV cache")
    assert kv["bytes"] == int(budget), kv
    total = next(r for r in rows if r["item"] == "total")
    assert total["note"].startswith("fits") and f"of {GCD_GIB} GiB" in total["note"], total

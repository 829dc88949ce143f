"""Evaluation on held-out prompts (``data.val_source``, ``[eval]``): the engine answers each prompt greedily and/or
``n_samples`` times, the job's reward routing scores the answers, and the per-prompt results become accuracy,
pass@k and mean reward per data source and overall.

Multi-LoRA (``[trainer.lora.adapters.NAME]``): the prompts are each adapter's ``val_source`` (at most
``eval.max_prompts`` each), answered with that adapter and scored with its reward, in batches of their own (batch
``b`` of an adapter seeded ``eval.seed + b``: an adapter's numbers do not depend on the others'); the per-source
metrics are per adapter (``eval/<NAME>/acc``).

Used by the RL loop every ``run.eval_every`` steps (:mod:`milehpc.runtime.loop.evaluation`) and by ``milehpc eval``
(:mod:`milehpc.runtime.evaluate_checkpoint`). The prompts are cut into fixed batches of ``eval.batch_size``; batch
``b`` samples from its own seed ``eval.seed + b`` (never the engine's training stream), so the results depend on
the weights alone: the same with one engine or several (engine ``e`` of ``E`` answers batches ``b % E == e``), in
the loop and after the fact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from milehpc.data.adapters import AdapterValidation
from milehpc.data.images import prompt_images
from milehpc.rollout.engine import SamplingParams
from milehpc.samples import ADAPTER_KEY, Sample, Status

if TYPE_CHECKING:
    from milehpc.config.job import EvalSpec, JobSpec
    from milehpc.data.source import Prompt, PromptSource
    from milehpc.rollout.engine import Engine

VAL_SEED_OFFSET = 104_729  # a task:NAME validation source draws other examples than the training stream
DEFAULT_SOURCE = "default"  # the data source of prompts that carry none


# ---- the maths (pure) --------------------------------------------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code"): ``1 - C(n-c, k) / C(n, k)``, as the paper's stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass
class PromptResult:
    """One validation prompt's scores: the greedy answer's reward (None without greedy) and each sampled answer's;
    and the greedy answer itself (token ids and text), which the loop writes to ``RUN_DIR/evals/``."""

    position: int  # in the validation stream: results merge by it
    source: str
    greedy: float | None = None
    sampled: list[float] = field(default_factory=list)
    prompt: str = ""
    greedy_ids: list[int] | None = None
    greedy_text: str | None = None


def eval_metrics(results: Sequence[PromptResult], *, threshold: float, ks: Sequence[int]) -> dict[str, float]:
    """``eval/<source>/...`` and overall ``eval/...``: ``acc`` (greedy answers at or above ``threshold``),
    ``pass@k`` (mean over prompts of :func:`pass_at_k`), ``reward_mean`` (greedy answers; the sampled ones without
    greedy) and ``prompts``. Overall values weigh every prompt alike (not every source)."""
    by: dict[str, list[PromptResult]] = {}
    for r in results:
        by.setdefault(r.source, []).append(r)
    out: dict[str, float] = {}
    for prefix, part in [*((f"eval/{s}/", by[s]) for s in sorted(by)), ("eval/", list(results))]:
        if not part:
            continue
        out[f"{prefix}prompts"] = float(len(part))
        greedy = [r.greedy for r in part if r.greedy is not None]
        if greedy:
            out[f"{prefix}acc"] = sum(g >= threshold for g in greedy) / len(greedy)
        sampled = [r for r in part if r.sampled]
        for k in ks:
            if sampled:
                out[f"{prefix}pass@{k}"] = sum(pass_at_k(len(r.sampled), sum(x >= threshold for x in r.sampled), k)
                                               for r in sampled) / len(sampled)
        rewards = greedy or [x for r in sampled for x in r.sampled]
        if rewards:
            out[f"{prefix}reward_mean"] = sum(rewards) / len(rewards)
    return out


def spec_metrics(spec: EvalSpec, results: Sequence[PromptResult]) -> dict[str, float]:
    """:func:`eval_metrics` with the job's ``[eval]`` threshold and ks."""
    return eval_metrics(results, threshold=spec.correct_threshold, ks=spec.pass_k if spec.n_samples else ())


def merge_results(parts: Sequence[Sequence[PromptResult]]) -> list[PromptResult]:
    """The engines' results in stream order; a prompt answered twice (ranks sharing one engine) counts once."""
    seen: dict[int, PromptResult] = {}
    for part in parts:
        for r in part:
            seen.setdefault(r.position, r)
    return [seen[p] for p in sorted(seen)]


# ---- the evaluator ----------------------------------------------------------------------------------------------

class Evaluator:
    """The validation prompts, their reward routing and the ``[eval]`` sampling of one job (see the module
    docstring). ``data``: another prompt file instead of ``data.val_source`` (``milehpc eval --data``)."""

    def __init__(self, job: JobSpec, tokenizer: Any, *, data: str | None = None, file: str | None = None) -> None:
        from milehpc import plugins
        from milehpc.config.schema import merge_params
        from milehpc.data.adapters import adapter_validation
        from milehpc.data.source import build_source, task_reward_name
        from milehpc.rewards.routing import adapter_scorer, reward_scorer

        self.job, self.tokenizer, self.spec = job, tokenizer, job.eval
        spec = replace(job.data, val_source=data) if data else job.data
        adapters = job.trainer.lora.adapters if job.trainer.lora is not None else {}
        self.default_source = DEFAULT_SOURCE
        if adapters:  # multi-LoRA: each adapter's val_source, answered with that adapter, scored with its reward
            self.source: PromptSource | AdapterValidation = adapter_validation(
                job, tokenizer, max_prompts=self.spec.max_prompts, seed_offset=VAL_SEED_OFFSET, file=file)
            self.scorer: Any = adapter_scorer(job, file=file)
        else:
            self.source = build_source(spec, tokenizer, seed_offset=VAL_SEED_OFFSET, file=file, split="validation")
            # A task:NAME validation source brings its task's reward (the training source's otherwise).
            val = spec.val_source or ""
            reward_of = replace(spec, source=val) if val.startswith("task:") else spec
            self.scorer = reward_scorer(job.reward, task_reward_name(reward_of) or None,
                                        sources=self.source.data_sources, file=file)
            self.default_source = val.removeprefix("task:") if val.startswith("task:") else DEFAULT_SOURCE
        size = len(self.source.examples)
        self.size = min(size, self.spec.max_prompts) if self.spec.max_prompts and not adapters else size
        ro = job.rollout
        self.base = SamplingParams(temperature=self.spec.temperature, top_p=self.spec.top_p, top_k=self.spec.top_k,
                                   max_new_tokens=self.spec.max_new_tokens or ro.max_new_tokens, stop=list(ro.stop))
        self.generator: Callable[..., list[Sample]] | None = None
        self.generator_params: dict[str, Any] = {}
        if ro.generator:  # a multi-turn job is evaluated through its own generator, as it is trained
            self.generator_params = merge_params(plugins.lookup("generator", ro.generator).defaults,
                                                 ro.generator_params)
            self.generator = plugins.load("generator", ro.generator)

    @property
    def summary(self) -> str:
        return f"eval: {self.size} validation prompts from {self.source.name}"

    @property
    def batches(self) -> list[tuple[int, range]]:
        """(seed offset, positions) of each batch of ``eval.batch_size`` prompts. Several adapters: each adapter's
        prompts in batches of their own, counted from 0, so an adapter's numbers do not depend on the others'."""
        bs = self.spec.batch_size
        spans = self.source.spans if isinstance(self.source, AdapterValidation) else [range(self.size)]
        return [(b, span[b * bs:(b + 1) * bs]) for span in spans for b in range(-(-len(span) // bs))]

    def run(self, engine: Engine, *, engine_index: int = 0, num_engines: int = 1) -> list[PromptResult]:
        """This engine's share of the validation batches, answered and scored with the engine's current weights."""
        out: list[PromptResult] = []
        for b, positions in self.batches[engine_index::num_engines]:
            prompts = [self.source.peek(i) for i in positions]
            results = {p.index: PromptResult(p.index, self._source_of(p), prompt=p.text) for p in prompts}
            if self.spec.greedy:
                for s in self._answer(engine, prompts, replace(self.base, temperature=0.0, n=1, seed=self.spec.seed + b)):
                    r = results[s.group]
                    r.greedy, r.greedy_ids, r.greedy_text = self._reward(s), list(s.response_ids), s.response_text
            if self.spec.n_samples:
                sp = replace(self.base, n=self.spec.n_samples, seed=self.spec.seed + b)
                for s in self._answer(engine, prompts, sp):
                    results[s.group].sampled.append(self._reward(s))
            out.extend(results.values())
        return out

    def metrics(self, results: Sequence[PromptResult]) -> dict[str, float]:
        return spec_metrics(self.spec, results)

    def _source_of(self, prompt: Prompt) -> str:
        """What the per-source metrics group by: the prompt's adapter (multi-LoRA), else its data source."""
        value = prompt.metadata.get(ADAPTER_KEY, prompt.metadata.get("data_source"))
        return self.default_source if value is None else str(value)

    def _answer(self, engine: Engine, prompts: list[Prompt], sp: SamplingParams) -> list[Sample]:
        """Generate and score; each sample's ``group`` is its prompt's stream position. Multi-LoRA: each prompt
        with its adapter."""
        if any(ADAPTER_KEY in p.metadata for p in prompts):
            sp = replace(sp, adapters=[p.metadata.get(ADAPTER_KEY) for p in prompts])
        if (shown := prompt_images(prompts)) is not None:  # a VL model's image prompts (by reference)
            sp = replace(sp, images=shown)
        if self.generator is not None:
            out = self.generator(engine, prompts, sp, **self.generator_params)
        else:
            out = engine.generate([p.ids for p in prompts], sp)
        for s in out:
            p = prompts[s.group]
            s.group, s.label, s.prompt_text = p.index, p.label, p.text
            s.metadata.update(p.metadata)
            if self.generator is None:
                s.response_text = self.tokenizer.decode(s.response_ids)
        scored = [s for s in out if s.reward is None]
        if scored:
            from milehpc.rewards.model_scorers import models_on_device

            with models_on_device():  # a colocated reward model is off the device between steps
                self.scorer.score(scored)
        return out

    @staticmethod
    def _reward(sample: Sample) -> float:
        return 0.0 if sample.status is Status.FAILED else sample.scalar_reward


def results_to_json(results: Sequence[PromptResult]) -> list[dict[str, Any]]:
    """Plain records (a pickled or JSON message between ranks, the ``eval/step_N.json`` file)."""
    return [{"position": r.position, "source": r.source, "greedy": r.greedy, "sampled": list(r.sampled),
             "prompt": r.prompt, "greedy_ids": r.greedy_ids, "greedy_text": r.greedy_text} for r in results]


def results_from_json(rows: Sequence[dict[str, Any]]) -> list[PromptResult]:
    # .get: files written before the answers were kept have scores only
    return [PromptResult(int(r["position"]), str(r["source"]), r["greedy"], list(r["sampled"]), r.get("prompt", ""),
                         r.get("greedy_ids"), r.get("greedy_text")) for r in rows]


def answer_rows(results: Sequence[PromptResult], *, step: int, weight_version: int) -> list[dict[str, Any]]:
    """One evaluation's answers, one record per prompt in stream order (the lines of ``RUN_DIR/evals/
    step_NNNNNNNN.jsonl``): the greedy answer's token ids and text (None without ``[eval].greedy``) and its reward,
    the sampled answers' rewards, and the weights that answered."""
    return [{"step": step, "weight_version": weight_version, "position": r.position, "data_source": r.source,
             "prompt": r.prompt, "response_ids": r.greedy_ids, "response": r.greedy_text, "reward": r.greedy,
             "sampled_rewards": list(r.sampled)} for r in sorted(results, key=lambda r: r.position)]

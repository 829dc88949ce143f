"""The ``judge`` reward: a generative judge (a causal LM from a local folder) generating on the reference engine in
this process, asked with the job's ``template`` (fields ``{prompt}``, ``{response}``, ``{label}``) and graded by
:func:`milehpc.rewards.model_scorers.parse_answer`. Greedy first; an answer without a grade is asked again, sampled
at ``retry_temperature``, up to ``retries`` times; a sample still without a grade fails (never scored 0). Its
parameters are declared in :mod:`milehpc.builtin.rewards`."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

from milehpc.rewards.model_scorers import cached, model_folder, parse_answer, prompt_text
from milehpc.samples import Sample

log = logging.getLogger(__name__)


class Judge:
    """A causal LM asked to grade, generating on the reference engine in this process."""

    def __init__(self, path: str, tokenizer: str = "", seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        from milehpc.data.tokenizer import build_tokenizer
        from milehpc.rollout.reference import ReferenceEngine

        folder = model_folder(path)
        tok_name = tokenizer or str(folder)
        self.tokenizer = build_tokenizer(tok_name if tok_name == "toy" else str(model_folder(tok_name, field="tokenizer")))
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
        self.engine = ReferenceEngine(model, self.tokenizer, seed=seed)
        self.lock = threading.Lock()  # the engine's sampling stream is not shared between threads

    def answers(self, prompts: list[str], *, chat_template: bool, max_new_tokens: int,
                temperature: float) -> list[str]:
        """The judge's answer text for each judge prompt (greedy at temperature 0)."""
        from milehpc.rollout.engine import SamplingParams

        ids = [self.tokenizer.encode_prompt(p, chat_template=chat_template) for p in prompts]
        sp = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=1)
        with self.lock:
            out = self.engine.generate(ids, sp)
        return [s.response_text for s in out]


def load_judge(path: str, tokenizer: str = "", seed: int = 0) -> Judge:
    """The judge of ``path``, loaded once per process."""
    return cached(("judge", str(model_folder(path).resolve()), tokenizer, str(seed)), lambda: Judge(path, tokenizer, seed))


def score_judge(samples: Sequence[Sample], *, path: str, tokenizer: str = "", engine: str = "reference",
                template: str = "{prompt}{response}", chat_template: bool = False,
                answer_pattern: str = r"(-?\d+(?:\.\d+)?)", answer_map: dict[str, float] | None = None,
                scale: float = 1.0, max_new_tokens: int = 16, batch_size: int = 32, retries: int = 2,
                retry_temperature: float = 1.0, seed: int = 0) -> list[Any]:
    """One value per sample: ``{"score", "judge_answer", "judge_retries"}``, or why it has none. Answers that do
    not parse are asked again, sampled at ``retry_temperature``, up to ``retries`` times."""
    judge = load_judge(path, tokenizer, seed)
    prompts = [template.format(prompt=prompt_text(s), response=s.response_text, label=s.label or "") for s in samples]
    out: list[Any] = [None] * len(samples)
    tries = [0] * len(samples)
    todo = list(range(len(samples)))
    last: dict[int, str] = {}
    for attempt in range(retries + 1):
        temperature = 0.0 if attempt == 0 else retry_temperature
        for start in range(0, len(todo), batch_size):
            part = todo[start:start + batch_size]
            try:
                answers = judge.answers([prompts[i] for i in part], chat_template=chat_template,
                                        max_new_tokens=max_new_tokens, temperature=temperature)
            except Exception as err:  # the engine failed this batch: its samples are tried again
                log.warning("judge %s failed on %d prompts: %s: %s", path, len(part), type(err).__name__, err)
                for i in part:
                    last[i] = f"{type(err).__name__}: {err}"
                continue
            for i, answer in zip(part, answers, strict=True):
                grade = parse_answer(answer, answer_pattern, answer_map or {}, scale)
                if grade is None:
                    last[i] = f"no grade in the judge's answer {answer[:80]!r}"
                else:
                    out[i] = {"score": grade, "judge_answer": grade * scale, "judge_retries": float(attempt)}
        todo = [i for i in todo if out[i] is None]
        for i in todo:
            tries[i] += 1
        if not todo:
            break
    for i in todo:
        out[i] = RuntimeError(f"judge gave no grade in {tries[i]} tries: {last.get(i, '?')}")
    return out


async def judge(samples: Sequence[Sample], **params: Any) -> list[Any]:
    """The ``judge`` reward: :func:`score_judge` in a worker thread (so ``reward.timeout_s`` holds)."""
    return await asyncio.to_thread(score_judge, samples, **params)


def _validate_judge(params: dict[str, Any], file: str | None = None) -> None:
    model_folder(params["path"], file)
    if params.get("tokenizer") not in ("", "toy", None):
        model_folder(params["tokenizer"], file, "tokenizer")


judge.validate_params = _validate_judge  # type: ignore[attr-defined]

"""A shipped multi-turn toy environment for the custom-generation hook (``[rollout] generator = "toy_retry"``).

The engine is called turn by turn on token ids. After a wrong answer the environment appends feedback tokens
(``?K=``: K = how many positions were right) and the model answers again. Environment tokens are part of the
response with loss mask 0 and logprob 0, so the trainer learns only from the model's own tokens. Reward: 1 for
a right first answer, ``0.7 ** (turn - 1)`` for a right later one, else ``partial`` credit of the last answer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from milehpc.data.tasks import match_score
from milehpc.rollout.engine import SamplingParams
from milehpc.samples import Sample


def retry_generator(engine: Any, prompts: list[Any], sampling: SamplingParams, *, max_turns: int = 2,
                    partial: float = 0.0) -> list[Sample]:
    """``prompts``: :class:`milehpc.data.source.Prompt` items (token ids + label). Returns ``sampling.n``
    samples per prompt, prompt-major, each with its reward already set."""
    tok = engine.tokenizer
    samples = engine.generate([p.ids for p in prompts], sampling)
    answers = {id(s): s.response_ids[:] for s in samples}
    turns = {id(s): 1 for s in samples}
    label = {id(s): str(prompts[s.group].label) for s in samples}
    one = replace(sampling, n=1)
    for turn in range(2, max_turns + 1):
        retry = []
        for s in samples:
            got = tok.decode(answers[id(s)])
            if turns[id(s)] == turn - 1 and match_score(got, label[id(s)]) < 1.0 and s.status.value != "failed":
                right = sum(a == b for a, b in zip(got, label[id(s)], strict=False))
                feedback = tok.encode(f"?{min(right, 9)}=")
                s.response_ids += feedback
                s.loss_mask += [0] * len(feedback)
                s.rollout_logprobs += [0.0] * len(feedback)
                retry.append(s)
        if not retry:
            break
        before = {id(s): len(s.response_ids) for s in retry}
        engine.generate([], one, samples=retry)
        for s in retry:
            answers[id(s)] = s.response_ids[before[id(s)]:]
            turns[id(s)] = turn
    for s in samples:
        got = tok.decode(answers[id(s)])
        score = match_score(got, label[id(s)])
        s.reward = 0.7 ** (turns[id(s)] - 1) if score == 1.0 else match_score(got, label[id(s)], partial)
        s.response_text = tok.decode(s.response_ids)
        s.metadata["turns"] = turns[id(s)]
        s.metadata["answer"] = got
    return samples

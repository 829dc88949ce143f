"""Train the tiny generative judge of examples/cpu-demo-judge.toml: a GPT-2 causal LM (2 layers, 64 wide) that reads
an answer to the digit-sorting task in the judge's template (``sort:312=132:``), writes the prompt's digits sorted and
then its verdict, ``=1`` (right) or ``=0`` (wrong), which the ``judge`` reward parses (ANSWER_PATTERN). Saved as an
HF folder (model + tokenizer) that the judge loads with AutoModelForCausalLM. No downloads: the data are those of
examples/sort_rm.py (its prompts, right answers and hard negatives: a wrong order, a digit changed with the answer
still sorted, a digit dropped or added, the prompt echoed, junk); the loss is on the judge's answer alone. 1500 steps
(seed 0): held-out verdicts right on 1.0 of right answers and 0.95-1.0 of each kind of wrong one (README).

    .venv/bin/python examples/sort_judge.py runs/sort-judge   # then: milehpc run examples/cpu-demo-judge.toml ...
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import time
from pathlib import Path
from typing import Any

SUFFIX = ":"  # the judge template's end, "{prompt}{response}:": where the judge's answer follows
VERDICTS = {True: "1", False: "0"}
# The verdict: after the judge's own sorted answer ("123=1", decoded "1 2 3 = 1"), or alone: on answers unlike its
# training data (a policy's reply holding "=" or ":") it sometimes writes the bare verdict.
ANSWER_PATTERN = r"(?:^|=)\s*([01])\s*$"


def _sort_rm() -> Any:
    """examples/sort_rm.py (the task's tokenizer, model shape and data), imported from beside this file."""
    if "sort_rm" in sys.modules:
        return sys.modules["sort_rm"]
    spec = importlib.util.spec_from_file_location("sort_rm", Path(__file__).with_name("sort_rm.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["sort_rm"] = module
    spec.loader.exec_module(module)
    return module


sort_rm = _sort_rm()


def judge_batch(data: Any, n: int, kind: str | None = None) -> tuple[list[str], list[str], list[bool]]:
    """``n`` judge prompts (prompt + answer + SUFFIX) in pairs of one prompt's right answer and a wrong one (of
    ``kind``, else drawn like sort_rm's training batches), the judge's answer to each (:func:`judge_answer`) and
    whether each is right."""
    texts, targets = data.labelled(n, kind)
    answers = [judge_answer(t) for t in texts]
    return [t + SUFFIX for t in texts], answers, [y == 1.0 for y in targets]


def judge_answer(text: str) -> str:
    """What the judge is trained to write after ``sort:312=132``: the prompt's digits sorted, then its verdict
    (``123=0``). Writing the right answer first leaves a comparison of two strings to the verdict: held-out, seed 0,
    1500 steps, 0.95 of the sorted answers with a digit changed were judged wrong (0.48 after 600 steps). Asked for
    the verdict alone (one token after the template), the same model judged only 0.40 (600 steps) and 0.44 (1500) of
    them wrong, and 0.66-0.72 of the wrong orders: the comparison with the prompt's digits is the hard part."""
    prompt, reply = text.split("=", 1)
    right = sort_rm.answer(prompt.removeprefix("sort:"))
    return f"{right}={VERDICTS[reply == right]}"


def train(out: Path, *, steps: int = 1500, lr: float = 2e-3, batch: int = 64, seed: int = 0, hidden: int = 64,
          log: Any = print, held_out: int = 256) -> dict[str, float]:
    """Train the judge and save it in ``out``; returns its held-out accuracies (:func:`held_out_accuracy`) and the
    seconds taken."""
    with sort_rm.one_torch_thread():
        return _train(out, steps=steps, lr=lr, batch=batch, seed=seed, hidden=hidden, log=log, held_out=held_out)


def _train(out: Path, *, steps: int, lr: float, batch: int, seed: int, hidden: int, log: Any,
           held_out: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = sort_rm.save_tokenizer(out)
    data = sort_rm.Examples(seed)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_config(sort_rm.rm_config(len(tok), hidden))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - k / steps)  # linear decay: a steadier end
    for step in range(steps):
        prompts, answers, _ = judge_batch(data, batch)
        enc = tok([p + a + tok.eos_token for p, a in zip(prompts, answers, strict=True)], padding=True,
                  return_tensors="pt")
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        for row, p in enumerate(prompts):
            labels[row, :len(p)] = -100  # one token per character: the loss is on the judge's answer alone
        loss = model(**enc, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0:
            log(f"judge step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.1f} s)")
    model.eval()
    figures = held_out_accuracy(model, tok, sort_rm.Examples(seed + 1), n=held_out)
    model.save_pretrained(out)
    seconds = time.perf_counter() - t0
    log(f"judge in {out} ({seconds:.1f} s), held-out accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    return {**figures, "seconds": seconds}


def greedy_answers(model: Any, tok: Any, prompts: list[str], max_new_tokens: int = 8) -> list[str]:
    """The judge's greedy answer to each prompt (as the judge reward asks it: temperature 0)."""
    import torch

    tok.padding_side = "left"
    try:
        enc = tok(prompts, padding=True, return_tensors="pt")
    finally:
        tok.padding_side = "right"
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def verdict(answer: str) -> str | None:
    """The verdict the judge reward parses from ``answer`` (its ANSWER_PATTERN), or None."""
    found = re.search(ANSWER_PATTERN, answer)
    return found[1] if found else None


def held_out_accuracy(model: Any, tok: Any, data: Any, n: int = 256) -> dict[str, float]:
    """The share of fresh judge prompts whose greedy verdict is right: ``right`` over right answers, then one figure
    per kind of wrong answer (sort_rm.KINDS)."""
    figures: dict[str, float] = {}
    rights: list[bool] = []
    for kind in sort_rm.KINDS:
        prompts, _, right = judge_batch(data, 2 * n, kind)
        said = [verdict(a) for a in greedy_answers(model, tok, prompts)]
        rights += [s == VERDICTS[True] for s, r in zip(said, right, strict=True) if r]
        wrong = [s for s, r in zip(said, right, strict=True) if not r]
        figures[kind] = sum(s == VERDICTS[False] for s in wrong) / len(wrong)
    return {"right": sum(rights) / len(rights), **figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the judge into")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args(argv)
    train(args.out, steps=args.steps, seed=args.seed, hidden=args.hidden)
    return 0


if __name__ == "__main__":
    sys.exit(main())

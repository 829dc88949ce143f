"""Train the tiny reward model of examples/cpu-demo-rm.toml: a GPT-2 sequence classifier (2 layers, 64 wide) that
scores answers to the digit-sorting task (``sort:312=`` -> ``123``), saved as an HF folder (model + tokenizer) that
the ``reward_model`` reward loads with AutoModelForSequenceClassification. No downloads; the data come from the task
itself: each batch holds pairs of one prompt, its right answer and a wrong one (KINDS: a wrong order, a digit changed
with the answer still sorted, a digit dropped or added, the prompt echoed, junk), and the RM is trained to predict a
graded target (:func:`grade`: 1 for the right answer, 0.09-0.45 for near misses, ~0 for junk).

The example trains its policy against this RM alone, so the RM has to catch the policy's near misses by itself. What
it took: the sorted answers with a digit changed (what the policy fooled earlier RMs with, and which only a
comparison of the answer's digits with the prompt's tells) as 8 of 14 wrong answers, the graded target rather than
0/1 (every wrong answer then teaches the RM to count digits), and 1000 steps. In trials with a GPT-2 classifier of
the same size, held-out preference accuracy against that kind was 0.94 after 400 and 600 steps; a policy trained
against the 400-step one climbed to ~0.6 exact match and stayed there while the RM's score rose to ~0.86 (it had
found the RM's misses); with 0/1 targets the RM needed ~1500 steps to teach the policy (0.14 -> 0.85 exact match in
223 steps).

    .venv/bin/python examples/sort_rm.py runs/sort-rm        # then: milehpc run examples/cpu-demo-rm.toml --site local
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DIGITS = "0123456789"
CHARS = DIGITS + "sort:="
SPECIALS = ("<pad>", "<unk>", "<eos>")


def save_tokenizer(out: Path) -> Any:
    """A character-level HF tokenizer of the task's alphabet (one token per character), saved into ``out``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIALS, *CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(out)
    return fast


def rm_config(vocab_size: int, hidden: int = 64) -> Any:
    """A GPT-2 classifier, no dropout (the data are endless). A Qwen2 one of the same size trained the same way taught
    the policy for seed 0 (0.8 in 190 steps), but for seed 1 it was 0.91 against the changed-digit near misses and
    fooled (exact match 0.53-0.65 at steps 220-260 while its score was 0.80-0.85); GPT-2: 0.98-1.0, seeds 0-2."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=2, n_head=4, n_inner=2 * hidden, n_positions=32,
                      pad_token_id=0, eos_token_id=2, bos_token_id=2, num_labels=1, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)


def answer(s: str) -> str:
    return "".join(sorted(s))


JUNK = DIGITS + "abcxyz +-"  # what an untrained policy also prints (letters read as <unk> here)
# The wrong answers the RM is trained against, and how often: mostly the near misses a learning policy makes, above
# all those that are still in sorted order (right order, wrong digits), which only a comparison with the prompt's
# digits can tell apart.
KINDS = {"order": 2, "changed": 8, "dropped": 1, "added": 1, "echo": 1, "junk": 1}


class Examples:
    """Prompts of the task (``min_len``..``max_len`` digits) with right answers and wrong ones of each kind."""

    def __init__(self, seed: int, min_len: int = 3, max_len: int = 3) -> None:
        self.rng = random.Random(seed)
        self.min_len, self.max_len = min_len, max_len

    def digits(self, n: int) -> str:
        return "".join(self.rng.choice(DIGITS) for _ in range(n))

    def prompt(self) -> str:
        return self.digits(self.rng.randint(self.min_len, self.max_len))

    def wrong(self, s: str, kind: str) -> str:
        """A wrong answer to the prompt ``s`` of ``kind`` (see KINDS); may be the right one by chance."""
        right, rng = answer(s), self.rng
        a = list(right)
        if kind == "order":
            if rng.random() < 0.5:
                i = rng.randrange(len(a) - 1)
                a[i], a[i + 1] = a[i + 1], a[i]
            else:
                rng.shuffle(a)
            return "".join(a)
        if kind == "changed":  # one digit another, in sorted order: only the prompt's digits tell it is wrong
            a[rng.randrange(len(a))] = rng.choice(DIGITS)
            return "".join(sorted(a))
        if kind == "dropped":
            del a[rng.randrange(len(a))]
            return "".join(a)
        if kind == "added":
            a.insert(rng.randrange(len(a) + 1), rng.choice(DIGITS))
            return "".join(sorted(a) if rng.random() < 0.5 else a)
        if kind == "echo":
            return s
        return "".join(rng.choice(JUNK) for _ in range(rng.randint(0, 6)))

    def labelled(self, n: int, kind: str | None = None) -> tuple[list[str], list[float]]:
        """``n`` texts (prompt + answer) in pairs of one prompt, its right answer and a wrong one (of ``kind``, else
        drawn by KINDS), with their targets (:func:`grade`). Both answers of a pair in one batch: their difference
        is all that tells them apart, which is what the RM has to learn."""
        texts, targets = [], []
        kinds, weights = list(KINDS), list(KINDS.values())
        while len(texts) < n:
            s = self.prompt()
            reply = self.wrong(s, kind or self.rng.choices(kinds, weights)[0])
            if reply != answer(s):
                texts += [f"sort:{s}={answer(s)}", f"sort:{s}={reply}"]
                targets += [1.0, grade(s, reply)]
        return texts, targets


def grade(s: str, reply: str) -> float:
    """The RM's target for ``reply`` to the prompt ``s``, in [0, 1]: 1 for the right answer only, else lower the more
    of the prompt's digits are missing or extra and lower still out of order. Graded rather than 0/1 so that every
    wrong answer teaches the RM to count digits (the part of the check that is hard to learn), and the policy gets a
    score that climbs as its answers get closer."""
    if reply == answer(s):
        return 1.0
    common = sum(min(s.count(d), reply.count(d)) for d in set(s))
    overlap = common / max(len(s), len(reply))
    return 0.8 * overlap**2 * (1.0 if reply == answer(reply) else 0.5)


def train(out: Path, *, steps: int = 1000, lr: float = 1e-3, batch: int = 64, seed: int = 0, min_len: int = 3,
          max_len: int = 3, log: Any = print) -> dict[str, float]:
    """Train the RM and save it in ``out``; returns its held-out accuracies (:func:`held_out_accuracy`) and the
    seconds taken."""
    with one_torch_thread():
        return _train(out, steps=steps, lr=lr, batch=batch, seed=seed, min_len=min_len, max_len=max_len, log=log)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread meanwhile: for a 2-layer, 64-wide model a second thread costs more in handoffs than it
    gives (the judge example trains the same way)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _train(out: Path, *, steps: int, lr: float, batch: int, seed: int, min_len: int, max_len: int,
           log: Any) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForSequenceClassification

    out.mkdir(parents=True, exist_ok=True)
    tok = save_tokenizer(out)
    data = Examples(seed, min_len, max_len)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    rm = AutoModelForSequenceClassification.from_config(rm_config(len(tok)))
    opt = torch.optim.AdamW(rm.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - k / steps)  # linear decay: a steadier end
    for step in range(steps):
        texts, ys = data.labelled(batch)
        enc = tok(texts, padding=True, return_tensors="pt")
        logits = rm(**enc).logits[:, 0]
        loss = F.binary_cross_entropy_with_logits(logits, torch.tensor(ys))  # soft targets: the graded score
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0:
            log(f"rm step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.1f} s)")
    rm.eval()
    figures = held_out_accuracy(rm, tok, Examples(seed + 1, min_len, max_len))
    rm.save_pretrained(out)
    seconds = time.perf_counter() - t0
    log(f"reward model in {out} ({seconds:.1f} s), held-out accuracy: "
        + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    return {**figures, "seconds": seconds}


def held_out_accuracy(rm: Any, tok: Any, data: Examples, n: int = 256) -> dict[str, float]:
    """The RM's preference accuracy on fresh pairs (the right answer scored above a wrong one of the same prompt):
    ``accuracy`` over pairs drawn like the training batches, and one figure per kind of wrong answer."""
    import torch

    def accuracy(kind: str | None) -> float:
        texts, _ = data.labelled(2 * n, kind)
        with torch.no_grad():
            logits = rm(**tok(texts, padding=True, return_tensors="pt")).logits[:, 0]
        return float((logits[0::2] > logits[1::2]).float().mean())

    return {"accuracy": accuracy(None), **{kind: accuracy(kind) for kind in KINDS}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the RM into")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train(args.out, steps=args.steps, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train the tiny reward model of examples/cpu-demo-rm.toml: a Qwen2 sequence classifier that prefers the sorted
order in the digit-sorting task (``sort:312=`` -> ``123``), saved as an HF folder (model + tokenizer) that the
``reward_model`` reward loads with AutoModelForSequenceClassification. No downloads; the labels come from the task
itself: half of each batch is the right answer (label 1), half a wrong order of the same digits (label 0). The
example gates this RM with the toy_permutation rule, so wrong digits never reach it: an RM trained on every kind of
wrong answer (changed, dropped, added digits too) reached 0.95 held-out accuracy here, and the policy still learned
to feed it the 5% it got wrong (sorted answers with a digit changed).

Why sorting and not the reversal of examples/cpu-demo.toml: a right sorted order is local (each digit no larger than
the next), which a 2-layer classifier learns in a few hundred steps; telling a right reversal from another order
needs each answer digit matched with its mirror position in the prompt, which the same classifier had not learned
after 400 steps (~0.7 accuracy against every kind of wrong answer, 0.51 against wrong orders only).

    .venv/bin/python examples/sort_rm.py runs/sort-rm        # then: milehpc run examples/cpu-demo-rm.toml --site local
"""

from __future__ import annotations

import argparse
import random
import sys
import time
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
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=2 * hidden, max_position_embeddings=32,
                       pad_token_id=0, eos_token_id=2, bos_token_id=None, num_labels=1)


def answer(s: str) -> str:
    return "".join(sorted(s))


class Examples:
    """Prompts of the task (``min_len``..``max_len`` digits) with correct and corrupted answers."""

    def __init__(self, seed: int, min_len: int = 4, max_len: int = 5) -> None:
        self.rng = random.Random(seed)
        self.min_len, self.max_len = min_len, max_len

    def digits(self, n: int) -> str:
        return "".join(self.rng.choice(DIGITS) for _ in range(n))

    def prompt(self) -> str:
        return self.digits(self.rng.randint(self.min_len, self.max_len))

    def corrupt(self, s: str) -> str | None:
        """A wrong order of the digits ``s``, or None when there is none (all digits alike). Only orders: the example
        gates the RM with the toy_permutation rule, so the RM never scores an answer with other digits; half the
        wrong orders are one swap of neighbours away from sorted, the near misses of a learning policy."""
        right = answer(s)
        if len(set(s)) < 2:
            return None
        while True:
            a = list(right)
            if self.rng.random() < 0.5:
                i = self.rng.randrange(len(a) - 1)
                a[i], a[i + 1] = a[i + 1], a[i]
            else:
                self.rng.shuffle(a)
            if a != list(right):
                return "".join(a)

    def labelled(self, n: int) -> tuple[list[str], list[float]]:
        """``n`` texts (prompt + answer), half right (label 1), half wrong (0)."""
        texts, labels = [], []
        while len(texts) < n:
            s = self.prompt()
            ok = len(texts) % 2 == 0
            reply = answer(s) if ok else self.corrupt(s)
            if reply is not None:
                texts.append(f"sort:{s}={reply}")
                labels.append(float(ok))
        return texts, labels


def train(out: Path, *, steps: int = 300, lr: float = 3e-3, batch: int = 64, seed: int = 0, min_len: int = 3,
          max_len: int = 3, log: Any = print) -> dict[str, float]:
    """Train the RM and save it in ``out``; returns its accuracy on fresh held-out examples and the seconds taken."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-layer, 64-wide model: a second thread costs more in handoffs than it gives
    try:
        return _train(out, steps=steps, lr=lr, batch=batch, seed=seed, min_len=min_len, max_len=max_len, log=log)
    finally:
        torch.set_num_threads(threads)


def _train(out: Path, *, steps: int, lr: float, batch: int, seed: int, min_len: int, max_len: int,
           log: Any) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from transformers import Qwen2ForSequenceClassification

    out.mkdir(parents=True, exist_ok=True)
    tok = save_tokenizer(out)
    data = Examples(seed, min_len, max_len)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    rm = Qwen2ForSequenceClassification(rm_config(len(tok)))
    opt = torch.optim.AdamW(rm.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - k / steps)  # linear decay: a steadier end
    for step in range(steps):
        texts, ys = data.labelled(batch)
        enc = tok(texts, padding=True, return_tensors="pt")
        logits = rm(**enc).logits[:, 0]
        loss = F.binary_cross_entropy_with_logits(logits, torch.tensor(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0:
            log(f"rm step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.1f} s)")
    rm.eval()
    held_out = Examples(seed + 1, min_len, max_len)
    texts, ys = held_out.labelled(1024)
    with torch.no_grad():
        logits = rm(**tok(texts, padding=True, return_tensors="pt")).logits[:, 0]
    accuracy = float(((logits > 0).float() == torch.tensor(ys)).float().mean())
    rm.save_pretrained(out)
    seconds = time.perf_counter() - t0
    log(f"reward model in {out}: held-out accuracy {accuracy:.3f} ({seconds:.1f} s)")
    return {"accuracy": accuracy, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the RM into")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train(args.out, steps=args.steps, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())

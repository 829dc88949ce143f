"""Write the small sample prompt files shipped in examples/data (no downloads): GSM8K-style word problems with
numeric answers and a few Python code problems, in verl's prepared-dataset layout (``data_source``, ``prompt`` as
chat messages, ``ability``, ``reward_model.ground_truth``, ``extra_info``), as JSONL and Parquet.

    python examples/data/make_samples.py [OUT_DIR]

The output is a pure function of this file (a seeded RNG), so the shipped files can be checked against it.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_SOURCE, CODE_SOURCE = "gsm8k_style", "code_style"
NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas")

# Each template: (rng) -> (question, worked answer ending in "#### N").
Template = Callable[[random.Random], tuple[str, str]]


def _boxes(rng: random.Random) -> tuple[str, str]:
    who, boxes, each, eaten = rng.choice(NAMES), rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 5)
    total = boxes * each - eaten
    return (f"{who} has {boxes} boxes with {each} apples in each box. {who} eats {eaten} apples. "
            f"How many apples are left?",
            f"{who} starts with {boxes} * {each} = {boxes * each} apples. After eating {eaten}, "
            f"{boxes * each} - {eaten} = {total} are left.\n#### {total}")


def _wages(rng: random.Random) -> tuple[str, str]:
    who, rate, hours, days = rng.choice(NAMES), rng.randint(8, 25), rng.randint(2, 8), rng.randint(2, 6)
    total = rate * hours * days
    return (f"{who} earns ${rate} an hour and works {hours} hours a day for {days} days. "
            f"How many dollars does {who} earn?",
            f"Per day: {rate} * {hours} = {rate * hours}. Over {days} days: {rate * hours} * {days} = {total}.\n"
            f"#### {total}")


def _share(rng: random.Random) -> tuple[str, str]:
    who, friends, each, extra = rng.choice(NAMES), rng.randint(2, 6), rng.randint(3, 9), rng.randint(1, 7)
    total = friends * each + extra
    return (f"{who} shares some stickers: each of {friends} friends gets {each} stickers and {extra} are left over. "
            f"How many stickers did {who} have?",
            f"Given away: {friends} * {each} = {friends * each}. With {extra} left: {friends * each} + {extra} = "
            f"{total}.\n#### {total}")


def _speed(rng: random.Random) -> tuple[str, str]:
    who, speed, hours = rng.choice(NAMES), rng.randint(3, 15) * 4, rng.randint(2, 5)
    half = speed * hours // 2
    return (f"{who} drives at {speed} km per hour for {hours} hours, then walks half as far as that. "
            f"How many km does {who} walk?",
            f"The drive is {speed} * {hours} = {speed * hours} km; half of it is {half}.\n#### {half}")


TEMPLATES: tuple[Template, ...] = (_boxes, _wages, _share, _speed)

# (task, function name, assert lines) -- the reference solutions are not shipped: the model writes them.
CODE = (
    ("Write a Python function add(a, b) that returns the sum of a and b.", "add",
     ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert add(10, 5) == 15"]),
    ("Write a Python function is_even(n) that returns True when n is even.", "is_even",
     ["assert is_even(4)", "assert not is_even(7)", "assert is_even(0)"]),
    ("Write a Python function largest(xs) that returns the largest number of a non-empty list.", "largest",
     ["assert largest([3, 9, 2]) == 9", "assert largest([-5, -1]) == -1", "assert largest([7]) == 7"]),
    ("Write a Python function reverse_words(s) that reverses the order of the words of s.", "reverse_words",
     ["assert reverse_words('a b c') == 'c b a'", "assert reverse_words('hi') == 'hi'"]),
    ("Write a Python function count_vowels(s) that counts the vowels (aeiou) in s.", "count_vowels",
     ["assert count_vowels('hello') == 2", "assert count_vowels('xyz') == 0", "assert count_vowels('aei') == 3"]),
    ("Write a Python function factorial(n) that returns n! for n >= 0.", "factorial",
     ["assert factorial(0) == 1", "assert factorial(5) == 120", "assert factorial(3) == 6"]),
)


def math_rows(split: str, count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(f"{MATH_SOURCE}:{split}:{seed}")
    rows = []
    for i in range(count):
        question, answer = TEMPLATES[i % len(TEMPLATES)](rng)
        rows.append({"data_source": MATH_SOURCE,
                     "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": answer.rsplit("#### ", 1)[1]},
                     "extra_info": {"split": split, "index": i, "answer": answer, "question": question}})
    return rows


def code_rows() -> list[dict[str, Any]]:
    return [{"data_source": CODE_SOURCE,
             "prompt": [{"role": "user", "content": f"{task} Answer with one ```python code block."}],
             "ability": "code",
             "reward_model": {"style": "rule", "ground_truth": json.dumps(tests)},
             "extra_info": {"split": "train", "index": i, "entry_point": name}}
            for i, (task, name, tests) in enumerate(CODE)]


def write_samples(out: Path) -> list[Path]:
    """Every sample file into ``out``; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    sets = {"gsm8k_style_train": math_rows("train", 32, 0), "gsm8k_style_val": math_rows("test", 8, 0),
            "code_style": code_rows()}
    written = []
    for name, rows in sets.items():
        jsonl = out / f"{name}.jsonl"
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        parquet = out / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), parquet)
        written += [jsonl, parquet]
    return written


if __name__ == "__main__":
    for path in write_samples(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)

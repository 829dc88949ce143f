"""A calculator-tool agent written against the plain OpenAI chat API: milehpc trains it unmodified
(``[rollout] generator = "agent"``, ``generator_params.agent = "agent_calculator:run"``; see agent-calculator.toml).

The policy is asked an addition. It may call the ``calc`` tool (the environment: it evaluates the question it was
given and answers with the sum); then it answers. Reward: half for a well-formed ``calc`` call, half for the right
final answer (partial credit per right digit). What the CPU demo learns is the call alone: its warm-up imitates the
call, and after the tool's result the policy calls again rather than answer (measured: no right answer in 30 steps
of 64 episodes; the reward's rise, 0.23 -> 0.47, is the call's half).
"""

from __future__ import annotations

import re
from typing import Any

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "the value of the question's arithmetic expression",
    "parameters": {"type": "object", "properties": {}}}}]


def evaluate(question: str) -> str:
    """The sum the question asks for (the tool's side: it reads the expression itself)."""
    a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
    return str(a + b)


def digits_right(answer: str, expected: str) -> float:
    """Fraction of the expected digits the answer has in place."""
    got = answer.strip()
    return sum(x == y for x, y in zip(got, expected, strict=False)) / max(len(expected), len(got), 1)


# ---- the CPU demo's tokenizer and prompts (a real model's tokenizer and data replace these on a GPU) ----
CALL = '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer(folder: str) -> str:
    """A word-level tokenizer with a ChatML template in which the calc call is three tokens (``<tool_call>``, its
    JSON, ``</tool_call>``) and every other character one, saved where ``AutoTokenizer`` loads it (no download)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = ["user", "assistant", "tool", "system", "<tool_call>", '{"name": "calc", "arguments": {}}',
             "</tool_call>"]
    chars = list("0123456789+=? \n")
    vocab = {t: i for i, t in enumerate([*specials, "[UNK]", *words, *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.add_tokens(words)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>", unk_token="[UNK]")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    return folder


def write_prompts(path: str, count: int = 200, seed: int = 0) -> str:
    """``count`` additions ``a+b=`` (one digit each) as chat prompts; the label is the demonstration of a tool
    call (what ``trainer.sft_warmup_steps`` imitates before RL takes over)."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            q = f"{rng.randrange(10)}+{rng.randrange(10)}="
            f.write(json.dumps({"prompt": [{"role": "user", "content": q}], "label": CALL}) + "\n")
    return path


async def run(client: Any, sample: dict[str, Any], *, max_turns: int = 2) -> dict[str, Any]:
    messages: list[Any] = list(sample["messages"])
    question = messages[-1]["content"]
    called = False
    answer = ""
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message)
        calls = [c for c in message.tool_calls or [] if c.function.name == "calc"]
        if not calls:
            answer = message.content or ""
            break
        called = True
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": evaluate(question)})
    expected = evaluate(question)
    score = 0.5 * called + 0.5 * (digits_right(answer, expected) if called else 0.0)
    return {"reward": score, "tool_call": float(called), "correct": float(answer.strip() == expected)}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="write the CPU demo's tokenizer folder and prompts")
    parser.add_argument("--tokenizer", default="runs/agent-calculator-tokenizer")
    parser.add_argument("--prompts", default="runs/agent-calculator.jsonl")
    args = parser.parse_args()
    print(build_tokenizer(args.tokenizer), write_prompts(args.prompts))

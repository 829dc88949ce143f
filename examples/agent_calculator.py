"""A calculator-tool agent written against the plain OpenAI chat API: milehpc trains it unmodified
(``[rollout] generator = "agent"``, ``generator_params.agent = "agent_calculator:run"``; see agent-calculator.toml).

The policy is asked an addition with a one-digit sum. It may call the ``calc`` tool (the environment: it evaluates
the question it was given and replies with the sum); then it answers. The reward is 1 for the right answer after a
call, 0 otherwise: an answer given without the call earns nothing, the task is the tool's use.

The warm-up (``trainer.sft_warmup_steps``) imitates demonstrations of two ways to answer: for 55 of the 200 prompts
(each with probability ``call_share`` = 0.3) the whole exchange (the call, the tool's reply, the answer; the tool's
text masked from the loss), for the rest the answer at once. After it the policy calls in about a quarter of the
episodes and, when it calls, reads the answer from the tool's reply (with a tool replying the sum plus 3, mod 10, the
answer after a call was the tool's in 0.17 of the episodes and the true sum in 0.02, of 0.25 that called); RL then
raises the calls and with them the right answers. tests/test_agent_learns.py (14 steps of 64 episodes, means of the
first and last 5 steps), four runs: tool calls 0.48-0.51 -> 0.89-0.91, right answers 0.38-0.42 -> 0.74-0.82.
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


def write_prompts(path: str, count: int = 200, seed: int = 0, call_share: float = 0.3) -> str:
    """``count`` additions ``a+b=`` with a one-digit sum (each sum equally likely), as chat prompts; the label is
    a demonstration of the whole exchange (the call, the tool's reply, the answer; tool text masked from the loss)
    for a ``call_share`` of them, of an answer given at once (no call) for the rest: what
    ``trainer.sft_warmup_steps`` imitates before RL takes over."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            total = rng.randrange(10)
            a = rng.randrange(total + 1)
            q = f"{a}+{total - a}="
            answer = {"role": "assistant", "content": evaluate(q)}
            label = ([{"role": "assistant", "content": CALL}, {"role": "tool", "content": evaluate(q)}, answer]
                     if rng.random() < call_share else [answer])
            f.write(json.dumps({"prompt": [{"role": "user", "content": q}], "label": label}) + "\n")
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
    correct = called and answer.strip() == evaluate(question)
    return {"reward": float(correct), "tool_call": float(called), "correct": float(correct)}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="write the CPU demo's tokenizer folder and prompts")
    parser.add_argument("--tokenizer", default="runs/agent-calculator-tokenizer")
    parser.add_argument("--prompts", default="runs/agent-calculator.jsonl")
    args = parser.parse_args()
    print(build_tokenizer(args.tokenizer), write_prompts(args.prompts))

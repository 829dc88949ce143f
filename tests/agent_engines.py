"""An agent episode served by a real engine (SGLang, vLLM) through milehpc's OpenAI endpoint: the helpers the
engines' contract tests share (tests/test_sglang_contract.py, tests/test_vllm_contract.py fold it into the engine
they start once per module).

The engines' tiny models are random, so they would never write a tool call; :func:`tool_calling_weights` edits an HF
Qwen2 model's weights so that it does, by a bigram rule through the embeddings and the LM head (after the ``\\n``
that opens an assistant turn: ``<tool_call>``, the call's JSON, ``</tool_call>``, EOS), with the layers' outputs
scaled down but kept, so the logits still depend on the whole context and the logprob comparison compares numbers
that are not all 0. The engine is given those weights by its own weight update, and the recorded tokens are checked
against a transformers forward of the same model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CALL_JSON = '{"name": "calc", "arguments": {}}'  # one token of the example's tokenizer
CHAIN_LOGIT = 8.0  # p(next chain token) ~ e^8 / (e^8 + vocab): ~0.98 a token, most turns are whole tool calls


def calculator_tokenizer(folder: Path) -> Any:
    """examples/agent_calculator.py's word-level ChatML tokenizer (26 ids, EOS <|im_end|> = 2)."""
    import sys

    from milehpc.data.tokenizer import HFTokenizer

    sys.path.insert(0, str(EXAMPLES))
    try:
        import agent_calculator
    finally:
        sys.path.remove(str(EXAMPLES))
    return HFTokenizer(agent_calculator.build_tokenizer(str(folder)))


def tool_calling_weights(model: Any, tokenizer: Any) -> Any:
    """Edit ``model`` (HF Qwen2, untied, float32) in place as the module docstring says; returns it."""
    vocab = tokenizer.tok.get_vocab()
    chain = [*(vocab[t] for t in ("\n", "<tool_call>", CALL_JSON, "</tool_call>")), tokenizer.eos_id]
    hidden = model.config.hidden_size
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.05)  # the layers still add context, a little
        basis = torch.eye(hidden)
        for k, token in enumerate(chain[:-1]):
            emb[token] = hidden ** 0.5 * basis[k]  # RMS 1: the final norm leaves it (nearly) as it is
            head[chain[k + 1]] += CHAIN_LOGIT / hidden ** 0.5 * basis[k]
        model.model.norm.weight.fill_(1.0)
    return model


TOOLS = [{"type": "function", "function": {"name": "calc", "description": "the sum the question asks for",
                                           "parameters": {"type": "object", "properties": {}}}}]


async def tool_agent(client: Any, sample: dict[str, Any]) -> dict[str, Any]:
    """Plain OpenAI-client agent: ask with the ``calc`` tool; run each call it gets and hand back the result; ask
    once more."""
    messages: list[Any] = list(sample["messages"])
    calls, answered = 0, 0
    for turn in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, logprobs=True)
        message = reply.choices[0].message
        messages.append(message)
        for call in message.tool_calls or []:
            calls += 1
            answered += turn == 0  # sent with the next request
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "7"})
    return {"reward": float(calls), "calls": calls, "answered": answered}


def run_episodes(engine: Any, tokenizer: Any, *, episodes: int, stop_token_ids: list[int]) -> list[Any]:
    """``episodes`` runs of :func:`tool_agent` as the ``agent`` generator runs them on a rollout rank."""
    from milehpc.data.source import Prompt
    from milehpc.rollout.agent import agent_generator, close_endpoints
    from milehpc.rollout.engine import SamplingParams

    prompts = [Prompt(ids=[1], text="3+4=", label="7", index=0, raw=[{"role": "user", "content": "3+4="}])]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, n=episodes, stop_token_ids=stop_token_ids)
    try:
        return agent_generator(engine, prompts, sampling, agent=tool_agent, tokenizer=tokenizer,
                               episode_timeout_s=120.0)
    finally:
        close_endpoints()


def logprob_diffs(model: Any, samples: list[Any]) -> tuple[float, float]:
    """(the worst |recorded - transformers| logprob of a reply token, its tolerance). The two sides run the same
    float32 model with different kernels: each logit may differ by rounding along its longest reduction
    (intermediate_size terms) times its magnitude, doubled for the log-sum-exp."""
    worst, tol = 0.0, 0.0
    reduction = max(model.config.intermediate_size, model.config.hidden_size)
    for s in samples:
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float()
        p = len(s.prompt_ids)
        ref = logits.log_softmax(-1)[p - 1:-1].gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        worst = max(worst, (ref[mask] - torch.tensor(s.rollout_logprobs)[mask]).abs().max().item())
        tol = max(tol, 2 * torch.finfo(torch.float32).eps * reduction * logits.abs().max().item())
    return worst, tol


def assert_agent_episodes(samples: list[Any], tokenizer: Any, model: Any, version: int) -> None:
    """Each episode a whole recorded conversation: the replies' tokens (trained on) and the tool turns (masked), the
    tool calls parsed in the OpenAI format and run, the engine's weight version, logprobs the model's."""
    from milehpc.samples import Status

    assert samples and all(s.status is not Status.FAILED for s in samples), [s.metadata for s in samples]
    counts = [s.metadata["agent_counts"] for s in samples]
    assert all(c["divergences"] == 0 and c["calls"] == 2 for c in counts), counts
    # p(a whole call) ~ 0.98^4 a turn: of 2 x len(samples) turns, at least one in two is a call.
    assert sum(c["tool_calls"] for c in counts) >= len(samples), counts
    (answer,) = tokenizer.encode("7")
    call_ids = tokenizer.encode('<tool_call>{"name": "calc", "arguments": {}}</tool_call>')
    for s in samples:
        assert s.weight_version == version and s.metadata["versions"] == [version, version]
        trained = [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if m]
        env = [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if not m]
        if s.metadata["tool_calls"]:  # the call is trained on
            assert any(trained[i:i + 3] == call_ids for i in range(len(trained))), trained
        assert env.count(answer) == s.metadata["agent"]["answered"], (env, s.metadata)  # the tool's answer is not
        assert tokenizer.tok.decode(s.prompt_ids + s.response_ids).count("<|im_start|>assistant") == 2
    worst, tol = logprob_diffs(model, samples)
    assert worst < tol, (worst, tol)


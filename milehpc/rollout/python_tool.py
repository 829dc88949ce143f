"""A multi-turn tool environment for the custom-generation hook (``[rollout] generator = "python_tool"``): when a
turn of the policy contains ``<python>CODE</python>`` (the tags are parameters), CODE runs in the job's sandbox and
``<output>STDOUT</output>`` (or the error's last line) is appended as the observation, then the policy continues.

Observation tokens are environment tokens (loss mask 0, logprob 0). A turn without a tool call ends the sample;
so does ``max_turns``. The job's reward scores the whole response afterwards (the generator sets no reward). A
sandbox that cannot run marks only its sample FAILED (``metadata["tool_error"]``).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from milehpc.rollout.engine import SamplingParams
from milehpc.samples import Sample, Status
from milehpc.sandbox.choice import pool_for
from milehpc.sandbox.types import Limits, RunResult, SandboxError


def tool_call(text: str, open_tag: str, close_tag: str) -> str | None:
    """The code of the last tool call in a turn (an unclosed call runs to the end of the turn), or None."""
    start = text.rfind(open_tag)
    if start < 0:
        return None
    code = text[start + len(open_tag):]
    end = code.find(close_tag)
    return code[:end] if end >= 0 else code


def observation(result: RunResult, max_chars: int) -> str:
    """What the policy sees: stdout, or the last line of stderr when the program failed, or why it was stopped."""
    if result.ok:
        body = result.stdout
    elif result.stopped != "exited":
        body = f"stopped: {result.stopped}"
    else:
        body = (result.stderr.strip().splitlines() or [f"exit {result.exit_code}"])[-1]
    return body.strip()[-max_chars:]


def _encode(tok: Any, text: str) -> list[int]:
    """Token ids of ``text``; characters a small vocabulary cannot spell are dropped (the toy tokenizer)."""
    try:
        return list(tok.encode(text))
    except ValueError:
        ids: list[int] = []
        for ch in text:
            with contextlib.suppress(ValueError):
                ids += tok.encode(ch)
        return ids


def python_tool_generator(engine: Any, prompts: list[Any], sampling: SamplingParams, *, max_turns: int = 3,
                          open_tag: str = "<python>", close_tag: str = "</python>", output_open: str = "<output>",
                          output_close: str = "</output>", max_output_chars: int = 256, wall_s: float = 5.0,
                          memory_mb: int = 512) -> list[Sample]:
    """``sampling.n`` samples per prompt, prompt-major, each ending with the policy's final turn."""
    tok = engine.tokenizer
    pool = pool_for()
    limits = Limits(wall_s=wall_s, cpu_s=max(1, int(wall_s)), memory_mb=memory_mb, max_output_bytes=64 * 1024)
    python = getattr(pool.sandbox, "python", "python3")
    samples = engine.generate([p.ids for p in prompts], sampling)
    turn_start = {id(s): 0 for s in samples}
    calls = {id(s): 0 for s in samples}
    active = samples
    for _ in range(max_turns - 1):
        pending = [(s, tool_call(tok.decode(s.response_ids[turn_start[id(s)]:]), open_tag, close_tag))
                   for s in active if s.status is not Status.FAILED]
        pending = [(s, code) for s, code in pending if code is not None]
        if not pending:
            break

        def run(code: str) -> RunResult | SandboxError:
            try:
                return pool.run([python, "tool.py"], files={"tool.py": code}, limits=limits)
            except SandboxError as err:  # this sample's sandbox failed: the others go on
                return err

        with ThreadPoolExecutor(pool.workers) as threads:
            results = list(threads.map(run, [code for _, code in pending]))
        active = []
        for (s, _), result in zip(pending, results, strict=True):
            calls[id(s)] += 1
            if isinstance(result, SandboxError):
                s.status = Status.FAILED
                s.metadata["tool_error"] = str(result)[:500]
                continue
            ids = _encode(tok, f"{output_open}{observation(result, max_output_chars)}{output_close}")
            s.response_ids += ids
            s.loss_mask += [0] * len(ids)
            s.rollout_logprobs += [0.0] * len(ids)
            turn_start[id(s)] = len(s.response_ids)
            active.append(s)
        if active:
            engine.generate([], replace(sampling, n=1), samples=active)
    for s in samples:
        s.response_text = tok.decode(s.response_ids)
        s.metadata["tool_calls"] = calls[id(s)]
    return samples

"""``code_tests``: run a completion's Python code against its problem's tests in the job's sandbox; the reward is
the fraction of tests passed (``score``), with ``all_passed`` as a metric.

Tests come from ``sample.metadata[tests_key]`` (a JSONL source puts every extra column there) or, with
``tests_key = "label"``, from the label; the formats are in :mod:`milehpc.rewards.code_cases`. stdin/stdout cases
run one program each (compared on the host); call and assert cases run together under the harness. A program
that fails, crashes or hits a limit scores 0 on those tests; only a sandbox that cannot run at all fails the
sample (the reward runner then marks it FAILED and the run goes on).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from collections import OrderedDict
from typing import Any

from milehpc.errors import ConfigError
from milehpc.rewards.code_cases import STDIO, Case, extract_code, parse_tests, stdout_matches
from milehpc.rewards.code_harness import HARNESS
from milehpc.sandbox.choice import Pool, pool_for
from milehpc.sandbox.types import WALL, Limits

_CACHE: OrderedDict[str, dict[str, float]] = OrderedDict()  # (code, tests, limits) -> result: programs are pure
_CACHE_SIZE = 4096


def _tests_of(sample: Any, tests_key: str) -> Any:
    if tests_key == "label":
        return sample.label
    if tests_key not in sample.metadata:
        raise ValueError(f"sample has no tests: expected metadata['{tests_key}'] (reward.params.tests_key)")
    return sample.metadata[tests_key]


async def run_cases(pool: Pool, code: str, cases: list[Case], limits: Limits, case_timeout_s: float,
                    loaded: list[bool] | None = None) -> list[bool]:
    """Which cases ``code`` passes, run in ``pool`` (stdio cases concurrently, the others under the harness).
    ``loaded`` gets True appended when a run hit the wall-clock limit (a verdict that depends on the node's load)."""
    python = getattr(pool.sandbox, "python", "python3")
    stdio = [c for c in cases if c.kind == STDIO]
    other = [c for c in cases if c.kind != STDIO]
    jobs = [pool.arun([python, "solution.py"], stdin=c.stdin.encode(), files={"solution.py": code}, limits=limits)
            for c in stdio]
    nonce = secrets.token_hex(8)
    if other:
        spec = {"nonce": nonce, "timeout_s": case_timeout_s,
                "cases": [{"kind": c.kind, "code": c.code, "expected": c.expected, "fn_name": c.fn_name} for c in other]}
        jobs.append(pool.arun([python, "harness.py"], files={"solution.py": code, "harness.py": HARNESS,
                                                            "cases.json": json.dumps(spec)}, limits=limits))
    results = await asyncio.gather(*jobs)
    if loaded is not None and any(r.stopped == WALL for r in results):
        loaded.append(True)
    passed = [r.ok and stdout_matches(r.stdout, str(c.expected)) for r, c in zip(results, stdio, strict=False)]
    if other:
        last = (results[-1].stdout.strip().splitlines() or [""])[-1]
        verdicts: list[Any] = []
        if results[-1].ok and last.startswith(nonce + " "):
            # The solution shares the harness's interpreter: a line it forged after the harness's may not parse.
            # That scores 0 on these cases; it must not raise (a raise would mark the sample FAILED, not wrong).
            try:
                verdicts = json.loads(last[len(nonce) + 1:])
            except ValueError:
                verdicts = []
            if not isinstance(verdicts, list):
                verdicts = []
        passed += [bool(verdicts[i]) if i < len(verdicts) else False for i in range(len(other))]
    return passed


async def code_tests(sample: Any, *, tests_key: str = "tests", extract: bool = True, case_timeout_s: float = 4.0,
                     wall_s: float = 20.0, memory_mb: int = 1024, max_procs: int = 32, max_output_kb: int = 64,
                     cache: bool = True) -> dict[str, float]:
    """The ``code_tests`` reward (an async ``sample`` reward)."""
    cases = parse_tests(_tests_of(sample, tests_key))
    code = extract_code(sample.response_text) if extract else sample.response_text
    limits = Limits(wall_s=wall_s, cpu_s=max(1, int(wall_s)), memory_mb=memory_mb, max_procs=max_procs,
                    max_output_bytes=max_output_kb * 1024)
    key = hashlib.sha256(json.dumps([code, repr(cases), repr(limits), case_timeout_s]).encode()).hexdigest()
    if cache and key in _CACHE:
        _CACHE.move_to_end(key)
        return dict(_CACHE[key])
    loaded: list[bool] = []
    passed = await run_cases(pool_for(), code, cases, limits, case_timeout_s, loaded)
    frac = sum(passed) / len(passed) if passed else 0.0
    out = {"score": frac, "all_passed": float(all(passed) and bool(passed))}
    if cache and not loaded:  # a wall-clock kill may not repeat on a quieter node: not a pure result
        _CACHE[key] = out
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return dict(out)


def _validate(params: dict[str, Any], file: str | None = None) -> None:
    for name in ("case_timeout_s", "wall_s"):
        if not params[name] > 0:
            raise ConfigError(f"expected a positive number of seconds, got {params[name]!r}", file=file,
                              field=f"reward.params.{name}")
    if not params["tests_key"]:
        raise ConfigError("expected a metadata key or 'label', got ''", file=file, field="reward.params.tests_key")


code_tests.validate_params = _validate  # type: ignore[attr-defined]

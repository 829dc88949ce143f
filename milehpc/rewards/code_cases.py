"""The test formats of the common code-RL datasets, read into one list of cases (pure; nothing runs here).

- stdin/stdout: ``{"inputs": [...], "outputs": [...]}`` (APPS, TACO, DeepCoder), ``{"input": [...], "output":
  [...]}`` (CodeContests), or a list of ``{"input", "output"}`` tables: the program reads stdin, its stdout is
  compared with the expected text (trailing whitespace ignored);
- call: the same with ``"fn_name"``: each input is the argument list of ``fn_name`` (a function, or a method of
  ``class Solution``), compared with the expected value (APPS wraps it in a one-item list: both count);
- assert scripts: a list of assert lines or ``{"test_list": [...], "test_setup_code": ...}`` (MBPP), one case each;
- a test script: ``{"test": ..., "entry_point": ...}`` (HumanEval: ``check(entry_point)`` is called) or a string.
A string that starts with ``{`` or ``[`` is read as JSON first.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

STDIO, CALL, SCRIPT = "stdio", "call", "script"
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class Case:
    kind: str  # stdio | call | script
    stdin: str = ""
    expected: Any = None  # stdio: text; call: value
    code: str = ""  # script: the test code run after the solution
    fn_name: str = ""


def extract_code(text: str) -> str:
    """The last fenced code block of a completion, or the whole completion when it has none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _pairs(inputs: Any, outputs: Any, fn_name: str) -> list[Case]:
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise ValueError("expected lists 'inputs' and 'outputs' of the same length")
    if fn_name:
        return [Case(CALL, expected=o, code=json.dumps(i if isinstance(i, list) else [i]), fn_name=fn_name)
                for i, o in zip(inputs, outputs, strict=True)]
    return [Case(STDIO, stdin=_text(i), expected=_text(o)) for i, o in zip(inputs, outputs, strict=True)]


def parse_tests(tests: Any) -> list[Case]:
    """The cases of one problem; a ValueError names what was expected."""
    if isinstance(tests, str):
        if tests.lstrip()[:1] in ("{", "["):
            try:
                return parse_tests(json.loads(tests))
            except json.JSONDecodeError:
                pass
        return [Case(SCRIPT, code=tests)]
    if isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests):
        return [Case(SCRIPT, code=t) for t in tests]
    if isinstance(tests, list) and tests and all(isinstance(t, dict) for t in tests):
        return _pairs([t.get("input", "") for t in tests], [t.get("output", "") for t in tests], "")
    if isinstance(tests, dict):
        if "inputs" in tests or "input" in tests:
            return _pairs(tests.get("inputs", tests.get("input")), tests.get("outputs", tests.get("output")),
                          str(tests.get("fn_name") or ""))
        if "test_list" in tests:
            setup = "\n".join(filter(None, [*(tests.get("test_imports") or []), tests.get("test_setup_code") or ""]))
            return [Case(SCRIPT, code=f"{setup}\n{t}" if setup else t) for t in tests["test_list"]]
        if "test" in tests:
            entry = tests.get("entry_point")
            return [Case(SCRIPT, code=f"{tests['test']}\ncheck({entry})" if entry else str(tests["test"]))]
    raise ValueError("expected tests as inputs/outputs lists, a list of asserts, {test_list}, {test, entry_point} "
                     f"or a test script, got {type(tests).__name__}")


def stdout_matches(got: str, expected: str) -> bool:
    """Line by line, trailing whitespace and trailing blank lines ignored (the usual judge rule)."""
    def norm(s: str) -> list[str]:
        return [line.rstrip() for line in s.rstrip().splitlines()]
    return norm(got) == norm(expected)

"""Answer extraction and normalisation shared by the built-in rewards (and usable by task rewards)."""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_BOXED = ("\\boxed", "\\fbox")


def cut_at(text: str, stop: str) -> str:
    """``text`` up to the first ``stop`` (the whole text if ``stop`` is empty or absent)."""
    return text.split(stop, 1)[0] if stop else text


def normalize_text(text: str, *, strip: bool = True, case_sensitive: bool = True,
                   collapse_whitespace: bool = False) -> str:
    if collapse_whitespace:
        text = " ".join(text.split())
    if strip:
        text = text.strip()
    if not case_sensitive:
        text = text.casefold()
    return text


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces balanced; None if none."""
    start = max(text.rfind(tag) for tag in _BOXED)
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        # "\boxed 5" (no braces): the next token
        rest = text[start:].split(maxsplit=1)
        return rest[1].split()[0] if len(rest) > 1 else None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i]
    return None  # unbalanced: no answer


def last_number(text: str) -> str | None:
    """The last number in ``text`` (``-1,234.5`` style, thousands commas allowed), None if none."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_answer(text: str, mode: str = "auto") -> str | None:
    """The answer in a response: ``boxed`` (last \\boxed{}), ``last_number``, ``answer_tag``
    (``<answer>...</answer>``), ``gsm8k`` (after ``####``), ``none`` (the whole text) or ``auto``
    (boxed, else ``####``, else the last number)."""
    if mode == "none":
        return text
    if mode == "boxed":
        return last_boxed(text)
    if mode == "last_number":
        return last_number(text)
    if mode == "answer_tag":
        found = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
        return found[-1] if found else None
    if mode == "gsm8k":
        return text.rsplit("####", 1)[1].strip() if "####" in text else None
    if mode == "auto":
        boxed = last_boxed(text)
        if boxed is not None:
            return boxed
        if "####" in text:
            return text.rsplit("####", 1)[1].strip()
        return last_number(text)
    raise ValueError(f"unknown answer extraction {mode!r}")


_LATEX_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "^\\circ", "^{\\circ}", "\\%", "%",
               "\\displaystyle")


def normalize_math(answer: str) -> str:
    """A canonical string for a math answer: LaTeX spacing/sizing, ``\\text{}``, dollars, degrees and percent
    signs, thousands commas, surrounding braces, a leading ``x =`` and a trailing period removed;
    ``\\dfrac``/``\\tfrac`` → ``\\frac``."""
    s = answer.strip()
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{(.*?)\}", r"\1", s)
    for token in _LATEX_DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"^[A-Za-z]\s*=\s*", "", s.strip())
    s = s.strip().rstrip(".").strip()
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and last_boxed("\\boxed" + s) == s[1:-1]:
        s = s[1:-1].strip()
    s = re.sub(r"(?<=\d),(?=\d{3}(?:\D|$))", "", s)  # 1,234 -> 1234
    return s.replace(" ", "")


def parse_number(answer: str) -> Fraction | float | None:
    """A normalised answer as a number if it is one: integers, decimals, ``a/b``, ``\\frac{a}{b}``,
    ``\\frac ab``, scientific notation; None otherwise."""
    s = normalize_math(answer)
    m = re.fullmatch(r"(-?)\\frac\{?(-?[\d.]+)\}?\{?(-?[\d.]+)\}?", s)
    if m:
        s = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    try:
        if "/" in s:
            num, _, den = s.partition("/")
            value = Fraction(num) / Fraction(den)
            return value
        if re.fullmatch(r"-?\d+", s):
            return Fraction(int(s))
        return float(s)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def math_equal(pred: str, ref: str, tolerance: float = 1e-6) -> bool:
    """Numerically equal within ``tolerance`` (relative for numbers above 1 in size), else equal as
    normalised strings."""
    a, b = parse_number(pred), parse_number(ref)
    if a is not None and b is not None:
        return abs(float(a) - float(b)) <= tolerance * max(1.0, abs(float(b)))
    return normalize_math(pred) == normalize_math(ref)

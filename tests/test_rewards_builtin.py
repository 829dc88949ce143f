"""The built-in reward functions and their answer extraction / normalisation."""

from __future__ import annotations

import pytest

from milehpc.rewards import functions as F
from milehpc.rewards.extract import (
    extract_answer,
    last_boxed,
    last_number,
    math_equal,
    normalize_math,
    parse_number,
)
from milehpc.samples import Sample


def s(text, label=None, group=0, n_tokens=1):
    return Sample(prompt_ids=[1], response_ids=[2] * n_tokens, response_text=text, label=label, group=group)


@pytest.mark.parametrize(("text", "label", "opts", "want"), [
    ("12345", "12345", {}, 1.0),
    ("12345 ", "12345", {}, 1.0),
    ("12345 ", "12345", {"strip": False}, 0.0),
    ("Paris", "paris", {}, 0.0),
    ("Paris", "paris", {"case_sensitive": False}, 1.0),
    ("new   york", "new york", {"collapse_whitespace": True}, 1.0),
    ("123<eos>junk", "123", {"stop": "<eos>"}, 1.0),
    ("the answer is \\boxed{42}.", "42", {"extract": "boxed"}, 1.0),
    ("so 3 then 7", "7", {"extract": "last_number"}, 1.0),
    ("<answer> B </answer>", "B", {"extract": "answer_tag"}, 1.0),
    ("no box", "1", {"extract": "boxed"}, 0.0),
    ("b", ["a", "b"], {}, 1.0),  # a list label: any accepted answer
    ("46", 46, {}, 1.0),  # a numeric label
])
def test_exact_match(text, label, opts, want):
    assert F.exact_match(s(text, label), **opts) == want


def test_exact_match_needs_a_label():
    with pytest.raises(ValueError, match="label"):
        F.exact_match(s("x"))


@pytest.mark.parametrize(("text", "label", "want"), [
    ("12345", "12345", 1.0),
    ("12354", "12345", 3 / 5),
    ("1234", "12345", 4 / 5),  # a missing character costs
    ("123456", "12345", 5 / 6),  # so does an extra one
    ("", "12", 0.0),
    ("", "", 1.0),
])
def test_position_match(text, label, want):
    assert F.position_match(s(text, label)) == pytest.approx(want)


def test_extraction_helpers():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unbalanced") is None
    assert last_boxed("\\fbox{7}") == "7"
    assert last_number("costs $1,234.50 or 7,5 apples, -3.") == "-3"
    assert last_number("total 1,234,567 dollars") == "1,234,567"
    assert last_number("none here") is None
    assert extract_answer("work... #### 72", "auto") == "72"
    assert extract_answer("x \\boxed{5} #### 6", "auto") == "5"
    assert extract_answer("just 3 and 4", "auto") == "4"
    with pytest.raises(ValueError):
        extract_answer("x", "telepathy")


@pytest.mark.parametrize(("pred", "ref", "equal"), [
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{3}{4}", "3/4", True),
    ("1,000", "1000", True),
    ("$12$", "12", True),
    ("x = 5", "5", True),
    ("5.", "5", True),
    ("50\\%", "50", True),
    ("90^\\circ", "90", True),
    ("\\text{ 7 }", "7", True),
    ("{3}", "3", True),
    ("0.3333", "1/3", False),
    ("0.33333333", "1/3", True),  # within the default relative tolerance 1e-6
    ("\\sqrt{2}", "\\sqrt{2}", True),
    ("\\sqrt{2}", "\\sqrt{3}", False),
    ("2", "3", False),
    ("1/0", "1/0", True),  # not a number: compared as strings
])
def test_math_equal(pred, ref, equal):
    assert math_equal(pred, ref) is equal


def test_parse_and_normalize():
    assert parse_number("-\\frac{1}{4}") == pytest.approx(-0.25)
    assert parse_number("1e3") == 1000.0
    assert parse_number("abc") is None
    assert normalize_math("\\left( 1, 2 \\right)") == "(1,2)"


def test_math_answer_scores_and_details():
    r = F.math_answer(s("so the answer is \\boxed{\\frac{1}{2}}", "0.5"))
    assert r == {"score": 1.0, "correct": 1.0, "has_answer": 1.0}
    assert F.math_answer(s("I think 12", "#### 12"))["score"] == 1.0  # a GSM8K-style label
    assert F.math_answer(s("\\boxed{3}", "\\boxed{4}"), incorrect=-1.0)["score"] == -1.0
    assert F.math_answer(s("no idea", "4"), no_answer=-0.5) == {"score": -0.5, "correct": 0.0, "has_answer": 0.0}
    assert F.math_answer(s("\\boxed{3.0000001}", "3"), tolerance=1e-3)["correct"] == 1.0


def test_format_reward():
    good = "<think>hmm\nyes</think> <answer>4</answer>"
    assert F.format_reward(s(good)) == 1.0
    assert F.format_reward(s("<answer>4</answer>")) == 0.0
    assert F.format_reward(s("x <answer>4</answer> y"), pattern="<answer>.*</answer>", mode="search") == 1.0
    assert F.format_reward(s("nope"), score=2.0, miss=-1.0) == -1.0
    with pytest.raises(ValueError):
        F.format_reward(s(good), mode="match")


def test_majority_vote_is_a_label_free_group_reward():
    group = [s("\\boxed{2}"), s("so 2.0"), s("it is 3"), s("nothing")]
    out = F.majority_vote(group)
    assert [o["score"] for o in out] == [1.0, 1.0, 0.0, 0.0]
    assert out[0]["agreement"] == pytest.approx(2 / 4)
    assert [o["score"] for o in F.majority_vote([s("none"), s("here")])] == [0.0, 0.0]

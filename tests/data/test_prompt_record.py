"""prompt_record.py: the gold answers of GSM8K and MATH solutions, checked against hand-written answers."""

from __future__ import annotations

import pytest

from async_grpo.data.prompt_record import extract_boxed_answer, extract_gsm8k_answer


@pytest.mark.parametrize(("solution", "expected"), [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
    ("so 10*100 = 1,000 hens\n#### 1,000", "1000"),
    ("#### 1 234 567\n", "1234567"),
    ("#### -3", "-3"),
    ("#### 0.5", "0.5"),
    ("a draft #### 5\nthe fix\n#### 6", "6"),
    ("no marker, 72", None),
    ("nothing after it ####  \n", None),
])
def test_gsm8k_answer_is_the_text_after_the_last_marker_without_commas(solution: str, expected: str | None) -> None:
    assert extract_gsm8k_answer(solution) == expected


@pytest.mark.parametrize(("solution", "expected"), [
    ("so it is $\\boxed{5}$.", "5"),
    ("$\\boxed{\\frac{1}{\\sqrt{2}}}$", "\\frac{1}{\\sqrt{2}}"),
    ("first \\boxed{1}, then \\boxed{2}", "2"),
    ("\\boxed{1} or rather \\fbox{3}", "3"),
    ("\\boxed {7}", "7"),
    ("\\boxed\n{x + 1}", "x + 1"),
    ("\\fbox{ 12 }", "12"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed{\\left\\{ x \\right.}", "\\left\\{ x \\right."),
    ("\\boxed{\\boxed{4}}", "4"),
    ("\\boxed{a_{1}^{2}} and text {after}", "a_{1}^{2}"),
    ("The answer is 5.", None),
    ("\\boxed{1} then \\boxed{unclosed", None),
    ("\\boxed{}", None),
    ("\\boxed 5", None),
    ("\\boxedsymbol{5}", None),
])
def test_math_answer_is_the_last_boxed_argument(solution: str, expected: str | None) -> None:
    assert extract_boxed_answer(solution) == expected

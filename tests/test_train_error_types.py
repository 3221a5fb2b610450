"""Error types per skill (issue 32): a linear equation's wrong answer is a sign error or a missing
division, a word problem's a stopped step or another operation, and only column arithmetic has carries."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.areal_train.grader import ERROR_TYPES, grade
from areal_metrics.areal_train.task import EOS, GENERATORS, Problem


def answered(problem: Problem, value: int) -> str | None:
    return grade(problem, ["#", *str(value), EOS]).error


def linear(a: int, b: int, x: int) -> Problem:
    c = a * x + b
    return Problem("linear", 2, (*str(a), "x", "+", *str(b), "=", *str(c), ",", "x", "=", "?"), x,
                   (*str(c), "-", *str(b), "=", *str(c - b), ",", *str(c - b), "/", *str(a), "=", *str(x)))


def test_linear_equations_have_sign_and_division_errors_and_no_carries() -> None:
    p = linear(2, 4, 5)  # 2x + 4 = 14
    assert answered(p, 9) == "sign"  # (14 + 4) / 2: b moved across with its sign
    assert answered(p, 10) == "no_division"  # 14 - 4 = 2x, not x
    assert answered(p, 6) == "off_by_one"
    assert answered(p, 15) == "arithmetic"  # off by ten: no carry in solving an equation
    assert answered(GENERATORS["add"](random.Random(1), 1), GENERATORS["add"](random.Random(1), 1).answer + 10) \
        == "carry"


def test_word_problems_have_step_and_operation_errors() -> None:
    two_steps = GENERATORS["word"](random.Random(3), 3)  # 21 pens, buys 24, gives away 32: 13
    assert (two_steps.answer, answered(two_steps, 45)) == (13, "step")  # stopped after 21 + 24
    buy = GENERATORS["word"](random.Random(2), 2)  # 25 apples, buys 12: 37
    assert (buy.answer, answered(buy, 13), answered(buy, 300)) == (37, "operation", "operation")
    assert answered(buy, 47) == "arithmetic"  # off by ten is no carry here


@settings(max_examples=300, deadline=None)
@given(skill=st.sampled_from(sorted(GENERATORS)), level=st.integers(1, 3), seed=st.integers(0, 10_000),
       offset=st.integers(-120, 120))
def test_every_wrong_answer_of_every_skill_gets_one_known_type(skill: str, level: int, seed: int, offset: int) -> None:
    p = GENERATORS[skill](random.Random(seed), level)
    value = p.answer + offset
    if value < 0:
        return
    error = answered(p, value)
    assert (error is None) == (offset == 0) and (error is None or error in ERROR_TYPES)
    if error == "carry":
        assert skill in ("add", "sub")

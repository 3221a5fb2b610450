"""The grader: the exact final answer decides, and a wrong answer gets an error type. Pure.

An attempt is the tokens the policy wrote, up to and including its `<eos>`.
The final answer is the number after the attempt's last ``#``; it is right
when it equals the problem's answer exactly (no leading zeros, nothing else
between it and `<eos>`). The scratchpad is not graded, only the answer.

Error types of a wrong attempt, first match wins:

- ``truncated``: the attempt never ended (no `<eos>` within the length limit);
- ``format``: no ``#``, or not a plain number after it;
- ``off_by_one``: the answer is one away from the right one;
- ``carry``: off by a power of ten (10, 100, ...): a dropped or extra carry or borrow;
- ``arithmetic``: any other wrong number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from areal_metrics.areal_train.task import EOS, Problem

ERROR_TYPES = ("truncated", "format", "off_by_one", "carry", "arithmetic")


@dataclass(frozen=True, slots=True)
class Grade:
    correct: bool
    answer: int | None  # the final answer read, None when there is none
    error: str | None  # one of ERROR_TYPES when wrong

    @property
    def verdict(self) -> int:
        return int(self.correct)


def final_answer(attempt: Sequence[str]) -> tuple[int | None, str | None]:
    """(the number after the last '#', None) or (None, the error type)."""
    if EOS not in attempt:
        return None, "truncated"
    body = list(attempt[: list(attempt).index(EOS)])
    if "#" not in body:
        return None, "format"
    tail = body[len(body) - body[::-1].index("#"):]
    text = "".join(tail)
    if not text.isdigit() or len(tail) != len(text) or (len(text) > 1 and text[0] == "0"):
        return None, "format"
    return int(text), None


def error_type(answer: int, expected: int) -> str:
    diff = abs(answer - expected)
    if diff == 1:
        return "off_by_one"
    power = 10
    while power <= diff:
        if diff == power:
            return "carry"
        power *= 10
    return "arithmetic"


def grade(problem: Problem, attempt: Sequence[str]) -> Grade:
    answer, error = final_answer(attempt)
    if answer is None:
        return Grade(False, None, error)
    if answer == problem.answer:
        return Grade(True, answer, None)
    return Grade(False, answer, error_type(answer, problem.answer))

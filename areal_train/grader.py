"""The grader: the exact final answer decides, and a wrong answer gets an error type. Pure.

An attempt is the tokens the policy wrote, up to and including its `<eos>`.
The final answer is the number after the attempt's last ``#``; it is right
when it equals the problem's answer exactly (no leading zeros, nothing else
between it and `<eos>`). The scratchpad is not graded, only the answer.

Error types of a wrong attempt, first match wins; after the first two they fit the skill:

- ``truncated``: the attempt never ended (no `<eos>` within the length limit);
- ``format``: no ``#``, or not a plain number after it;
- linear equations ``a x + b = c``: ``sign``, the answer solves ``a x - b = c`` (b moved
  across without changing its sign); ``no_division``, the answer is ``c - b`` (a x, not x);
- word problems: ``step``, the answer is an intermediate result of the worked solution
  (a two-step problem stopped after its first step); ``operation``, the answer combines the
  prompt's two numbers with another operation (added instead of subtracted, ...);
- ``off_by_one``: the answer is one away from the right one;
- ``carry`` (addition and subtraction in columns only): off by a power of ten (10, 100,
  ...): a dropped or extra carry or borrow;
- ``arithmetic``: any other wrong number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from areal_metrics.areal_train.task import EOS, Problem

ERROR_TYPES = ("truncated", "format", "sign", "no_division", "step", "operation", "off_by_one", "carry", "arithmetic")
COLUMN_SKILLS = ("add", "sub")  # where an answer off by a power of ten is a carry (or borrow) error


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


def error_type(answer: int, expected: int, skill: str = "add") -> str:
    diff = abs(answer - expected)
    if diff == 1:
        return "off_by_one"
    power = 10
    while skill in COLUMN_SKILLS and power <= diff:
        if diff == power:
            return "carry"
        power *= 10
    return "arithmetic"


def _numbers(tokens: Sequence[str]) -> list[int]:
    """The integers written in `tokens` (runs of digit tokens), in order."""
    out, digits = [], ""
    for t in (*tokens, " "):
        if t.isdigit():
            digits += t
        elif digits:
            out.append(int(digits))
            digits = ""
    return out


def skill_error(problem: Problem, answer: int) -> str | None:
    """The skill's own error type of a wrong `answer` (see the module docstring), None when none fits."""
    if problem.skill == "linear":
        a, b, c = (_numbers(problem.prompt) + [0, 0, 0])[:3]
        if a and answer * a == c + b:
            return "sign"
        if answer == c - b:
            return "no_division"
    elif problem.skill == "word":
        steps = _numbers(problem.scratch)
        results = steps[2::3][:-1]  # each worked equation is "x op y = z": its z, the final one aside
        if answer in results:
            return "step"
        first, second = (_numbers(problem.prompt) + [0, 0])[:2]
        if answer in {first + second, abs(first - second), first * second} - {problem.answer}:
            return "operation"
    return None


def grade(problem: Problem, attempt: Sequence[str]) -> Grade:
    answer, error = final_answer(attempt)
    if answer is None:
        return Grade(False, None, error)
    if answer == problem.answer:
        return Grade(True, answer, None)
    return Grade(False, answer, skill_error(problem, answer) or error_type(answer, problem.answer, problem.skill))

"""The verifiable task: addition problems, written as tokens, checked exactly.

A problem is "a+b=", the answer is the decimal sum followed by an end token.
Two evaluation datasets of different difficulty, named for what they are:

- ``add_1digit``: both operands 0..9 (answers 0..18), the training task;
- ``add_2digit``: both operands 10..99 (answers 20..198), much harder.

Everything here is pure and deterministic given a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Input vocabulary: digits, the two symbols, end-of-answer and padding.
DIGITS = "0123456789"
PLUS, EQUALS, EOS, PAD = 10, 11, 12, 13
VOCAB_SIZE = 14
# The policy's action space: a digit or the end token (it never writes + or =).
N_ACTIONS = 11
EOS_ACTION = 10

DATASETS: dict[str, tuple[int, int]] = {
    "add_1digit": (0, 9),
    "add_2digit": (10, 99),
}
EASY_DATASET = "add_1digit"
HARD_DATASET = "add_2digit"


@dataclass(frozen=True, slots=True)
class Problem:
    a: int
    b: int

    @property
    def text(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def prompt_tokens(self) -> list[int]:
        return [tokenize_char(c) for c in self.text]


def tokenize_char(c: str) -> int:
    if c in DIGITS:
        return int(c)
    if c == "+":
        return PLUS
    if c == "=":
        return EQUALS
    raise ValueError(f"not in the vocabulary: {c!r}")


def action_to_token(action: int) -> int:
    return EOS if action == EOS_ACTION else action


def decode_response(actions: list[int]) -> str | None:
    """The answer text a sequence of actions spells, or None if it never ended."""
    out = []
    for a in actions:
        if a == EOS_ACTION:
            return "".join(out)
        out.append(DIGITS[a])
    return None


def verify(problem: Problem, response: str | None) -> float:
    """Reward 1.0 for exactly the right answer (terminated, no extra characters), else 0.0."""
    return 1.0 if response is not None and response == problem.answer else 0.0


def make_problems(dataset: str, n: int, seed: int) -> list[Problem]:
    """`n` problems of a dataset, distinct while the dataset has enough, in a seeded order."""
    if dataset not in DATASETS:
        raise KeyError(dataset)
    lo, hi = DATASETS[dataset]
    rng = random.Random(f"{dataset}:{seed}")
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    rng.shuffle(pairs)
    while len(pairs) < n:  # more than the dataset holds: repeat it, reshuffled
        extra = list(pairs[: len(pairs)])
        rng.shuffle(extra)
        pairs += extra
    return [Problem(a, b) for a, b in pairs[:n]]


def max_answer_len(dataset: str) -> int:
    lo, hi = DATASETS[dataset]
    return len(str(2 * hi))

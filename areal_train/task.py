"""The verifiable task: procedurally generated math problems, as tokens. Pure and seeded.

Four skills, each at three levels of difficulty:

- ``add``: addition in columns (level 1: two digits and one, 2: two and two,
  3: three and two with at least two carries);
- ``sub``: subtraction in columns, never negative (level 3: at least two borrows);
- ``linear``: ``a x + b = c`` solved for x;
- ``word``: templated word problems (buy, give away, boxes of; level 3: two steps).

A problem has a prompt, an exact integer answer and a worked solution (a short
scratchpad: the columns right to left with their carries, or the intermediate
equations). A response is either ``# answer <eos>`` (direct) or
``scratchpad # answer <eos>``; the grader reads the number after the last ``#``.

Datasets (`DATASETS`): ``train`` mixes the levels; the evaluation sets have
their own fixed seed (`EVAL_SEED`, independent of any run's seed) and training
never draws one of their prompts (`make_train_set` excludes them):
``math_id`` (the same mixture: the role of MATH500) and ``math_hard`` (level 3
only: the role of AIME24).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# ------------------------------------------------------------------ vocabulary

PAD, BOS, ANS, EOS, WRONG = "<pad>", "<bos>", "<ans>", "<eos>", "<wrong>"
SPECIALS = (PAD, BOS, ANS, EOS, WRONG)  # ANS starts the first attempt; WRONG is the feedback before a retry
SYMBOLS = (*"0123456789", "+", "-", "*", "/", "=", "x", "#", ",", ".", "?")
NAMES = ("ann", "bob", "cy", "dee")
ITEMS = ("apples", "pens", "coins", "cards")
WORDS = (*NAMES, *ITEMS, "has", "buys", "gives", "away", "more", "then", "how", "many", "left", "boxes", "of",
         "she", "he")
VOCAB: tuple[str, ...] = (*SPECIALS, *SYMBOLS, *WORDS)
TOKEN_ID: dict[str, int] = {t: i for i, t in enumerate(VOCAB)}
PAD_ID, BOS_ID, ANS_ID, EOS_ID, WRONG_ID = (TOKEN_ID[t] for t in SPECIALS)
VOCAB_SIZE = len(VOCAB)

SKILLS = ("add", "sub", "linear", "word")
LEVEL_WEIGHTS = (0.35, 0.4, 0.25)  # the training mixture's share of levels 1, 2, 3
EVAL_SEED = 20_240_601  # the evaluation sets' own seed: the same sets for every run
TRAIN = "train"
DATASETS = ("math_id", "math_hard")
EVAL_EXCLUDE_SIZE = 512  # prompts per evaluation set that training never draws (eval_size is at most this)
EASY_DATASET, HARD_DATASET = DATASETS


def encode(tokens: Iterable[str]) -> list[int]:
    return [TOKEN_ID[t] for t in tokens]


def decode(ids: Iterable[int]) -> list[str]:
    return [VOCAB[i] for i in ids]


def render(tokens: Iterable[str]) -> str:
    """Readable text: symbols run together, words and specials stand apart."""
    out: list[str] = []
    for t in tokens:
        if t == PAD:
            continue
        spaced = t in WORDS or t in SPECIALS or t in (".", "?", ",")
        if out and (spaced or out[-1] in WORDS or out[-1] in SPECIALS or out[-1] in (".", "?", ",")):
            out.append(" ")
        out.append(t)
    return "".join(out)


def digits(n: int) -> list[str]:
    return list(str(n))


# -------------------------------------------------------------------- problems


@dataclass(frozen=True, slots=True)
class Problem:
    skill: str
    level: int
    prompt: tuple[str, ...]  # without BOS / ANS
    answer: int
    scratch: tuple[str, ...]  # the worked steps, without "# answer"

    def prompt_ids(self) -> list[int]:
        return encode((BOS, *self.prompt, ANS))

    def solution(self, with_scratch: bool = True) -> list[str]:
        """The response the supervised warm start teaches: [scratchpad] # answer <eos>."""
        return [*(self.scratch if with_scratch else ()), "#", *digits(self.answer), EOS]

    @property
    def text(self) -> str:
        return render(self.prompt)


def column_steps(a: int, b: int, subtract: bool) -> tuple[list[str], int]:
    """The scratchpad of column arithmetic (right to left: digit, carry or borrow) and the carry count."""
    xs, ys = digits(a)[::-1], digits(b)[::-1]
    steps: list[str] = []
    carry, count = 0, 0
    for i in range(max(len(xs), len(ys))):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        value = x - y - carry if subtract else x + y + carry
        carry = int(value < 0) if subtract else value // 10
        count += carry
        if steps:
            steps.append(",")
        steps += [str(value % 10), str(carry)]
    return steps, count


def _number(rng: random.Random, n_digits: int) -> int:
    return rng.randint(10 ** (n_digits - 1), 10**n_digits - 1)


# Operand sizes (digits of a, digits of b) of the column skills, per level.
COLUMN_DIGITS = {1: (2, 1), 2: (2, 2), 3: (3, 2)}


def _column(rng: random.Random, level: int, subtract: bool) -> Problem:
    """Addition or subtraction in columns; level 3 has at least two carries (borrows)."""
    da, db = COLUMN_DIGITS[level]
    while True:
        a, b = _number(rng, da), _number(rng, db)
        if level == 2 and rng.random() < 0.5:
            b = _number(rng, 1)
        if subtract and b > a:
            a, b = b, a
        steps, carries = column_steps(a, b, subtract)
        if level < 3 or carries >= 2:
            sign = "-" if subtract else "+"
            return Problem("sub" if subtract else "add", level, (*digits(a), sign, *digits(b), "="),
                           a - b if subtract else a + b, tuple(steps))


def _add(rng: random.Random, level: int) -> Problem:
    return _column(rng, level, subtract=False)


def _sub(rng: random.Random, level: int) -> Problem:
    return _column(rng, level, subtract=True)


def _linear(rng: random.Random, level: int) -> Problem:
    a = rng.randint(2, (3, 5, 9)[level - 1])
    x = rng.randint(1, 9 if level < 3 else 12)
    b = rng.randint(1, 9) if level == 1 else rng.randint(1, 20) if level == 2 else rng.randint(10, 40)
    c = a * x + b
    prompt = (*digits(a), "x", "+", *digits(b), "=", *digits(c), ",", "x", "=", "?")
    d = c - b
    scratch = (*digits(c), "-", *digits(b), "=", *digits(d), ",", *digits(d), "/", *digits(a), "=", *digits(x))
    return Problem("linear", level, prompt, x, scratch)


def _word(rng: random.Random, level: int) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    pron = "she" if name in ("ann", "dee") else "he"
    has = (name, "has")
    if level == 3:  # two steps: buy, then give away
        a, b = rng.randint(10, 40), rng.randint(5, 30)
        c = rng.randint(2, a + b - 1)
        prompt = (*has, *digits(a), item, ".", pron, "buys", *digits(b), "more", ".", "then", pron, "gives", "away",
                  *digits(c), ".", "how", "many", item, "left", "?")
        t = a + b
        scratch = (*digits(a), "+", *digits(b), "=", *digits(t), ",", *digits(t), "-", *digits(c), "=", *digits(t - c))
        return Problem("word", level, prompt, t - c, scratch)
    kind = rng.choice(("buy", "give") if level == 1 else ("buy", "give", "boxes"))
    if kind == "boxes":
        a, b = rng.randint(2, 5), rng.randint(2, 9)
        prompt = (*has, *digits(a), "boxes", "of", *digits(b), item, ".", "how", "many", item, "?")
        return Problem("word", level, prompt, a * b, (*digits(a), "*", *digits(b), "=", *digits(a * b)))
    top = 20 if level == 1 else 50
    a, b = rng.randint(2, top), rng.randint(2, top)
    if kind == "buy":
        prompt = (*has, *digits(a), item, ".", pron, "buys", *digits(b), "more", ".", "how", "many", item, "?")
        return Problem("word", level, prompt, a + b, (*digits(a), "+", *digits(b), "=", *digits(a + b)))
    a, b = max(a, b), min(a, b)
    prompt = (*has, *digits(a), item, ".", pron, "gives", "away", *digits(b), ".", "how", "many", item, "left", "?")
    return Problem("word", level, prompt, a - b, (*digits(a), "-", *digits(b), "=", *digits(a - b)))


GENERATORS: dict[str, Callable[[random.Random, int], Problem]] = {
    "add": _add, "sub": _sub, "linear": _linear, "word": _word,
}


def sample_problem(rng: random.Random, levels: Sequence[int] = (1, 2, 3),
                   weights: Sequence[float] = LEVEL_WEIGHTS) -> Problem:
    skill = rng.choice(SKILLS)
    level = rng.choices(levels, weights=weights)[0]
    return GENERATORS[skill](rng, level)


# -------------------------------------------------------------------- datasets


def _distinct(rng: random.Random, n: int, draw: Callable[[random.Random], Problem],
              exclude: frozenset[tuple[str, ...]] = frozenset()) -> list[Problem]:
    seen: set[tuple[str, ...]] = set(exclude)
    out: list[Problem] = []
    while len(out) < n:
        p = draw(rng)
        if p.prompt not in seen:
            seen.add(p.prompt)
            out.append(p)
    return out


def make_eval_set(dataset: str, n: int) -> list[Problem]:
    """An evaluation set: the same `n` problems for every run (their own seed), distinct prompts."""
    if dataset not in DATASETS:
        raise KeyError(dataset)
    rng = random.Random(f"{dataset}:{EVAL_SEED}")
    if dataset == "math_hard":
        return _distinct(rng, n, lambda r: sample_problem(r, levels=(3,), weights=(1.0,)))
    return _distinct(rng, n, sample_problem)


def eval_prompts(sizes: dict[str, int]) -> frozenset[tuple[str, ...]]:
    return frozenset(p.prompt for name, n in sizes.items() for p in make_eval_set(name, n))


def make_train_set(n: int, seed: int, exclude: frozenset[tuple[str, ...]],
                   weights: Sequence[float] = LEVEL_WEIGHTS, distinct: bool = True) -> list[Problem]:
    """`n` training problems from the run's seed (levels 1, 2, 3 in the shares `weights`), none of
    them an evaluation prompt; distinct ones, or (`distinct=False`) drawn with repeats.

    Distinct draws exhaust the small skills (about 740 two-digit-plus-one-digit sums exist), so
    a large distinct set holds far fewer of them than `weights` says; drawn with repeats, every
    skill and level keeps its share."""
    rng = random.Random(f"{TRAIN}:{seed}")
    if distinct:
        return _distinct(rng, n, lambda r: sample_problem(r, weights=weights), exclude)
    out: list[Problem] = []
    while len(out) < n:
        p = sample_problem(rng, weights=weights)
        if p.prompt not in exclude:
            out.append(p)
    return out


def fingerprint(problems: Sequence[Problem], protocol: dict[str, object] | None = None) -> str:
    """A hash of exactly these samples (prompts and answers, in order) and how they are sampled."""
    payload = json.dumps({"samples": [[list(p.prompt), p.answer] for p in problems], "protocol": protocol or {}},
                         separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]

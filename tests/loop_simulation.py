"""Seeded simulation of the closed loop's error rates, through the worker's real code.

The world a real run lives in (issue 40): one evaluation set, drawn once per run, evaluated
every round (`PROMPTS` prompts x `PER_PROMPT` samples); each sample keeps its sampling noise
across rounds (its uniform draw u is fixed: the verdict is u < the prompt's solve rate, so two
rounds of unchanged weights give identical data and a small change of the policy moves only
the samples near their boundary); prompts are clustered (a prompt's solve rate is
sigmoid(logit(mu) + b - c), b ~ N(0, `spread`) fixed per prompt, c so that the population
mean is mu); the round's true accuracy wobbles around the run's path (`jitter`, the SD of a
policy's real round-to-round change); the round is sharded over `nodes` ranks at `replicas`
replicas by prompt (so ranks evaluate unequal numbers of samples); and a node may be
systematically faulty (its grader stuck at 0). Each node's result goes through the worker's
own `on_eval` (the vote, the interval on the consensus, the loop: areal_metrics.streams.core.
processor); nothing of the decision code is re-implemented here. One honest node's round
(nodes 1, the long runs) skips the vote, whose per-sample work is most of a round's time: its
consensus is `one_node_consensus`, what the vote makes of one node's verdicts
(tests/test_streams_loop_simulation.py holds the two equal), fed to the loop's `on_consensus`.
A cut that restores weights is followed by a round of those weights at the cut's from_step, as
the reference trainer and TRL's callback evaluate them (`World.evaluates_restored`; AReaL does not).
`World(fixed=False)` draws fresh prompts and noise every round (independent rounds: the old
simulation's world).

    .venv/bin/python -m tests.loop_simulation [RUNS] [all|rates|rollback|tradeoff|issue|set]   # docs/STREAMS.md's tables
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from areal_metrics.producers.contract.events import EvalEvent
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.eval_loop import EvalLoopState, on_consensus
from areal_metrics.streams.core.processor import RunState, on_eval
from areal_metrics.producers.contract.statistics import interval_n, proportion_interval
from areal_metrics.streams.core.voting import Consensus, RoundKey

PROMPTS, PER_PROMPT = 128, 4  # 512 samples a round
THRESHOLD, ALPHA, PATIENCE = 0.3, 0.05, 5
INTERVAL = 10  # steps between rounds
CFG = RunConfig(lr_eval_threshold=THRESHOLD, lr_alpha=ALPHA, no_improvement_rounds=PATIENCE, lr_improve_delta=0.01,
                lr_horizon_rounds=200)


@dataclass(frozen=True)
class World:
    prompts: int = PROMPTS
    per_prompt: int = PER_PROMPT
    spread: float = 0.5  # SD of the prompts' logit offsets (clustering); 0: every prompt alike
    fixed: bool = True  # the same prompts and the same sampling noise every round
    jitter: float = 0.0  # SD of the round's true accuracy around the path
    nodes: int = 1  # ranks sharing the round (shard_nodes)
    replicas: int = 1
    faulty: int | None = None  # a node whose grader returns 0 for everything
    # the trainer evaluates weights a rollback restored at once, at the cut's from_step, before any update at
    # the lower rate (the reference trainer; TRL's callback with an eval_strategy); AReaL does not
    evaluates_restored: bool = True


INDEPENDENT = World(prompts=512, per_prompt=1, spread=0.0, fixed=False)  # 512 independent samples a round
PRODUCT = World(jitter=0.02, nodes=3, replicas=2)  # fixed set and noise, clustering, jitter, 3 ranks at 2 replicas


@dataclass(frozen=True)
class _Kind:  # what run_once reads of an output event, for the rounds that skip the vote
    type: str
    kind: str = ""
    args: dict = dataclasses.field(default_factory=dict)
    n_undecided: int = 0

    @property
    def command(self) -> str:
        return self.kind


@dataclass(frozen=True)
class RunLog:
    threshold_cuts: tuple[int, ...]  # rounds with an eval_below_threshold
    plateau: tuple[int, ...]  # rounds with a no_improvement
    restored: tuple[tuple[int, int], ...] = ()  # (round of a cut, round whose weights it named: a restored
    # round's step names the weights it restored)
    raises: tuple[int, ...] = ()  # rounds with a raising scale_lr (a restored round's: its cut's round)
    undecided: int = 0  # rounds with undecided samples
    restored_rounds: int = 0  # rounds of restored weights evaluated (World.evaluates_restored)
    raises_on_restored: int = 0  # raises a restored round made (the raise rule does not count it: 0)


_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(24)  # E over N(0, 1): sum(w f(x)) / sqrt(2 pi)
_WEIGHTS = _WEIGHTS / math.sqrt(2 * math.pi)


@lru_cache(maxsize=4096)
def _centre(mu: float, spread: float) -> float:
    """The logit c with E[sigmoid(c + b)] = mu over b ~ N(0, spread)."""
    low, high = -20.0, 20.0
    for _ in range(60):
        mid = (low + high) / 2
        mean = float(np.sum(_WEIGHTS / (1 + np.exp(-(mid + spread * _NODES)))))
        low, high = (mid, high) if mean < mu else (low, mid)
    return (low + high) / 2


def solve_rates(mu: float, offsets: np.ndarray, spread: float) -> np.ndarray:
    mu = min(max(mu, 1e-4), 1 - 1e-4)
    return 1 / (1 + np.exp(-(_centre(round(mu, 6), spread) + offsets)))


class Evaluation:
    """One run's evaluation set and noise; `round(mu)` -> the nodes' eval events' fields."""

    def __init__(self, world: World, rng: np.random.Generator) -> None:
        self.world, self.rng = world, rng
        self._draw()
        g, w = world.prompts, world.nodes
        self.shards = [[i for i in range(g) if (i - node) % w < world.replicas] for node in range(w)]

    def _draw(self) -> None:
        w = self.world
        self.offsets = self.rng.normal(0.0, w.spread, w.prompts) if w.spread > 0 else np.zeros(w.prompts)
        self.noise = self.rng.random((w.prompts, w.per_prompt))

    def verdicts(self, mu: float, jitter: bool = True) -> np.ndarray:
        """The round's prompt x sample verdicts at the path's `mu`; `self.realized` is its true accuracy
        (the jittered mu). `jitter=False` evaluates weights seen before: their true accuracy as it was."""
        if not self.world.fixed:
            self._draw()
        if jitter and self.world.jitter > 0:
            mu += self.rng.normal(0.0, self.world.jitter)
        self.realized = mu
        p = solve_rates(mu, self.offsets, self.world.spread)
        return (self.noise < p[:, None]).astype(int)

    def events(self, table: np.ndarray, step: int, eval_id: str) -> list[EvalEvent]:
        w, k = self.world, self.world.per_prompt
        out = []
        for node, prompts in enumerate(self.shards):
            ids = [i * k + j for i in prompts for j in range(k)]
            verdicts = [0 if node == w.faulty else int(table[i, j]) for i in prompts for j in range(k)]
            out.append(EvalEvent(run_id="sim", node=f"n{node}", eval_id=eval_id, step=step, dataset="math500",
                                 stage="full", accuracy=sum(verdicts) / len(verdicts), verdicts=verdicts,
                                 replicas=w.replicas, shard_nodes=w.nodes if w.nodes > w.replicas else None,
                                 sample_ids=ids if w.nodes > 1 else None,
                                 metrics={"samples_per_prompt": float(k)}, ts=float(step), event_id=f"{eval_id}-{node}"))
        return out


@lru_cache(maxsize=65536)
def _interval(per_prompt: int, sums: tuple[int, ...]) -> tuple[float, float, float]:
    """(effective size, 95 % interval) of a round from its prompts' numbers right: both depend on
    those alone (not on which sample is which, nor on the prompts' order), so repeated rounds are
    computed once (a run whose weights do not change repeats its round)."""
    clusters = {i: [1] * ones + [0] * (per_prompt - ones) for i, ones in enumerate(sums)}
    return (interval_n(clusters), *proportion_interval(clusters))


def one_node_consensus(step: int, eval_id: str, table: np.ndarray) -> Consensus:
    """The consensus the vote gives one node's round (prompt x sample verdicts): the accuracy, its
    effective size over the prompts' clusters and the vote's interval on them (statistics.proportion_interval)."""
    n = table.size
    accuracy = float(table.sum()) / n
    n_eff, low, high = _interval(table.shape[1], tuple(sorted(table.sum(axis=1).tolist())))
    return Consensus(key=RoundKey("sim", eval_id, "math500", "full", 0), step=step, accuracy=accuracy,
                     response_length=None, votes=1, replicas=1, agreement=1.0, dissenters=(), n_samples=n,
                     ci_low=low, ci_high=high, n_effective=n_eff)


def run_once(path: Sequence[float] | Callable[[int, float, bool], float], rng: np.random.Generator,
             cfg: RunConfig = CFG, world: World = PRODUCT, rounds: int | None = None) -> RunLog:
    """One run. `path` is the true accuracy per round, or a trainer: (round, cumulative lr factor,
    weights restored since its last call) -> the true accuracy of that round. A cut that restores
    weights is followed, in a world whose trainer `evaluates_restored`, by a round of those weights at
    the cut's from_step: the restored round's true accuracy as it was, on the same set (so, in the fixed
    world, that round's very verdicts)."""
    state, loop = RunState("sim"), EvalLoopState()
    ev = Evaluation(world, rng)
    log = _Log()
    factor, restore = 1.0, False
    realized: dict[int, float] = {}  # round -> its true accuracy, jitter included
    weights: dict[int, int] = {}  # evaluated step -> the round whose weights it evaluated
    n = len(path) if not callable(path) else rounds or 20
    for r in range(n):
        mu = path(r, factor, restore) if callable(path) else path[r]
        table = ev.verdicts(mu)
        realized[r], weights[INTERVAL * r] = ev.realized, r
        state, loop, outs = _round(state, loop, ev, table, INTERVAL * r, f"e{r}", float(r), cfg)
        scale = log.record(r, outs, weights)
        factor, restore = factor * scale.factor, scale.restore_step is not None
        if restore and world.evaluates_restored:
            named = weights[scale.restore_step]
            weights[scale.from_step] = named
            table = ev.verdicts(realized[named], jitter=False)
            state, loop, outs = _round(state, loop, ev, table, scale.from_step, f"e{r}-restored", r + 0.5, cfg)
            log.restored_rounds += 1
            log.raises_on_restored += len(log.record(r, outs, weights).raises)
    return log.freeze()


@dataclass
class _Scale:  # what a round's scale_lr commands did
    factor: float = 1.0
    from_step: int = 0
    restore_step: int | None = None
    raises: list[int] = dataclasses.field(default_factory=list)


@dataclass
class _Log:
    cuts: list[int] = dataclasses.field(default_factory=list)
    plateau: list[int] = dataclasses.field(default_factory=list)
    restored: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    raises: list[int] = dataclasses.field(default_factory=list)
    undecided: int = 0
    restored_rounds: int = 0
    raises_on_restored: int = 0

    def record(self, r: int, outs: list[list], weights: dict[int, int]) -> _Scale:
        scale = _Scale()
        for out in outs:
            for o in out:
                if o.type == "alert" and o.kind == "eval_below_threshold":
                    self.cuts.append(r)
                elif o.type == "alert" and o.kind == "no_improvement":
                    self.plateau.append(r)
                elif o.type == "eval_consensus" and o.n_undecided:
                    self.undecided += 1
                elif o.type == "command" and o.command == "scale_lr":
                    scale.factor *= o.args["factor"]
                    scale.from_step = int(o.args["from_step"])
                    if o.args["factor"] > 1:
                        self.raises.append(r)
                        scale.raises.append(r)
                    if "restore_step" in o.args:
                        self.restored.append((r, weights[int(o.args["restore_step"])]))
                        scale.restore_step = int(o.args["restore_step"])
        return scale

    def freeze(self) -> RunLog:
        return RunLog(tuple(self.cuts), tuple(self.plateau), tuple(self.restored), tuple(self.raises), self.undecided,
                      self.restored_rounds, self.raises_on_restored)


def _round(state: RunState, loop: EvalLoopState, ev: Evaluation, table: np.ndarray, step: int, eval_id: str,
           now: float, cfg: RunConfig) -> tuple[RunState, EvalLoopState, list[list]]:
    """One round's verdicts through the worker's code: each node's event through `on_eval` (the vote),
    or one honest node's consensus straight into the loop."""
    world = ev.world
    if world.nodes == 1 and world.faulty is None:
        loop, alerts, commands = on_consensus(loop, one_node_consensus(step, eval_id, table), cfg)
        return state, loop, [[_Kind("alert", a.kind) for a in alerts]
                             + [_Kind("command", d.command, d.args) for d in commands]]
    outs = []
    for e in ev.events(table, step, eval_id):
        state, out = on_eval(state, e, now, cfg)
        outs.append([o.event for o in out])
    return state, loop, outs


def simulate(runs: int, seed: int, path, cfg: RunConfig = CFG, world: World = PRODUCT,
             rounds: int | None = None) -> list[RunLog]:
    rng = np.random.default_rng(seed)
    return [run_once(path, rng, cfg, world, rounds) for _ in range(runs)]


def share(logs: list[RunLog], hit: Callable[[RunLog], bool]) -> tuple[float, float]:
    """(the share of runs where `hit`, its Monte-Carlo standard error)."""
    p = sum(map(hit, logs)) / len(logs)
    return p, math.sqrt(max(p * (1 - p), 1e-12) / len(logs))


def cut_within(start: int, rounds: int) -> Callable[[RunLog], bool]:
    return lambda log: any(start <= r < start + rounds for r in log.threshold_cuts)


def any_cut(log: RunLog) -> bool:
    return bool(log.threshold_cuts)


GOOD = 0.40  # a healthy run's accuracy, above the threshold


def at_threshold(rounds: int = 150) -> list[float]:
    return [THRESHOLD] * rounds


def drop_after(good: int, low: float = 0.23, after: int = 4) -> list[float]:
    return [GOOD] * good + [low] * after


def improving_at_boundary(rounds: int = 40, delta: float = 0.01) -> list[float]:
    """A run improving exactly at the plateau rule's delta per round: the rule's null boundary."""
    return [0.2 + delta * r for r in range(rounds)]


def collapsing_trainer(collapse_at: float = 1.0, after: int = 2) -> Callable[[int, float, bool], float]:
    """A trainer at GOOD accuracy that collapses to 0.15 once it has trained `after` rounds at a
    cumulative lr factor >= `collapse_at`, and is stable below it; a rollback restores its weights."""
    hot = {"rounds": 0, "collapsed": False}

    def accuracy(r: int, factor: float, restored: bool) -> float:
        if restored:
            hot["collapsed"] = False
        if factor >= collapse_at - 1e-9:
            hot["rounds"] += 1
            if hot["rounds"] > after:
                hot["collapsed"] = True
        else:
            hot["rounds"] = 0
        return 0.15 if hot["collapsed"] else GOOD

    return accuracy


ROLLBACK = CFG.with_overrides({"lr_rollback": True, "no_improvement_rounds": 0})


ONE_NODE = dataclasses.replace(PRODUCT, nodes=1, replicas=1)  # the product world, one honest node (no vote)


def target_rows(world_name: str, world: World, runs: int, seed: int = 27) -> Iterator[tuple[str, tuple[float, float]]]:
    """The issue's three targets in one world: at the threshold for 150 rounds; a drop after 5
    and after 150 good rounds."""
    steady = dataclasses.replace(world, jitter=0.0)  # "exactly at the threshold": no wobble
    yield f"{world_name}: at 0.30 (threshold) for 150 rounds, cut", share(
        simulate(runs, seed, at_threshold(), CFG, steady), any_cut)
    yield f"{world_name}: 0.40 -> 0.23 after 5 rounds, cut within 2", share(
        simulate(runs, seed + 1, drop_after(5), CFG, world), cut_within(5, 2))
    yield f"{world_name}: 0.40 -> 0.23 after 150 rounds, cut within 2", share(
        simulate(runs, seed + 2, drop_after(150), CFG, world), cut_within(150, 2))


def rate_rows(runs: int, seed: int = 27) -> Iterator[tuple[str, tuple[float, float]]]:
    """Every rate docs/STREAMS.md's table shows: name -> (rate, Monte-Carlo SE). The rows through
    the vote (several nodes) run a fifth as many runs: the vote is most of a round's time."""
    few = max(runs // 5, 2)
    yield from target_rows("independent", INDEPENDENT, runs, seed)
    yield from target_rows("product, 1 node", ONE_NODE, runs, seed)
    fixed = dataclasses.replace(ONE_NODE, jitter=0.0)  # the drop's rounds repeat their data
    for within in (2, 4):
        yield f"product, 1 node, no jitter: 0.40 -> 0.23 after 5 rounds, cut within {within}", share(
            simulate(runs, seed + 12, drop_after(5), CFG, fixed), cut_within(5, within))
    yield "product, 1 node: at 0.40 for 200 rounds, cut", share(
        simulate(runs, seed + 3, [GOOD] * 200, CFG, ONE_NODE), any_cut)
    yield "product, 1 node, jitter 0.02: at 0.30 for 150 rounds (half its rounds truly below), cut", share(
        simulate(runs, seed + 10, at_threshold(), CFG, ONE_NODE), any_cut)
    jittery = dataclasses.replace(ONE_NODE, jitter=0.05)
    yield "product, 1 node, jitter 0.05: improving 0.01/round for 40 rounds (plateau null), no_improvement", share(
        simulate(runs, seed + 4, improving_at_boundary(), CFG, jittery), lambda log: bool(log.plateau))
    yield "product, 1 node: flat at 0.40 for 40 rounds, no_improvement (power)", share(
        simulate(runs, seed + 5, [GOOD] * 40, CFG, ONE_NODE), lambda log: bool(log.plateau))
    yield "product, 3 ranks at 2 replicas: 0.40 -> 0.23 after 20 rounds, cut within 2", share(
        simulate(few, seed + 11, drop_after(20), CFG, PRODUCT), cut_within(20, 2))
    stuck = dataclasses.replace(PRODUCT, nodes=2, replicas=2, faulty=1)
    yield "2 ranks at 2 replicas, rank 1's grader stuck at 0, at 0.40 for 20 rounds: cut", share(
        simulate(few, seed + 6, [GOOD] * 20, CFG, stuck), any_cut)
    yield ("2 ranks at 2 replicas, rank 1's grader stuck at 0: improving 0.01/round for 40 rounds (plateau null), "
           "no_improvement"), share(simulate(few, seed + 13, improving_at_boundary(), CFG, stuck), lambda log: bool(log.plateau))
    outvoted = dataclasses.replace(PRODUCT, nodes=3, replicas=3, faulty=2)
    yield "3 ranks at 3 replicas, rank 2 stuck at 0: 0.40 -> 0.23 after 20 rounds, cut within 2", share(
        simulate(few, seed + 7, drop_after(20), CFG, outvoted), cut_within(20, 2))
    cycle = [run_once(collapsing_trainer(), np.random.default_rng(seed + 8 + i), ROLLBACK, PRODUCT, 20)
             for i in range(few)]
    yield "trainer collapsing at x1.0 (3 ranks at 2 replicas, rollback): at most 1 cut and 1 raise in 20 rounds", share(
        cycle, lambda log: len(log.threshold_cuts) <= 1 and len(log.raises) <= 1)
    yield ("trainer collapsing at x1.0: every raise after lr_raise_after_rounds (3) rounds at the lower rate, the "
           "restored weights' round not among them"), share(cycle, raised_after_rounds_at_lower_rate)
    harsh = [run_once(collapsing_trainer(0.6), np.random.default_rng(seed + 9 + i), ROLLBACK, PRODUCT, 20)
             for i in range(few)]
    yield "trainer collapsing above x0.5: at most 2 cuts and 1 raise in 20 rounds", share(
        harsh, lambda log: len(log.threshold_cuts) <= 2 and len(log.raises) <= 1)


def raised_after_rounds_at_lower_rate(log: RunLog, cfg: RunConfig = ROLLBACK) -> bool:
    """Every raise came `lr_raise_after_rounds` ordinary rounds or more after the cut before it: a round of
    restored weights (evaluated before any update at the lower rate) is no evidence of that rate."""
    return log.raises_on_restored == 0 and all(
        raise_ - max(c for c in log.threshold_cuts if c < raise_) >= cfg.lr_raise_after_rounds for raise_ in log.raises)


TRADE_ALPHAS = (0.05, 0.10, 0.20, 0.30)


def tradeoff_rows(runs: int, seed: int = 70) -> Iterator[tuple[str, tuple[float, float]]]:
    """What `lr_alpha` trades: the threshold rule's false cuts against its power, per alpha."""
    steady = dataclasses.replace(ONE_NODE, jitter=0.0)
    for alpha in TRADE_ALPHAS:
        cfg = CFG.with_overrides({"lr_alpha": alpha})
        yield f"alpha {alpha:g}: independent, at 0.30 for 150 rounds, cut", share(
            simulate(runs, seed, at_threshold(), cfg, INDEPENDENT), any_cut)
        yield f"alpha {alpha:g}: independent, 0.40 -> 0.23 after 5 rounds, cut within 2", share(
            simulate(runs, seed + 1, drop_after(5), cfg, INDEPENDENT), cut_within(5, 2))
        yield f"alpha {alpha:g}: product, 1 node, at 0.30 for 150 rounds, cut", share(
            simulate(runs, seed + 2, at_threshold(), cfg, steady), any_cut)
        yield f"alpha {alpha:g}: product, 1 node, 0.40 -> 0.23 after 5 rounds, cut within 2", share(
            simulate(runs, seed + 4, drop_after(5), cfg, ONE_NODE), cut_within(5, 2))


def larger_set_rows(runs: int, seed: int = 80) -> Iterator[tuple[str, tuple[float, float]]]:
    """The evidence a round holds: the product world's drop with twice the prompts."""
    for prompts in (128, 256):
        world = dataclasses.replace(ONE_NODE, prompts=prompts)
        yield f"product, 1 node, {prompts} prompts x 4: 0.40 -> 0.23 after 5 rounds, cut within 2", share(
            simulate(runs, seed, drop_after(5), CFG, world), cut_within(5, 2))


def rates(runs: int, seed: int = 27) -> dict[str, tuple[float, float]]:
    return dict(rate_rows(runs, seed))


COLLAPSE = [GOOD] * 20 + [0.10] * 3  # a clean collapse after 20 good rounds
SLIDE = [GOOD] * 20 + [0.27] + [0.10] * 3  # a slide whose first round under 0.30 is close enough to read above it


def rollback_rates(runs: int, seed: int = 60) -> dict[str, tuple[float, float]]:
    """Which weights a cut names (rollback on; the product world, one node): a round whose true
    accuracy was at or above the threshold (good), or one that was not (bad); with a trainer that
    evaluates restored weights at once (the reference trainer, TRL) and with one that does not (AReaL).
    The paths ignore the rollback (the policy collapses again): every later cut must name good weights."""
    out: dict[str, tuple[float, float]] = {}
    for trainer, world in (("", ONE_NODE), (", restored weights not evaluated",
                                            dataclasses.replace(ONE_NODE, evaluates_restored=False))):
        for name, path in (("collapse 0.40 -> 0.10 after 20 rounds", COLLAPSE),
                           ("slide 0.40 -> 0.27 -> 0.10 after 20 rounds", SLIDE)):
            good = {r for r, mu in enumerate(path) if mu >= THRESHOLD}
            logs = simulate(runs, seed, path, ROLLBACK, world)
            out[f"rollback{trainer}, {name}: the cut names a good round"] = share(
                logs, lambda log: any(r in good for _, r in log.restored))
            out[f"rollback{trainer}, {name}: the cut names a round under the threshold"] = share(
                logs, lambda log: any(r not in good for _, r in log.restored))
            seed += 1
        seed -= 2  # the same runs' seeds in both trainers
    return out


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    print(f"| condition (seeds: rates 27, rollback 60, tradeoff 70, set 80; {n} runs a row, {max(n // 5, 2)} through the "
          "vote) | rate | MC error |\n"
          "|---|---|---|", flush=True)
    which = sys.argv[2] if len(sys.argv) > 2 else "all"
    rows = itertools.chain(rate_rows(n) if which in ("all", "rates") else (),
                           rollback_rates(n).items() if which in ("all", "rollback") else (),
                           tradeoff_rows(n) if which in ("all", "tradeoff") else (),
                           target_rows("independent", INDEPENDENT, n) if which == "issue" else (),
                           larger_set_rows(n) if which == "set" else ())
    for name, (value, se) in rows:
        print(f"| {name} | {value:.3f} | {se:.3f} |", flush=True)

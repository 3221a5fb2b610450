"""Cross-node majority vote over one evaluation round, and degraded mode.

A round is (run_id, eval_id, dataset, stage, attempt); `replicas` nodes evaluate it. Pure:
`add_result(state, result, now, cfg)` and `expire(state, now, cfg)` return the new state
and a `VoteOutcome` (a consensus to emit, alerts).

When the round's consensus is emitted (once; CONTRACT.md 'eval_consensus'):
- as soon as a strict majority of `replicas` agree: on every sample when the results carry
  `verdicts`, else on the accuracy within `vote_tolerance`;
- or when every replica has answered (per-sample majority among the answers; a tied
  sample counts as 0; values without a majority fall back to the median, with a
  `vote_no_majority` alert);
- or at `vote_timeout_s` after the first result, `partial: true`, if a quorum (strict
  majority of replicas) answered `ok`.
A round fails when `failed` results make a quorum impossible, or when the timeout comes
without a quorum: it then re-emits the last good consensus of that run, dataset and stage
with `stale: true`, and raises `eval_failed`. A result for a closed round, or a second
result from the same node, changes nothing.

Because a per-sample majority of replicas is final the moment it exists, the consensus
verdicts (so the accuracy) do not depend on the order results arrive in.

Sharded rounds (areal_train's full stage): each node evaluates a cyclic window of the
round's samples (`offset`, `total`; from the eval event's `metrics` shard_offset,
shard_total, shard_redundancy) and each sample has `redundancy` replicas. The vote is
then per sample among the nodes that cover it (`_combine_windows`): decided when a strict
majority of its replicas agree; the accuracy is over the covered samples.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import astuple, dataclass, field

from areal_metrics.streams.core.alerts import AlertDecision
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.evolve import evolve, stored

CLOSED_ROUNDS_KEPT = 2048  # per run: remembered to refuse late results without re-voting


@stored  # stored state (areal_metrics.streams.state.codec)
class NodeResult:
    node: str
    ok: bool
    accuracy: float | None = None
    response_length: float | None = None
    verdicts: tuple[int, ...] | None = None
    error: str | None = None
    # A sharded round: the verdicts are the cyclic window of the round's `total` samples that
    # starts at `offset`; each sample has `redundancy` replicas (see _combine_windows).
    offset: int | None = None
    total: int | None = None
    redundancy: int | None = None

    @property
    def sharded(self) -> bool:
        return self.total is not None and self.offset is not None and self.verdicts is not None


@stored  # stored state (areal_metrics.streams.state.codec)
class RoundKey:
    run_id: str
    eval_id: str
    dataset: str
    stage: str
    attempt: int = 0  # a resumed attempt votes its rounds afresh, even under an earlier eval_id

    @property
    def dataset_stage(self) -> tuple[str, str]:
        """The key of the last good result a failed round repeats."""
        return (self.dataset, self.stage)


@stored  # stored state (areal_metrics.streams.state.codec)
class RoundState:
    key: RoundKey
    step: int
    replicas: int
    opened_at: float  # worker clock at the first result; the timeout counts from here
    results: tuple[NodeResult, ...] = ()


@stored  # stored state (areal_metrics.streams.state.codec)
class Consensus:
    key: RoundKey
    step: int
    accuracy: float
    response_length: float | None
    votes: int
    replicas: int
    agreement: float
    dissenters: tuple[str, ...]
    stale: bool = False
    partial: bool = False


@stored  # stored state (areal_metrics.streams.state.codec)
class VoteState:
    """Keys are structured (RoundKey, (dataset, stage)): never a joined string to split again."""

    open_rounds: Mapping[RoundKey, RoundState] = field(default_factory=dict)
    closed: tuple[RoundKey, ...] = ()  # rounds already decided, oldest first
    last_good: Mapping[tuple[str, str], Consensus] = field(default_factory=dict)  # (dataset, stage) ->

    @classmethod
    def empty(cls) -> VoteState:
        return cls()


@dataclass(frozen=True, slots=True)
class VoteOutcome:
    consensus: Consensus | None = None
    alerts: tuple[AlertDecision, ...] = ()


@dataclass(frozen=True, slots=True)
class Combination:
    """The vote over a set of ok results."""

    accuracy: float
    response_length: float | None
    agreement: float
    dissenters: tuple[str, ...]
    divergence: Mapping[str, float]  # node -> share of samples off the consensus, or distance of its value
    decisive: bool  # a strict majority of replicas agrees (on every sample)
    has_majority: bool  # some majority exists (of replicas, or of the answers when final)
    verdicts: tuple[int, ...] | None = None


def quorum(replicas: int) -> int:
    return replicas // 2 + 1


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _verdict_mode(results: list[NodeResult]) -> bool:
    lengths = {len(r.verdicts) if r.verdicts is not None else -1 for r in results}
    return len(lengths) == 1 and -1 not in lengths and lengths != {0}


def combine(results: Iterable[NodeResult], replicas: int, cfg: RunConfig) -> Combination:
    """Vote over ok results. Order-invariant: results are sorted by node first."""
    ok = sorted((r for r in results if r.ok), key=lambda r: r.node)
    if not ok:
        raise ValueError("combine needs at least one ok result")
    need = quorum(replicas)
    if _window_mode(ok):
        return _combine_windows(ok)
    if _verdict_mode(ok):
        return _combine_verdicts(ok, need)
    return _combine_values(ok, need, cfg)


def _window_mode(results: list[NodeResult]) -> bool:
    totals = {r.total for r in results}
    return all(r.sharded for r in results) and len(totals) == 1 and totals != {0}


def _combine_windows(ok: list[NodeResult]) -> Combination:
    """Per-sample vote of a sharded round: each sample among the nodes whose window covers it.

    A sample is decided when a strict majority of its `redundancy` replicas agree; the
    consensus (so the accuracy) is over the samples some node covered.
    """
    total = ok[0].total or 0
    need = quorum(max(r.redundancy or 1 for r in ok))
    votes: list[list[tuple[str, int]]] = [[] for _ in range(total)]
    for r in ok:
        for j, v in enumerate(r.verdicts or ()):
            votes[((r.offset or 0) + j) % total].append((r.node, v))
    consensus: list[int] = []
    decisive = True
    for sample in votes:
        ones = sum(v for _, v in sample)
        zeros = len(sample) - ones
        decisive = decisive and max(ones, zeros) >= need
        consensus.append(1 if ones > zeros else 0)  # a tie counts as 0 (not solved)
    off = {r.node: 0 for r in ok}
    for sample, agreed in zip(votes, consensus):
        for node, v in sample:
            off[node] += v != agreed
    cast = sum(len(sample) for sample in votes)
    covered = [c for c, sample in zip(consensus, votes) if sample]
    weights = [len(r.verdicts or ()) for r in ok if r.response_length is not None]
    lengths = [r.response_length * len(r.verdicts or ()) for r in ok if r.response_length is not None]
    return Combination(
        accuracy=sum(covered) / len(covered) if covered else 0.0,
        response_length=sum(lengths) / sum(weights) if lengths and sum(weights) else None,  # type: ignore[operator]
        agreement=1.0 - sum(off.values()) / cast if cast else 1.0,
        dissenters=tuple(node for node, n in off.items() if n > 0),
        divergence={r.node: off[r.node] / max(len(r.verdicts or ()), 1) for r in ok},
        decisive=decisive,
        has_majority=True,
        verdicts=tuple(consensus),
    )


def _combine_verdicts(ok: list[NodeResult], need: int) -> Combination:
    matrix = [r.verdicts for r in ok]
    n_samples = len(matrix[0])  # type: ignore[arg-type]
    consensus: list[int] = []
    decisive = True
    for i in range(n_samples):
        ones = sum(v[i] for v in matrix)  # type: ignore[index]
        zeros = len(matrix) - ones
        if ones >= need or zeros >= need:
            consensus.append(1 if ones >= need else 0)
        else:
            decisive = False
            consensus.append(1 if ones > zeros else 0)  # a tie counts as 0 (not solved)
    off = {r.node: sum(a != b for a, b in zip(r.verdicts, consensus)) for r in ok}  # type: ignore[arg-type]
    total = n_samples * len(ok)
    agreement = 1.0 - sum(off.values()) / total
    dissenters = tuple(node for node, n in off.items() if n > 0)
    majority_side = [r for r in ok if off[r.node] == 0] or ok
    return Combination(
        accuracy=sum(consensus) / n_samples,
        response_length=_median(r.response_length for r in majority_side),
        agreement=agreement,
        dissenters=dissenters,
        divergence={node: n / n_samples for node, n in off.items()},
        decisive=decisive,
        has_majority=True,
        verdicts=tuple(consensus),
    )


def _combine_values(ok: list[NodeResult], need: int, cfg: RunConfig) -> Combination:
    values = sorted(((r.accuracy if r.accuracy is not None else 0.0), r.node) for r in ok)
    tol = cfg.vote_tolerance + 1e-12  # a value exactly at the tolerance agrees
    best: list[tuple[float, str]] = []
    for anchor, _ in values:
        cluster = [(v, n) for v, n in values if abs(v - anchor) <= tol]
        spread = cluster[-1][0] - cluster[0][0]
        if len(cluster) > len(best) or (len(cluster) == len(best) and spread < best[-1][0] - best[0][0]):
            best = cluster
    decisive = len(best) >= need
    has_majority = decisive or len(best) > len(values) / 2
    by_node = {r.node: r for r in ok}
    if has_majority:
        members = {n for _, n in best}
        accuracy = statistics.median(v for v, _ in best)
        agreement = len(best) / len(values)
    else:
        members = set(by_node)
        accuracy = statistics.median(v for v, _ in values)
        agreement = max(len(best), 1) / len(values)
    dissenters = tuple(sorted(n for n in by_node if n not in members)) if has_majority else ()
    return Combination(
        accuracy=accuracy,
        response_length=_median(by_node[n].response_length for n in sorted(members)),
        agreement=agreement,
        dissenters=dissenters,
        divergence={n: abs(v - accuracy) for v, n in values},
        decisive=decisive,
        has_majority=has_majority,
    )


# ------------------------------------------------------------------ round lifecycle


def _close(state: VoteState, key: RoundKey, good: Consensus | None) -> VoteState:
    open_rounds = {k: r for k, r in state.open_rounds.items() if k != key}
    closed = (*state.closed, key)[-CLOSED_ROUNDS_KEPT:]
    last_good = dict(state.last_good)
    if good is not None:
        last_good[key.dataset_stage] = good
    return VoteState(open_rounds, closed, last_good)


def round_about(kind: str, key: RoundKey, *more: str) -> tuple[str, ...]:
    """The parts that name an alert about a round (its deterministic id): kept apart, never joined."""
    return (kind, key.run_id, key.eval_id, key.dataset, key.stage, *more)


def _divergence_alerts(rnd: RoundState, comb: Combination, cfg: RunConfig) -> list[AlertDecision]:
    alerts = []
    unit = "of samples" if comb.verdicts is not None else "accuracy distance"
    for node, off in sorted(comb.divergence.items()):
        if off > cfg.divergence_threshold:
            alerts.append(
                AlertDecision(
                    kind="node_divergence",
                    severity="warning",
                    message=(
                        f"node {node} disagrees with the consensus of eval {rnd.key.eval_id} "
                        f"({rnd.key.dataset}/{rnd.key.stage}): {off:.3g} {unit} > {cfg.divergence_threshold:g}"
                    ),
                    about=round_about("node_divergence", rnd.key, node),
                    step=rnd.step,
                    value=off,
                    threshold=cfg.divergence_threshold,
                )
            )
    return alerts


def _decide(rnd: RoundState, comb: Combination, partial: bool, cfg: RunConfig) -> tuple[Consensus, list[AlertDecision]]:
    consensus = Consensus(
        key=rnd.key,
        step=rnd.step,
        accuracy=comb.accuracy,
        response_length=comb.response_length,
        votes=sum(r.ok for r in rnd.results),
        replicas=rnd.replicas,
        agreement=comb.agreement,
        dissenters=comb.dissenters,
        partial=partial,
    )
    alerts = _divergence_alerts(rnd, comb, cfg)
    if not comb.has_majority:
        alerts.append(
            AlertDecision(
                kind="vote_no_majority",
                severity="warning",
                message=(
                    f"no majority among {consensus.votes} results of eval {rnd.key.eval_id} "
                    f"({rnd.key.dataset}/{rnd.key.stage}); using the median accuracy {comb.accuracy:.4g}"
                ),
                about=round_about("vote_no_majority", rnd.key),
                step=rnd.step,
                value=comb.accuracy,
            )
        )
    return consensus, alerts


def _fail(state: VoteState, rnd: RoundState, why: str) -> tuple[VoteState, VoteOutcome]:
    previous = state.last_good.get(rnd.key.dataset_stage)
    stale = None
    if previous is not None:
        stale = evolve(previous, key=rnd.key, step=rnd.step, replicas=rnd.replicas, stale=True, partial=False)
    repeat = (
        f"; repeating the last good result (eval {previous.key.eval_id}, accuracy {previous.accuracy:.4g})"
        if previous is not None else "; no earlier result to repeat"
    )
    alert = AlertDecision(
        kind="eval_failed",
        severity="critical",
        message=f"eval {rnd.key.eval_id} ({rnd.key.dataset}/{rnd.key.stage}) at step {rnd.step} failed: {why}{repeat}",
        about=round_about("eval_failed", rnd.key),
        step=rnd.step,
    )
    return _close(state, rnd.key, None), VoteOutcome(stale, (alert,))


def _failures(rnd: RoundState) -> str:
    failed = [r for r in rnd.results if not r.ok]
    detail = "; ".join(f"{r.node}: {r.error or 'failed'}" for r in failed)
    return f"{len(failed)} of {rnd.replicas} nodes failed ({detail})"


def add_result(
    state: VoteState,
    key: RoundKey,
    step: int,
    replicas: int,
    result: NodeResult,
    now: float,
    cfg: RunConfig,
) -> tuple[VoteState, VoteOutcome]:
    if key in state.closed:
        return state, VoteOutcome()
    rnd = state.open_rounds.get(key) or RoundState(key=key, step=step, replicas=replicas, opened_at=now)
    if any(r.node == result.node for r in rnd.results):
        return state, VoteOutcome()
    rnd = evolve(rnd, results=(*rnd.results, result))
    answered = len(rnd.results)
    ok = [r for r in rnd.results if r.ok]
    need = quorum(rnd.replicas)

    if len(ok) + max(0, rnd.replicas - answered) < need:
        return _fail(state, rnd, _failures(rnd))
    if ok:
        comb = combine(ok, rnd.replicas, cfg)
        if comb.decisive or answered >= rnd.replicas:
            consensus, alerts = _decide(rnd, comb, partial=False, cfg=cfg)
            return _close(state, key, consensus), VoteOutcome(consensus, tuple(alerts))
    return VoteState({**state.open_rounds, key: rnd}, state.closed, state.last_good), VoteOutcome()


def expire(state: VoteState, now: float, cfg: RunConfig) -> tuple[VoteState, list[VoteOutcome]]:
    """Close the rounds open longer than vote_timeout_s: partial consensus, or failed."""
    outcomes: list[VoteOutcome] = []
    for key, rnd in sorted(state.open_rounds.items(), key=lambda kv: (kv[1].opened_at, astuple(kv[0]))):
        if now - rnd.opened_at < cfg.vote_timeout_s:
            continue
        ok = [r for r in rnd.results if r.ok]
        if len(ok) >= quorum(rnd.replicas):
            consensus, alerts = _decide(rnd, combine(ok, rnd.replicas, cfg), partial=True, cfg=cfg)
            state = _close(state, key, consensus)
            outcomes.append(VoteOutcome(consensus, tuple(alerts)))
        else:
            why = f"no quorum within {cfg.vote_timeout_s:g} s ({len(ok)} of {rnd.replicas} nodes answered ok)"
            state, outcome = _fail(state, rnd, why)
            outcomes.append(outcome)
    return state, outcomes

"""Cross-node majority vote over one evaluation round, and degraded mode.

A round is (run_id, eval_id, dataset, stage, attempt). `replicas` nodes evaluate each
sample; `shard_nodes` nodes share the round (a sharded round: each node evaluates some of
its samples, named by `sample_ids`; unsharded, shard_nodes = replicas and every node
evaluates samples 0..n-1). Pure: `add_result(state, ...)` and `expire(state, now, cfg)`
return the new state and a `VoteOutcome` (a consensus to emit, alerts).

The vote (CONTRACT.md, "Evaluation you can trust"), when every ok result has verdicts:
- per sample, over the nodes that evaluated it: a side with a strict majority of the
  sample's `replicas` (at least replicas // 2 + 1 votes, and more than the other side)
  decides it; otherwise (a tie, or too few votes) the sample is undecided: left out of
  `accuracy`, counted in `n_undecided`. A sample may have more votes than replicas (an
  adjudicating third node at 2 replicas): the same rule decides it.
- `dissenters` are the nodes a decided sample's majority outvoted; a node in a tie is never
  named. `node_divergence`: a node's share of its samples where it was outvoted.
- `n_samples` (decided samples), `ci_low`/`ci_high`: the 95 % interval of the accuracy over
  ALL the round's samples, so undecided samples never bias it: each undecided sample counted
  wrong for `ci_low` and right for `ci_high`, each end with its sampling interval
  (areal_metrics.producers.contract.statistics.bounded_interval: Clopper-Pearson on the
  effective size of samples clustered by prompt, `sample_id // samples_per_prompt`, on the
  prompts' degrees of freedom). `accuracy` stays the mean over the decided samples.
- `vote_undecided` (warning) when the undecided share exceeds `vote_undecided_alert`; at two
  replicas it names both disagreeing nodes (two replicas cannot tell which one is wrong).
Without verdicts the value rule: accuracies within `vote_tolerance` agree; the interval is
Wilson on the results' `n_samples` (none given: [0, 1]).

The consensus's `metrics` (CONTRACT.md, "Evaluation details"): `pass@K` for K the samples per
prompt is voted, when verdicts are given: a prompt passes when one of its decided samples is
right, over the prompts with a decided sample. Every other `pass@K`, `maj@K` (which needs the
answers, not only verdicts) and `greedy_accuracy` are the mean of the agreeing nodes' values
weighted by each node's sample count (`consensus_metrics`): over the whole set once every node
of a sharded round answered; a round closed early (every sample decided) weighs the nodes counted.

When the round's consensus is emitted (once):
- early, when every sample seen is decided and enough nodes answered that every sample of
  the round was seen (shard_nodes - replicas + 1 ok results: each sample has `replicas`
  nodes, so at least one of them answered); unsharded, that is a strict majority agreeing;
- or when every node of the round has answered;
- or at `vote_timeout_s` after the first result, `partial: true`, when enough nodes answered
  ok that every sample can have a quorum of its replicas (shard_nodes - replicas + quorum).
A round fails when `failed` results make that impossible, or when the timeout comes
without it: it then re-emits the last good consensus of that run, dataset and stage with
`stale: true`, and raises `eval_failed`. A result for a closed round, or a second result
from the same node, changes nothing.

Nodes that never registered (logging from rank 0 only): `add_result` and `expire` take
`registered`, the number of ranks that announced the run (their `running` event; None when
the run sent none, e.g. results published by kcat, or while that count is too new to trust:
areal_metrics.streams.core.processor.registered). A round then expects at most that many
nodes, and each sample at most that many replicas, so a rank that never logs is not waited
for and never fails a round; at the timeout, a round whose every expected node answered is
not partial.

Because a per-sample majority of replicas is final the moment it exists, the consensus
verdicts (so the accuracy) do not depend on the order results arrive in.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from msgspec.structs import astuple, replace

from areal_metrics.streams.core.alerts import AlertDecision
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.stored import NO_PAIRS, Pairs, Stored, hold_pairs
from areal_metrics.producers.contract.statistics import (bounded_interval, interval_n, majority, quorum,
                                                         side_reading, wilson)

CLOSED_ROUNDS_KEPT = 2048  # per run: remembered to refuse late results without re-voting
CONSENSUS_METRIC = re.compile(r"(pass|maj)@[1-9][0-9]{0,5}|greedy_accuracy")  # an eval's metrics the consensus carries


def consensus_metric(name: str) -> bool:
    return CONSENSUS_METRIC.fullmatch(name) is not None


class NodeResult(Stored):
    node: str
    ok: bool
    accuracy: float | None = None
    response_length: float | None = None
    verdicts: tuple[int, ...] | None = None
    error: str | None = None
    sample_ids: tuple[int, ...] | None = None  # the verdicts' samples (None: 0..len-1)
    n_samples: int | None = None  # as the node reported it (the value rule's interval)
    samples_per_prompt: int = 1  # consecutive sample ids of one prompt (clustered in the interval)
    metrics: Pairs[str, float] = NO_PAIRS  # pass@K, maj@K, greedy_accuracy (consensus_metric)

    def __post_init__(self) -> None:
        hold_pairs(self, "metrics")

    def samples(self) -> Iterable[int]:
        return self.sample_ids if self.sample_ids is not None else range(len(self.verdicts or ()))


class RoundKey(Stored):
    run_id: str
    eval_id: str
    dataset: str
    stage: str
    attempt: int = 0  # a resumed attempt votes its rounds afresh, even under an earlier eval_id

    @property
    def dataset_stage(self) -> tuple[str, str]:
        """The key of the last good result a failed round repeats."""
        return (self.dataset, self.stage)


class RoundState(Stored):
    key: RoundKey
    step: int
    replicas: int  # nodes per sample
    opened_at: float  # worker clock at the first result; the timeout counts from here
    results: tuple[NodeResult, ...] = ()
    shard_nodes: int = 0  # nodes sharing the round (the most any result said); 0: replicas


class Consensus(Stored):
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
    n_samples: int = 0  # decided samples behind `accuracy`
    n_undecided: int = 0
    ci_low: float = 0.0  # 95 % interval of `accuracy`
    ci_high: float = 1.0
    n_effective: float = 0.0  # the interval's effective sample size (clustered samples count less)
    metrics: Pairs[str, float] = NO_PAIRS  # pass@K, maj@K, greedy_accuracy
    # With undecided samples: the effective size over every sample, each undecided one counted wrong
    # (right), what each end of the interval stands on and the closed loop reads (statistics.side_reading);
    # None when none is undecided, without verdicts, or in a state stored before
    n_effective_wrong: float | None = None
    n_effective_right: float | None = None

    def __post_init__(self) -> None:
        hold_pairs(self, "metrics")


class VoteState(Stored):
    """Keys are structured (RoundKey, (dataset, stage)): never a joined string to split again."""

    open_rounds: Pairs[RoundKey, RoundState] = NO_PAIRS
    closed: tuple[RoundKey, ...] = ()  # rounds already decided, oldest first
    last_good: Pairs[tuple[str, str], Consensus] = NO_PAIRS  # (dataset, stage) ->

    def __post_init__(self) -> None:
        hold_pairs(self, "open_rounds", "last_good")


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
    divergence: Mapping[str, float]  # node -> share of its samples outvoted, or distance of its value
    decisive: bool  # final before every node answered (see the module docstring)
    has_majority: bool  # some majority exists (of replicas, or of the answers when final)
    n_samples: int = 0
    n_undecided: int = 0
    n_effective: float = 0.0
    verdicts: Mapping[int, int] | None = None  # sample id -> the decided verdict
    metrics: Mapping[str, float] = field(default_factory=dict)
    clusters: Mapping[int, tuple[int, ...]] | None = None  # prompt -> its decided verdicts
    undecided: Mapping[int, int] = field(default_factory=dict)  # prompt -> its undecided samples
    disputed_by: tuple[str, ...] = ()  # nodes on both sides of an undecided sample (a tie)

    def sides(self) -> dict[str, float]:
        """The effective sizes of the interval's two ends (Consensus.n_effective_wrong, _right) when some
        sample is undecided; {} otherwise."""
        if self.clusters is None or self.n_undecided <= 0:
            return {}
        return {"n_effective_wrong": side_reading(self.clusters, self.undecided, 0)[1],
                "n_effective_right": side_reading(self.clusters, self.undecided, 1)[1]}

    @property
    def interval(self) -> tuple[float, float]:
        """The 95 % interval of the accuracy over every sample of the round: undecided samples counted
        wrong for the low end, right for the high end (statistics.bounded_interval); the value rule:
        Wilson on the results' sample count."""
        if self.clusters is None:
            return wilson(self.accuracy, self.n_effective)
        return bounded_interval(self.clusters, self.undecided)


@dataclass(frozen=True, slots=True)
class Shape:
    """How many nodes a round expects, and how many of them evaluate each sample."""

    nodes: int
    replicas: int

    @property
    def to_see_all(self) -> int:
        """ok results after which every sample has been seen by some node."""
        return self.nodes - self.replicas + 1

    @property
    def to_close(self) -> int:
        """ok results after which every sample can have a quorum of its replicas."""
        return self.nodes - self.replicas + quorum(self.replicas)


def shape(rnd: RoundState, registered: int | None) -> Shape:
    nodes = max(rnd.shard_nodes, rnd.replicas)
    answered = len({r.node for r in rnd.results})
    if registered:  # ranks that never registered are not waited for
        nodes = max(min(nodes, registered), answered, 1)
    return Shape(nodes, max(1, min(rnd.replicas, nodes)))


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _verdict_mode(results: list[NodeResult]) -> bool:
    return all(r.verdicts is not None for r in results) and any(r.verdicts for r in results)


def combine(results: Iterable[NodeResult], replicas: int, cfg: RunConfig, nodes: int | None = None) -> Combination:
    """Vote over ok results. Order-invariant: results are sorted by node first.

    `replicas`: nodes per sample; `nodes`: nodes sharing the round (None: replicas)."""
    ok = sorted((r for r in results if r.ok), key=lambda r: r.node)
    if not ok:
        raise ValueError("combine needs at least one ok result")
    if _verdict_mode(ok):
        return _combine_verdicts(ok, Shape(max(nodes or replicas, replicas), replicas))
    return _combine_values(ok, quorum(replicas), cfg)


def _combine_verdicts(ok: list[NodeResult], shape: Shape) -> Combination:
    votes: dict[int, list[tuple[str, int]]] = {}
    for r in ok:
        for sample, v in zip(r.samples(), r.verdicts or ()):
            votes.setdefault(sample, []).append((r.node, v))
    decided: dict[int, int] = {}
    undecided: list[int] = []
    disputed_by: set[str] = set()
    on_side = 0
    for sample, cast in votes.items():
        ones = sum(v for _, v in cast)
        zeros = len(cast) - ones
        side = majority(ones, zeros, shape.replicas)
        if side is not None:
            decided[sample] = side
            on_side += max(ones, zeros)
        else:
            undecided.append(sample)
            if ones and zeros:
                disputed_by.update(node for node, _ in cast)
    outvoted = {r.node: 0 for r in ok}
    for sample, agreed in decided.items():
        for node, v in votes[sample]:
            outvoted[node] += v != agreed
    cast_total = sum(len(c) for c in votes.values())
    k = max(r.samples_per_prompt for r in ok)
    clusters: dict[int, list[int]] = {}
    for sample, v in decided.items():
        clusters.setdefault(sample // k, []).append(v)
    open_by_prompt: dict[int, int] = {}
    for sample in undecided:
        open_by_prompt[sample // k] = open_by_prompt.get(sample // k, 0) + 1
    honest = [r for r in ok if outvoted[r.node] == 0] or ok
    metrics = consensus_metrics(honest, decided, k)
    sized = [(r.response_length, len(r.verdicts or ())) for r in honest if r.response_length is not None]
    weight = sum(w for _, w in sized)
    return Combination(
        accuracy=sum(decided.values()) / len(decided) if decided else 0.0,
        response_length=sum(x * w for x, w in sized) / weight if weight else _median(x for x, _ in sized),
        agreement=on_side / cast_total if cast_total else 1.0,
        dissenters=tuple(node for node, n in outvoted.items() if n > 0),
        divergence={r.node: outvoted[r.node] / max(len(r.verdicts or ()), 1) for r in ok},
        decisive=len(decided) == len(votes) and len(ok) >= shape.to_see_all,
        has_majority=True,
        n_samples=len(decided),
        n_undecided=len(votes) - len(decided),
        n_effective=interval_n(clusters),
        verdicts=decided,
        metrics=metrics,
        clusters={prompt: tuple(vs) for prompt, vs in clusters.items()},
        undecided=open_by_prompt,
        disputed_by=tuple(sorted(disputed_by)),
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
    counts = [by_node[n].n_samples for n in sorted(members) if by_node[n].n_samples]
    n = int(statistics.median(counts)) if counts else 0
    return Combination(
        accuracy=accuracy,
        response_length=_median(by_node[n].response_length for n in sorted(members)),
        agreement=agreement,
        dissenters=dissenters,
        divergence={n: abs(v - accuracy) for v, n in values},
        decisive=decisive,
        has_majority=has_majority,
        n_samples=n,
        n_effective=float(n),
        metrics=consensus_metrics([by_node[n] for n in sorted(members)]),
    )


def consensus_metrics(members: list[NodeResult], decided: Mapping[int, int] | None = None,
                      k: int = 1) -> dict[str, float]:
    """The round's pass@K, maj@K and greedy_accuracy from the nodes on the majority side.

    `decided` (sample id -> voted verdict) and `k` (samples per prompt): pass@k is voted per
    prompt; any other metric is the members' mean weighted by their sample counts."""
    names = sorted({name for r in members for name in r.metrics if consensus_metric(name)})
    out: dict[str, float] = {}
    for name in names:
        if decided and name == f"pass@{k}":
            prompts: dict[int, int] = {}
            for sample, v in decided.items():
                prompts[sample // k] = prompts.get(sample // k, 0) | v
            out[name] = sum(prompts.values()) / len(prompts)
            continue
        weighted = [(r.metrics[name], max(len(r.verdicts or ()), r.n_samples or 0, 1))
                    for r in members if name in r.metrics]
        total = sum(w for _, w in weighted)
        out[name] = sum(v * w for v, w in weighted) / total
    return out


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
    verdicts = comb.verdicts is not None
    unit = "of its samples outvoted" if verdicts else "accuracy distance"
    for node, off in sorted(comb.divergence.items()):
        if off > cfg.divergence_threshold and (not verdicts or node in comb.dissenters):
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


def _undecided_alerts(rnd: RoundState, comb: Combination, cfg: RunConfig, replicas: int) -> list[AlertDecision]:
    """`vote_undecided` when the round's share of undecided samples exceeds `vote_undecided_alert`."""
    total = comb.n_samples + comb.n_undecided
    share = comb.n_undecided / total if total else 0.0
    if not comb.n_undecided or share <= cfg.vote_undecided_alert:
        return []
    where = f"eval {rnd.key.eval_id} ({rnd.key.dataset}/{rnd.key.stage}) at step {rnd.step}"
    nodes = comb.disputed_by
    if replicas == 2 and len(nodes) == 2:
        who = (f"nodes {nodes[0]} and {nodes[1]} disagree on {comb.n_undecided} of {total} samples; two "
               f"replicas cannot tell which one is wrong: add a third replica (eval_redundancy 3) or an "
               f"adjudicating rank (3+ ranks at 2 replicas)")
    elif nodes:
        who = (f"nodes {', '.join(nodes)} split evenly on some of them; a third replica or an adjudicating "
               f"rank decides such samples")
    else:
        who = "too few of their replicas answered"
    return [AlertDecision(
        kind="vote_undecided",
        severity="warning",
        message=(f"{where}: {comb.n_undecided} of {total} samples undecided ({share:.1%} > "
                 f"{cfg.vote_undecided_alert:g}); accuracy {comb.accuracy:.4g} is over the decided ones, the "
                 f"interval counts the undecided both ways; {who}"),
        about=round_about("vote_undecided", rnd.key),
        step=rnd.step,
        value=share,
        threshold=cfg.vote_undecided_alert,
    )]


def _decide(rnd: RoundState, comb: Combination, partial: bool, cfg: RunConfig,
            replicas: int) -> tuple[Consensus, list[AlertDecision]]:
    low, high = comb.interval
    consensus = Consensus(
        key=rnd.key,
        step=rnd.step,
        accuracy=comb.accuracy,
        response_length=comb.response_length,
        votes=sum(r.ok for r in rnd.results),
        replicas=replicas,
        agreement=comb.agreement,
        dissenters=comb.dissenters,
        partial=partial,
        n_samples=comb.n_samples,
        n_undecided=comb.n_undecided,
        ci_low=min(low, comb.accuracy),
        ci_high=max(high, comb.accuracy),
        n_effective=comb.n_effective,
        metrics=comb.metrics,
        **comb.sides(),
    )
    alerts = _divergence_alerts(rnd, comb, cfg)
    alerts += _undecided_alerts(rnd, comb, cfg, replicas)
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
        stale = replace(previous, key=rnd.key, step=rnd.step, replicas=rnd.replicas, stale=True, partial=False)
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


def _failures(rnd: RoundState, nodes: int) -> str:
    failed = [r for r in rnd.results if not r.ok]
    detail = "; ".join(f"{r.node}: {r.error or 'failed'}" for r in failed)
    return f"{len(failed)} of {nodes} nodes failed ({detail})"


def add_result(
    state: VoteState,
    key: RoundKey,
    step: int,
    replicas: int,
    result: NodeResult,
    now: float,
    cfg: RunConfig,
    shard_nodes: int | None = None,
    registered: int | None = None,
) -> tuple[VoteState, VoteOutcome]:
    """One node's result. `shard_nodes`: nodes sharing the round (None: `replicas`);
    `registered`: ranks that announced the run (None: unknown; see the module docstring)."""
    if key in state.closed:
        return state, VoteOutcome()
    rnd = state.open_rounds.get(key) or RoundState(key=key, step=step, replicas=replicas, opened_at=now)
    if any(r.node == result.node for r in rnd.results):
        return state, VoteOutcome()
    rnd = replace(rnd, results=(*rnd.results, result), shard_nodes=max(rnd.shard_nodes, shard_nodes or 0))
    return _settle(state, rnd, cfg, registered)


def _settle(state: VoteState, rnd: RoundState, cfg: RunConfig,
            registered: int | None) -> tuple[VoteState, VoteOutcome]:
    key = rnd.key
    sh = shape(rnd, registered)
    answered = len(rnd.results)
    ok = [r for r in rnd.results if r.ok]
    if len(ok) + max(0, sh.nodes - answered) < sh.to_close:
        return _fail(state, rnd, _failures(rnd, sh.nodes))
    if ok:
        comb = combine(ok, sh.replicas, cfg, sh.nodes)
        if comb.decisive or answered >= sh.nodes:
            consensus, alerts = _decide(rnd, comb, partial=False, cfg=cfg, replicas=sh.replicas)
            return _close(state, key, consensus), VoteOutcome(consensus, tuple(alerts))
    return VoteState({**state.open_rounds, key: rnd}, state.closed, state.last_good), VoteOutcome()


def answered_all(rnd: RoundState, registered: int | None) -> bool:
    """Cheap: has every node the round expects at `registered` ranks answered? (None: unknown.)"""
    return registered is not None and len({r.node for r in rnd.results}) >= shape(rnd, registered).nodes


def recheck(state: VoteState, cfg: RunConfig, registered: int | None) -> tuple[VoteState, list[VoteOutcome]]:
    """Settle again the open rounds that every expected node has answered, now that the count of
    registered ranks is trusted (a round that opened while it was too new to trust, e.g. at a
    run's first evaluation, closes at the next tick instead of at vote_timeout_s)."""
    outcomes: list[VoteOutcome] = []
    if registered is None:
        return state, outcomes
    for key, rnd in sorted(state.open_rounds.items(), key=lambda kv: (kv[1].opened_at, astuple(kv[0]))):
        if answered_all(rnd, registered):
            state, outcome = _settle(state, rnd, cfg, registered)
            if outcome.consensus is not None or outcome.alerts:
                outcomes.append(outcome)
    return state, outcomes


def expire(state: VoteState, now: float, cfg: RunConfig,
           registered: int | None = None) -> tuple[VoteState, list[VoteOutcome]]:
    """Close the rounds open longer than vote_timeout_s: partial consensus, or failed."""
    outcomes: list[VoteOutcome] = []
    for key, rnd in sorted(state.open_rounds.items(), key=lambda kv: (kv[1].opened_at, astuple(kv[0]))):
        sh = shape(rnd, registered)
        ok = [r for r in rnd.results if r.ok]
        if now - rnd.opened_at < cfg.vote_timeout_s:
            continue
        if len(ok) >= sh.to_close:
            partial = len(rnd.results) < sh.nodes  # every node the round expects answered: not partial
            consensus, alerts = _decide(rnd, combine(ok, sh.replicas, cfg, sh.nodes), partial=partial, cfg=cfg,
                                        replicas=sh.replicas)
            state = _close(state, key, consensus)
            outcomes.append(VoteOutcome(consensus, tuple(alerts)))
        else:
            why = (f"no quorum within {cfg.vote_timeout_s:g} s ({len(ok)} of {sh.nodes} nodes answered ok, "
                   f"{sh.to_close} needed)")
            state, outcome = _fail(state, rnd, why)
            outcomes.append(outcome)
    return state, outcomes

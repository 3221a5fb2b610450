"""Two groups of runs compared on one dataset: what `areal-metrics compare` prints.

The question is the strategy's: does group B's way of training do better than group A's? The
runs (seeds) are the replicates. Each group's runs (by `run.group`) enter with their
full-stage consensus on the dataset at one common step: the last step at which every run of
both groups has a (non-stale) consensus, or the `--step` the user gives (never "whatever each
run's last round was": two groups identical at equal steps but of different lengths do not
differ). Per group: the mean over its runs and its 95 % t-interval. The headline,
`difference`: mean(B) - mean(A) with Welch's 95 % interval and two-sided p-value over runs
(statistics.welch; unequal variances; None with fewer than 2 runs in a group).

Then `paired`, a test of these particular models (the runs compared, not the strategies),
with the prompt as its unit: each run's per-sample verdicts come from its nodes' stored
`verdicts` (table `evals`, the round of that consensus), voted per sample as the worker
votes (statistics.majority at the consensus's replicas, ties undecided); a run's score of a
prompt is the mean of its decided samples of it (`samples_per_prompt` consecutive samples a prompt); a group's score
the mean over its runs that decided it; the exact sign test runs over the prompts both
groups decided, on the differences of those scores (with one run per group and one sample
a prompt: McNemar's exact test). Samples are matched by their index in the
dataset's shared order (`sample_ids`, else the older `metrics` window, else
0..n-1), and only when both groups evaluated the same set (one
`dataset_fingerprint`). `accuracy` is the first attempt's; for multi-turn
strategies each group also gets `metrics`: `first_attempt_accuracy` and
`solved_within_<T>_turns` (the nodes' values of the same rounds, weighted by
their samples) with their t-intervals over runs: what the extra turns buy.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from areal_metrics.producers.contract import statistics as stats
from areal_metrics.producers.contract.errors import UserError

TEST_NAME = "exact sign test on per-prompt accuracy differences"
SCOPE = "these models (the runs compared), not the strategies: see difference"


def literal(text: str) -> str:
    """A ClickHouse string literal for any text."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


@dataclass
class RunRound:
    run_id: str
    accuracy: float
    eval_id: str
    step: int
    verdicts: dict[int, int] = field(default_factory=dict)  # sample -> the nodes' majority
    fingerprints: set[str] = field(default_factory=set)
    turn_metrics: dict[str, float] = field(default_factory=dict)  # first_attempt_accuracy, solved_within_<T>_turns
    per_prompt: int = 1  # samples a prompt (the evaluators' `samples_per_prompt`)


@dataclass(frozen=True)
class GroupSummary:
    group: str
    runs: int
    mean: float
    ci_low: float | None
    ci_high: float | None
    run_ids: tuple[str, ...]
    metrics: dict[str, dict[str, float | int | None]] = field(default_factory=dict)


# ------------------------------------------------------------------ reading


def window_ids(length: int, offset: int | None = None, total: int | None = None) -> list[int]:
    """The sample ids of `length` verdicts: a cyclic window from `offset` of `total` (the layout older
    trainers put in `metrics`), else 0..length-1."""
    if offset is None or total is None or total < 1:
        return list(range(length))
    return [(offset + i) % total for i in range(length)]


def _rows(store: Any, sql: str) -> list[tuple[Any, ...]]:
    return list(store.query(sql).rows)


def group_runs(store: Any, groups: Sequence[str]) -> dict[str, list[str]]:
    names = ", ".join(literal(g) for g in groups)
    out: dict[str, list[str]] = {g: [] for g in groups}
    for run, group in _rows(store, f"SELECT run_id, `group` FROM v_runs WHERE `group` IN ({names}) ORDER BY run_id"):
        out[group].append(run)
    return out


def full_datasets(store: Any, runs: Sequence[str], stage: str) -> set[str]:
    return {d for (d,) in _rows(store, f"""SELECT DISTINCT dataset FROM v_eval_consensus
        WHERE run_id IN ({', '.join(map(literal, runs))}) AND stage = {literal(stage)} AND NOT stale""")}


def rounds_at(store: Any, runs: Sequence[str], dataset: str, stage: str,
              step: int | None) -> tuple[int, dict[str, RunRound]]:
    """(the step compared, run -> its consensus there (the latest at that step) on the dataset and
    stage). The step: `step`, else the last step every run has a non-stale consensus at; UserError
    when a run has none there (naming it) or no step is common to all."""
    evaluated: dict[str, dict[int, tuple[float, str]]] = {r: {} for r in runs}
    for run, step_, acc, eval_id in _rows(store, f"""
            SELECT run_id, step, argMax(accuracy, ts), argMax(eval_id, ts)
            FROM v_eval_consensus
            WHERE run_id IN ({', '.join(map(literal, runs))}) AND dataset = {literal(dataset)}
              AND stage = {literal(stage)} AND NOT stale
            GROUP BY run_id, step"""):
        evaluated[run][int(step_)] = (float(acc), eval_id)
    if step is None:
        common = set.intersection(*(set(steps) for steps in evaluated.values())) if evaluated else set()
        if not common:
            raise UserError(f"--step: no step at which every run of both groups has a {stage}-stage consensus on "
                            f"{dataset!r}; give one with --step, or compare groups evaluated at the same steps")
        step = max(common)
    missing = sorted(r for r, steps in evaluated.items() if step not in steps)
    if missing:
        raise UserError(f"--step {step}: no {stage}-stage consensus on {dataset!r} at that step for "
                        f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return step, {r: RunRound(r, steps[step][0], steps[step][1], step) for r, steps in evaluated.items()}


def _has_sample_ids(store: Any) -> bool:
    return bool(_rows(store, "SELECT count() FROM system.columns WHERE database = currentDatabase() "
                             "AND table = 'evals' AND name = 'sample_ids'")[0][0])


def node_verdicts(store: Any, rounds: Sequence[tuple[str, str]]) -> dict[tuple[str, str], dict[str, dict[int, int]]]:
    """(run, eval_id) -> node -> sample -> verdict: the nodes' stored verdicts of those rounds (their
    latest attempt), each verdict at its sample's index in the shared order."""
    if not rounds:
        return {}
    ids = "sample_ids" if _has_sample_ids(store) else "CAST([], 'Array(UInt32)')"
    keys = ", ".join(f"({literal(run)}, {literal(eval_id)})" for run, eval_id in rounds)
    rows = _rows(store, f"""
        SELECT run_id, eval_id, node, attempt, verdicts, {ids}, metrics['shard_offset'], metrics['shard_total'],
               mapContains(metrics, 'shard_total'), dataset_fingerprint
        FROM v_evals
        WHERE (run_id, eval_id) IN ({keys}) AND status = 'ok' AND length(verdicts) > 0""")
    latest: dict[tuple[str, str], int] = {}
    for run, eval_id, _node, attempt, *_ in rows:
        latest[(run, eval_id)] = max(latest.get((run, eval_id), 0), int(attempt))
    out: dict[tuple[str, str], dict[str, dict[int, int]]] = defaultdict(dict)
    for run, eval_id, node, attempt, verdicts, sample_ids, offset, total, has_window, _fp in rows:
        if int(attempt) != latest[(run, eval_id)]:
            continue
        if sample_ids and len(sample_ids) == len(verdicts):
            where = [int(s) for s in sample_ids]
        elif has_window:
            where = window_ids(len(verdicts), int(offset), int(total))
        else:
            where = window_ids(len(verdicts))
        out[(run, eval_id)][node] = dict(zip(where, (int(v) for v in verdicts)))
    return out


def fingerprints(store: Any, rounds: Sequence[tuple[str, str]]) -> dict[tuple[str, str], set[str]]:
    if not rounds:
        return {}
    keys = ", ".join(f"({literal(run)}, {literal(eval_id)})" for run, eval_id in rounds)
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for run, eval_id, fp in _rows(store, f"""SELECT DISTINCT run_id, eval_id, dataset_fingerprint FROM v_evals
            WHERE (run_id, eval_id) IN ({keys}) AND status = 'ok' AND dataset_fingerprint IS NOT NULL"""):
        out[(run, eval_id)].add(fp)
    return out


TURN_METRICS = "(key = 'first_attempt_accuracy' OR match(key, '^solved_within_[0-9]+_turns$'))"


def attach_turn_metrics(store: Any, rounds: Mapping[str, RunRound]) -> None:
    """Each round's first-attempt accuracy and 'solved within T turns': its nodes' values weighted by
    their samples (every sample counts once per replica, the same for every sample)."""
    if not rounds:
        return
    keys = ", ".join(f"({literal(r.run_id)}, {literal(r.eval_id)})" for r in rounds.values())
    for run, key, value in _rows(store, f"""
            SELECT run_id, key, sum(metrics[key] * ifNull(n_samples, 1)) / sum(ifNull(n_samples, 1))
            FROM v_evals ARRAY JOIN mapKeys(metrics) AS key
            WHERE (run_id, eval_id) IN ({keys}) AND status = 'ok' AND {TURN_METRICS}
            GROUP BY run_id, key"""):
        rounds[run].turn_metrics[key] = float(value)


def samples_per_prompt(store: Any, rounds: Sequence[tuple[str, str]]) -> dict[tuple[str, str], int]:
    if not rounds:
        return {}
    keys = ", ".join(f"({literal(run)}, {literal(eval_id)})" for run, eval_id in rounds)
    return {(run, eval_id): max(1, int(k)) for run, eval_id, k in _rows(store, f"""
            SELECT run_id, eval_id, max(metrics['samples_per_prompt']) FROM v_evals
            WHERE (run_id, eval_id) IN ({keys}) AND status = 'ok' AND mapContains(metrics, 'samples_per_prompt')
            GROUP BY run_id, eval_id""")}


def consensus_replicas(store: Any, rounds: Sequence[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """(run, eval_id) -> the replicas the worker's vote used for that round (its consensus's `replicas`)."""
    if not rounds:
        return {}
    keys = ", ".join(f"({literal(run)}, {literal(eval_id)})" for run, eval_id in rounds)
    return {(run, eval_id): int(replicas) for run, eval_id, replicas in _rows(store, f"""
        SELECT run_id, eval_id, argMax(replicas, ts) FROM v_eval_consensus
        WHERE (run_id, eval_id) IN ({keys}) AND NOT stale GROUP BY run_id, eval_id""")}


def attach_verdicts(store: Any, rounds: Mapping[str, RunRound]) -> None:
    """Fill each round's per-sample verdicts, fingerprints and samples a prompt from `evals`: the
    worker's majority rule (statistics.majority) at the replicas its consensus used, so compare
    decides what the worker decided."""
    keys = [(r.run_id, r.eval_id) for r in rounds.values()]
    voted = node_verdicts(store, keys)
    prints = fingerprints(store, keys)
    per_prompt = samples_per_prompt(store, keys)
    replicas = consensus_replicas(store, keys)
    for r in rounds.values():
        r.verdicts = stats.node_majority(voted.get((r.run_id, r.eval_id), {}).values(),
                                         replicas.get((r.run_id, r.eval_id)))
        r.fingerprints = prints.get((r.run_id, r.eval_id), set())
        r.per_prompt = per_prompt.get((r.run_id, r.eval_id), 1)


# ------------------------------------------------------------------ the rule


def summarize(group: str, rounds: Sequence[RunRound]) -> GroupSummary:
    interval = stats.t_interval([r.accuracy for r in rounds])
    low, high = _clip(interval)
    metrics: dict[str, dict[str, float | int | None]] = {}
    for name in sorted({k for r in rounds for k in r.turn_metrics}):
        values = stats.t_interval([r.turn_metrics[name] for r in rounds if name in r.turn_metrics])
        m_low, m_high = _clip(values)
        metrics[name] = {"runs": values.n, "mean": values.mean, "ci_low": m_low, "ci_high": m_high}
    return GroupSummary(group, interval.n, interval.mean, low, high, tuple(r.run_id for r in rounds), metrics)


def _clip(interval: stats.MeanInterval) -> tuple[float | None, float | None]:
    """A share's t-interval clipped to 0..1."""
    low, high = interval.ci_low, interval.ci_high
    return None if low is None else max(low, 0.0), None if high is None else min(high, 1.0)


def prompt_scores(verdicts: Mapping[int, int], k: int) -> dict[int, float]:
    """prompt -> the mean of its decided samples' verdicts (sample -> 0/1, `k` consecutive samples a prompt):
    the unit of every paired test over prompts (`paired`, the demo's rollback check)."""
    mine: dict[int, list[int]] = defaultdict(list)
    for sample, v in verdicts.items():
        mine[sample // k].append(v)
    return {prompt: sum(vs) / len(vs) for prompt, vs in mine.items()}


def per_prompt_scores(rounds: Sequence[RunRound], k: int) -> dict[int, float]:
    """prompt -> mean over the runs that decided any of its samples of the run's mean verdict on them
    (`k` consecutive samples a prompt)."""
    total: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    for r in rounds:
        for prompt, score in prompt_scores(r.verdicts, k).items():
            total[prompt] += score
            count[prompt] += 1
    return {p: total[p] / count[p] for p in total}


def paired(a: Sequence[RunRound], b: Sequence[RunRound]) -> dict[str, Any]:
    """The paired per-prompt test between two groups' rounds, as the JSON's `paired` object: a test of
    these models (the runs compared), not of the strategies (`difference` is that)."""
    prints = {fp for r in (*a, *b) for fp in r.fingerprints}
    k = max((r.per_prompt for r in (*a, *b)), default=1)
    base: dict[str, Any] = {"test": TEST_NAME, "scope": SCOPE, "unit": "prompt", "samples_per_prompt": k,
                            "n": 0, "p_value": None, "a_better": 0, "b_better": 0}
    if len(prints) > 1:
        return {**base, "note": "the groups evaluated different sample sets (dataset fingerprints differ)"}
    sa, sb = per_prompt_scores(a, k), per_prompt_scores(b, k)
    common = sorted(set(sa) & set(sb))
    if not common:
        return {**base, "note": "no prompt evaluated (and decided) by both groups"}
    result = stats.sign_test(sa[s] - sb[s] for s in common)
    return {**base, "n": result.n, "p_value": result.p_value, "a_better": result.positive,
            "b_better": result.negative}


def difference(a: Sequence[RunRound], b: Sequence[RunRound]) -> dict[str, Any]:
    """The headline: mean(B) - mean(A) over runs, Welch's interval and p-value (the JSON's `difference`)."""
    d = stats.welch([r.accuracy for r in a], [r.accuracy for r in b])
    out: dict[str, Any] = {"estimate": d.estimate, "ci_low": d.ci_low, "ci_high": d.ci_high, "p_value": d.p_value,
                           "method": d.method}
    if d.p_value is None:
        out["note"] = ("needs 2 or more runs (seeds) in each group" if min(len(a), len(b)) < 2
                       else "no spread between the runs: no interval")
    return out


def compare(store: Any, group_a: str, group_b: str, dataset: str | None, stage: str,
            step: int | None = None) -> dict[str, Any]:
    """The contract's JSON object; UserError names what is missing. Without `dataset`, groups that
    share several datasets get {"results": [one object per dataset]}."""
    if group_a == group_b:
        raise UserError(f"GROUP_B: the same group as GROUP_A ({group_a!r})")
    members = group_runs(store, [group_a, group_b])
    for label, g in (("GROUP_A", group_a), ("GROUP_B", group_b)):
        if not members[g]:
            raise UserError(f"{label} {g!r}: no runs in this group (the `group` of areal_metrics.init)")
    if dataset is None:
        both = full_datasets(store, members[group_a], stage) & full_datasets(store, members[group_b], stage)
        if not both:
            raise UserError(f"--dataset: the groups share no {stage}-stage results on any dataset")
        if len(both) > 1:
            return {"results": [compare_on(store, members, group_a, group_b, d, stage, step) for d in sorted(both)]}
        dataset = both.pop()
    return compare_on(store, members, group_a, group_b, dataset, stage, step)


def compare_on(store: Any, members: Mapping[str, Sequence[str]], group_a: str, group_b: str, dataset: str,
               stage: str, step: int | None) -> dict[str, Any]:
    evaluated = {r for (r,) in _rows(store, f"""SELECT DISTINCT run_id FROM v_eval_consensus
        WHERE run_id IN ({', '.join(map(literal, [*members[group_a], *members[group_b]]))})
          AND dataset = {literal(dataset)} AND stage = {literal(stage)} AND NOT stale""")}
    runs = []
    for label, g in (("GROUP_A", group_a), ("GROUP_B", group_b)):
        mine = [r for r in members[g] if r in evaluated]  # a run without a result there is not in the comparison
        if not mine:
            raise UserError(f"{label} {g!r}: no {stage}-stage consensus on dataset {dataset!r}")
        runs.append(mine)
    at, rounds = rounds_at(store, runs[0] + runs[1], dataset, stage, step)
    attach_verdicts(store, rounds)
    attach_turn_metrics(store, rounds)
    a = [rounds[r] for r in runs[0]]
    b = [rounds[r] for r in runs[1]]
    groups = [summarize(group_a, a), summarize(group_b, b)]
    return {"dataset": dataset, "stage": stage, "step": at,
            "groups": [{"group": g.group, "runs": g.runs, "mean": g.mean, "ci_low": g.ci_low, "ci_high": g.ci_high,
                        "run_ids": list(g.run_ids), "metrics": g.metrics} for g in groups],
            "difference": difference(a, b),
            "paired": paired(a, b)}


def render(result: Mapping[str, Any]) -> str:
    """The human form: per dataset, one line per group, the difference, the paired test."""
    if "results" in result:
        return "".join(render(r) for r in result["results"])

    def num(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    lines = [f"{result['dataset']} ({result['stage']} stage), each run's consensus at step {result['step']} "
             "(the last step every run evaluated, or --step)"]
    for g in result["groups"]:
        lines.append(f"  {g['group']}: mean {num(g['mean'])} over {g['runs']} run{'s' * (g['runs'] != 1)}, "
                     f"95% t-interval [{num(g['ci_low'])}, {num(g['ci_high'])}]")
        for name, m in g.get("metrics", {}).items():
            lines.append(f"    {name}: {num(m['mean'])} [{num(m['ci_low'])}, {num(m['ci_high'])}]")
    a, b = result["groups"][0]["group"], result["groups"][1]["group"]
    d = result["difference"]
    note = f" ({d['note']})" if "note" in d else ""
    lines.append(f"  difference {b} - {a}: {d['estimate']:+.3f}, "
                 f"95% interval [{num(d['ci_low'])}, {num(d['ci_high'])}], "
                 f"{stats.format_p(d['p_value'])} ({d['method']}){note}")
    p = result["paired"]
    tail = f" ({p['note']})" if "note" in p else ""
    lines.append(f"  paired, a test of {p['scope']} ({p['test']}): n {p['n']} prompts, {a} better on "
                 f"{p['a_better']}, {b} better on {p['b_better']}, {stats.format_p(p['p_value'])}{tail}")
    return "\n".join(lines) + "\n"

"""What `demo` prints at the end: tables from SQL over ClickHouse, and the checks the demo stands for.

Checks (each printed as passed or NOT passed, never hidden); each can fail:
- every `scale_lr` acted on evidence: its reason cites a CUSUM of the rounds'
  shortfall past its limit (a cut), an interval whose lower bound lies at or
  above the threshold (a raise), or a slope test that says improvement stopped;
  and the regression run (`-lr-high`, whose lr is too high on purpose) got at
  least one: 0 of 0 is not a pass;
- every full-stage consensus equals the per-sample strict-majority vote of the
  nodes' stored verdicts (ties undecided); in a run with a faulty evaluator
  (`dissent_rank`) it equals the honest replicas' accuracy over the decided
  samples and names no node but the faulty one;
- the regression run's rollback brought accuracy back: per dataset, its first full round
  after the restore is not significantly below the round whose weights were restored (the
  same prompts every round, so paired over the prompts both rounds decided: an exact sign
  test, two-sided 5 %); no rollback at all, or no round after it, is not a pass. The reference
  trainer evaluates restored weights at once, so that round is of the weights the rollback
  brought back, before any update at the cut rate (a drift at that rate is the next check's);
- the regression run stays above its loop's threshold after the rollback: no full round of
  the watched dataset since is shown below it (its 95 % interval's upper end below the
  threshold; an outcome of the rollback and the lower rate, not the threshold rule, which cuts
  on its CUSUM; a later cut that restores weights starts the check again). How far its last round lies from its first after the
  restore is printed with it, paired the same way, as a measurement and not a check: at the
  cut rate RL on every weight does not learn in the demo's budget (docs/WORKLOAD.md), so that
  difference is one seed of a drifting policy (p = 0.327 on one machine, 0.003 on another,
  the same code), which neither the rollback nor the threshold rule is there to prevent;
- per dataset, every compared run evaluated the same set (one dataset fingerprint).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from areal_metrics.producers.contract import statistics as stats
from areal_metrics.areal_train.learning import ols_slope_t
from areal_metrics.analysis.comparison import node_verdicts

REGRESSION_SUFFIX = "-lr-high"  # the demo's regression run (areal_metrics.commands.demo.run_configs)
NUMBER = r"([-+]?\d*\.?\d+(?:e[-+]?\d+)?)"
CUT = re.compile(rf"CUSUM of the rounds' shortfall {NUMBER} (>|<=) limit {NUMBER}")
SLOPE = re.compile(rf"improvement stopped: accuracy slope .*?upper bound {NUMBER} .*?\) (<|>=) {NUMBER} per round")
RESTORE = re.compile(rf"CI \[{NUMBER}, {NUMBER}\].*?the interval lies at or above threshold {NUMBER}")

TRAINING_SQL = """
SELECT s.run_id AS run, uniqExact(s.step) AS steps, max(s.attempt) AS attempt,
       round(avgIf(s.reward, s.step <= 10), 3) AS reward_first_10,
       round(avgIf(s.reward, s.step > max_step - 10), 3) AS reward_last_10,
       round(avgIf(s.response_length, s.step <= 10), 1) AS length_first_10,
       round(avgIf(s.response_length, s.step > max_step - 10), 1) AS length_last_10,
       round(avg(s.throughput), 0) AS gen_tokens_per_s_per_rank
FROM v_steps AS s
INNER JOIN (SELECT run_id, max(step) AS max_step FROM v_steps GROUP BY run_id) AS m USING (run_id)
WHERE s.run_id IN {runs:Array(String)}
GROUP BY s.run_id ORDER BY s.run_id
"""

EVAL_SQL = """
SELECT c.run_id AS run, c.dataset AS dataset, count() AS full_rounds,
       round(argMin(c.accuracy, c.step), 3) AS first, round(argMax(c.accuracy, c.step), 3) AS last,
       concat('[', toString(round(argMax(c.ci_low, c.step), 3)), ', ', toString(round(argMax(c.ci_high, c.step), 3)),
              ']') AS last_95ci, argMax(c.n_samples, c.step) AS last_n,
       round(min(c.accuracy), 3) AS min, round(max(c.accuracy), 3) AS max, countIf(c.stale) AS stale,
       round(min(c.agreement), 3) AS min_agreement, any(s.skipped) AS full_skipped,
       toJSONString(mapApply((k, v) -> (k, round(v, 3)), argMax(c.metrics, c.step))) AS last_metrics
FROM v_eval_consensus AS c
LEFT JOIN (SELECT run_id, dataset, uniqExact(step) AS skipped FROM v_evals
           WHERE stage = 'full' AND status = 'skipped' GROUP BY run_id, dataset) AS s
       ON s.run_id = c.run_id AND s.dataset = c.dataset
WHERE c.run_id IN {runs:Array(String)} AND c.stage = 'full'
GROUP BY c.run_id, c.dataset ORDER BY c.run_id, c.dataset
"""

# each run's full-stage consensus per round, for the learning table
LEARNING_SQL = """
SELECT run_id, dataset, groupArray((step, accuracy, ci_low, ci_high)) AS rounds
FROM (SELECT run_id, dataset, step, argMax(accuracy, ts) AS accuracy, argMax(ci_low, ts) AS ci_low,
             argMax(ci_high, ts) AS ci_high
      FROM v_eval_consensus WHERE run_id IN {runs:Array(String)} AND stage = 'full' AND NOT stale
      GROUP BY run_id, dataset, step ORDER BY step)
GROUP BY run_id, dataset ORDER BY run_id, dataset
"""
LEARNING_GOAL = "rise >= max(0.10, 3 SE of the last round) and OLS slope t >= 3 over >= 5 full rounds"


def learning_rows(rows: list[tuple[Any, ...]]) -> list[tuple[str, str, int, str, str, str, str]]:
    """(run, dataset, full rounds, first -> last, rise, OLS slope t, goal met) per run and dataset, from
    LEARNING_SQL's rows; SE from the last round's 95 % interval (its width / 3.92)."""
    out = []
    for run, dataset, rounds in rows:
        rounds = sorted(rounds)
        steps, acc = [float(r[0]) for r in rounds], [float(r[1]) for r in rounds]
        low, high = rounds[-1][2], rounds[-1][3]
        se = (float(high) - float(low)) / 3.92 if low is not None and high is not None else float("nan")
        rise, t = acc[-1] - acc[0], ols_slope_t(steps, acc)
        met = len(rounds) >= 5 and rise >= max(0.10, 3 * se) and t >= 3
        out.append((run, dataset, len(rounds), f"{acc[0]:.3f} -> {acc[-1]:.3f}", f"{rise:+.3f}",
                    f"{t:.2f}" if t == t else "-", "yes" if met else "no"))
    return out


# the generations table: distinct prompts shown per round (the same every round), gold answers, error types
GENERATIONS_SQL = """
SELECT run_id AS run, dataset, count() AS rounds, min(prompts) AS min_prompts_per_round,
       max(prompts) AS max_prompts_per_round, uniqExact(prompt_set) AS prompt_sets, sum(n) AS samples,
       sum(with_gold) AS with_gold, arrayStringConcat(arraySort(groupUniqArrayArray(types)), ' ') AS error_types
FROM (SELECT run_id, dataset, step, uniqExact(prompt) AS prompts, arraySort(groupUniqArray(prompt)) AS prompt_set,
             count() AS n, countIf(gold != '') AS with_gold, groupUniqArrayIf(error_type, error_type != '') AS types
      FROM v_generations WHERE run_id IN {runs:Array(String)} AND stage = 'full'
      GROUP BY run_id, dataset, step)
GROUP BY run_id, dataset ORDER BY run_id, dataset
"""

LOOP_SQL = """
SELECT run_id AS run, what, kind, n FROM (
    SELECT run_id, 'command' AS what, command AS kind, count() AS n
    FROM v_commands WHERE run_id IN {runs:Array(String)} GROUP BY run_id, command
    UNION ALL
    SELECT run_id, 'alert' AS what, kind, count() AS n
    FROM v_alerts WHERE run_id IN {runs:Array(String)} GROUP BY run_id, kind
)
ORDER BY run, what, kind
"""

ROUNDS_SQL = """
SELECT run_id, eval_id, dataset, step, argMax(accuracy, ts), argMax(dissenters, ts), argMax(replicas, ts),
       argMax(ci_low, ts), argMax(ci_high, ts), argMax(n_samples, ts)
FROM v_eval_consensus
WHERE run_id IN {runs:Array(String)} AND stage = 'full' AND NOT stale AND NOT partial
GROUP BY run_id, eval_id, dataset, step ORDER BY run_id, dataset, step
"""

RUN_CONFIG_SQL = """
SELECT run_id, config FROM v_runs WHERE run_id IN {runs:Array(String)}
"""

SCALE_LR_SQL = """
SELECT run_id, args, reason FROM v_commands
WHERE run_id IN {runs:Array(String)} AND command = 'scale_lr' ORDER BY ts
"""

FINGERPRINT_SQL = """
SELECT dataset, groupUniqArray(dataset_fingerprint) AS fingerprints, uniqExact(run_id) AS runs
FROM v_evals WHERE run_id IN {runs:Array(String)} AND stage = 'full' AND dataset_fingerprint IS NOT NULL
GROUP BY dataset ORDER BY dataset
"""


def scale_lr_evidence(reason: str) -> tuple[bool, str]:
    """Whether a `scale_lr` reason cites evidence for its action: (passed, the evidence read)."""
    cut = CUT.search(reason)
    if cut:
        statistic, op, limit = float(cut.group(1)), cut.group(2), float(cut.group(3))
        return statistic > limit and op == ">", f"CUSUM {statistic:g} vs limit {limit:g}"
    slope = SLOPE.search(reason)
    if slope:
        upper, op, delta = float(slope.group(1)), slope.group(2), float(slope.group(3))
        return upper < delta and op == "<", f"slope upper bound {upper:+g} vs {delta:g} per round"
    restore = RESTORE.search(reason)
    if restore:
        low, threshold = float(restore.group(1)), float(restore.group(3))
        return low >= threshold, f"raise: interval from {low:g} vs threshold {threshold:g}"
    return False, "cites no interval or test"


def vote_check(accuracy: float, dissenters: list[str], nodes: dict[str, dict[int, int]],
               faulty: str | None, replicas: int | None = None) -> tuple[bool, str]:
    """A round's consensus against the per-sample vote of its nodes' verdicts (and the honest nodes' accuracy
    when one node is known to be faulty)."""
    decided = stats.node_majority(nodes.values(), replicas)
    if not decided:
        return True, "no sample decided"
    voted = sum(decided.values()) / len(decided)
    problems = []
    if abs(voted - accuracy) > 1e-9:
        problems.append(f"consensus {accuracy:.4f} != vote {voted:.4f}")
    if faulty is not None:
        honest = [v for n, v in nodes.items() if n != faulty]
        right = [next(h[s] for h in honest if s in h) for s in decided if any(s in h for h in honest)]
        honest_acc = sum(right) / len(right) if right else voted
        if abs(honest_acc - accuracy) > 1e-9:
            problems.append(f"consensus {accuracy:.4f} != honest replicas' {honest_acc:.4f}")
        if set(dissenters) - {faulty}:
            problems.append(f"names honest nodes {sorted(set(dissenters) - {faulty})}")
    return not problems, "; ".join(problems) or f"vote {voted:.4f} on {len(decided)} decided samples"


@dataclass(frozen=True)
class Stored:
    """What the checks read of the demo's runs, read once: their configs (run -> parsed JSON object),
    their `scale_lr` commands (run, args, reason) and their full-stage rounds (ROUNDS_SQL's rows)."""

    configs: dict[str, dict[str, Any]]
    scale_lr: list[tuple[str, str, str]]
    rounds: list[tuple[Any, ...]]

    @classmethod
    def read(cls, store: Any, runs: list[str]) -> Stored:
        params = {"runs": runs}
        configs = {}
        for run, config in store.query(RUN_CONFIG_SQL, params).rows:
            try:
                parsed = json.loads(config or "{}")
            except ValueError:
                continue
            if isinstance(parsed, dict):
                configs[run] = parsed
        return cls(configs, [tuple(r) for r in store.query(SCALE_LR_SQL, params).rows],
                   [tuple(r) for r in store.query(ROUNDS_SQL, params).rows])


def _faulty_nodes(stored: Stored) -> dict[str, int]:
    """run -> the rank its config made a faulty evaluator (`dissent_rank`)."""
    out = {}
    for run, config in stored.configs.items():
        rank = config.get("dissent_rank")
        if isinstance(rank, int):
            out[run] = rank
    return out


def vote_checks(store: Any, runs: list[str], stored: Stored | None = None) -> list[tuple[bool, str]]:
    stored = stored or Stored.read(store, runs)
    rounds = stored.rounds
    verdicts = node_verdicts(store, [(r[0], r[1]) for r in rounds])
    faulty = _faulty_nodes(stored)
    out = []
    by_run: dict[str, list[tuple[bool, str]]] = {}
    for run, eval_id, dataset, step, accuracy, dissenters, replicas, *_ in rounds:
        nodes = verdicts.get((run, eval_id), {})
        bad = next((n for n in nodes if run in faulty and n.endswith(f"-r{faulty[run]}")), None)
        passed, what = vote_check(float(accuracy), list(dissenters), nodes, bad, int(replicas))
        by_run.setdefault(run, []).append((passed, f"{dataset} step {step}: {what}"))
    for run, results in by_run.items():
        failed = [w for ok, w in results if not ok]
        label = f" (faulty evaluator: rank {faulty[run]})" if run in faulty else ""
        out.append((not failed, f"{run}{label}: {len(results) - len(failed)} of {len(results)} full-stage consensus "
                    "results equal the per-sample vote of the stored verdicts" + (f"; {failed[0]}" if failed else "")))
    return out


def not_below_check(dataset: str, first: tuple[int, dict[int, int]], last: tuple[int, dict[int, int]],
                    samples_per_prompt: int = 1) -> tuple[bool, str]:
    """(passed, what): the later round (step, sample -> consensus verdict) is not significantly below
    the earlier, paired over the prompts both decided (a prompt's score: the mean of its decided
    samples, `comparison.prompt_scores`, as `compare` pairs them; exact two-sided sign test at 5 %).
    Samples of one prompt are not independent: paired one by one they overstate the evidence."""
    from areal_metrics.analysis.comparison import prompt_scores

    (step0, before), (step1, after) = first, last
    before, after = prompt_scores(before, samples_per_prompt), prompt_scores(after, samples_per_prompt)
    shared = sorted(set(before) & set(after))
    if not shared:
        return False, f"{dataset}: no prompt decided in both step {step0} and step {step1}"
    test = stats.sign_test(after[s] - before[s] for s in shared)
    acc0 = sum(before[s] for s in shared) / len(shared)
    acc1 = sum(after[s] for s in shared) / len(shared)
    fell = test.negative > test.positive and test.p_value < 0.05
    return not fell, (f"{dataset} {acc0:.3f} at step {step0} -> {acc1:.3f} at step {step1} over {len(shared)} "
                      f"prompts ({test.negative} lost, {test.positive} gained, sign test {stats.format_p(test.p_value)})"
                      + ("; significantly below" if fell else ""))


def _loop_of(stored: Stored, run: str) -> tuple[str | None, float | None]:
    """(watched dataset, threshold) of the run's closed loop: its config's `eval_loop`, read as the
    stream worker reads it (`eval_loop_overrides`)."""
    from areal_metrics.streams.core.config import eval_loop_overrides

    loop, _refused = eval_loop_overrides(stored.configs.get(run, {}).get("eval_loop"))
    if "lr_eval_threshold" in loop:
        return loop.get("lr_eval_dataset"), float(loop["lr_eval_threshold"])
    return None, None


def _restores(stored: Stored, run: str) -> list[tuple[int, int]]:
    """(from_step, restore_step) of the run's scale_lr commands that restored weights, in order (a
    command without a `from_step` names no round after which to look, and counts as none)."""
    out = []
    for _run, args, _reason in (c for c in stored.scale_lr if c[0] == run):
        try:
            parsed = json.loads(args or "{}")
        except ValueError:
            continue
        if not isinstance(parsed, dict):
            continue
        since, restored = parsed.get("from_step"), parsed.get("restore_step")
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (since, restored)):
            out.append((int(since), int(restored)))
    return out


Round = tuple[str, float, float | None]  # (eval_id, accuracy, the upper end of its 95 % interval)


def regression_checks(store: Any, runs: list[str], stored: Stored | None = None) -> list[tuple[bool, str]]:
    """Per regression run, from its latest scale_lr that restored weights: the rollback brought
    accuracy back (`not_below_check` of the first round after it against the restored round, per
    dataset), and the run stays above its loop's threshold since (`above_threshold_check`)."""
    from areal_metrics.analysis.comparison import samples_per_prompt
    from areal_metrics.analysis.report import eval_interval

    stored = stored or Stored.read(store, runs)
    out: list[tuple[bool, str]] = []
    for run in (r for r in runs if r.endswith(REGRESSION_SUFFIX)):
        restores = _restores(stored, run)
        if not restores:
            out.append((False, f"{run}: its rollback brought accuracy back: NOT: no scale_lr restored weights "
                                "(with its from_step)"))
            continue
        since, restored = restores[-1]
        rounds: dict[str, dict[int, Round]] = {}  # dataset -> step -> round
        replicas: dict[str, int] = {}  # eval_id -> the consensus's replicas: the vote's quorum, as the worker's
        for _run, eval_id, dataset, step, accuracy, _d, n_replicas, low, high, n in (r for r in stored.rounds if r[0] == run):
            interval = eval_interval(float(accuracy), low, high, None if n is None else int(n))
            rounds.setdefault(dataset, {})[int(step)] = (eval_id, float(accuracy), interval[1])
            replicas[eval_id] = int(n_replicas)
        label = f"{run}: its rollback brought accuracy back (weights of step {restored} restored, lr cut from step {since})"
        # the rounds on the restored weights: at or after from_step, past the restored round (the first, in the
        # reference trainer, of the restored weights themselves; the rest at the cut rate)
        later = {d: sorted(s for s in by_step if s >= since and s > restored) for d, by_step in rounds.items()}
        if not rounds or any(restored not in rounds[d] or not later[d] for d in rounds):
            out.append((False, f"{label}: NOT: no full round of the restored step and one after it for every dataset"))
            continue
        keys = [(run, r[0]) for by_step in rounds.values() for r in by_step.values()]
        verdicts = node_verdicts(store, keys)
        per_prompt = samples_per_prompt(store, keys)

        def verdicts_at(dataset: str, step: int) -> tuple[int, dict[int, int]]:
            eval_id = rounds[dataset][step][0]
            return step, stats.node_majority(verdicts.get((run, eval_id), {}).values(), replicas[eval_id])

        def prompts_of(dataset: str) -> int:
            return max(per_prompt.get((run, r[0]), 1) for r in rounds[dataset].values())

        back = [not_below_check(d, verdicts_at(d, restored), verdicts_at(d, later[d][0]), prompts_of(d))
                for d in sorted(rounds)]
        ok = all(passed for passed, _ in back)
        out.append((ok, f"{label}: " + "; ".join(what for _, what in back) + ("" if ok else "; NOT: below it")))
        drift = "; ".join(not_below_check(d, verdicts_at(d, later[d][0]), verdicts_at(d, later[d][-1]),
                                          prompts_of(d))[1]
                          for d in sorted(rounds) if len(later[d]) > 1)
        dataset, threshold = _loop_of(stored, run)
        after = [(s, *rounds[dataset][s][1:]) for s in later.get(dataset or "", [])]
        out.append(above_threshold_check(run, dataset, threshold, after, drift))
    return out


def above_threshold_check(run: str, dataset: str | None, threshold: float | None,
                          after: list[tuple[int, float, float | None]], drift: str) -> tuple[bool, str]:
    """(passed, what): no round of the watched dataset after the latest rollback, (step, accuracy, the
    upper end of its 95 % interval), is shown below the loop's threshold: an outcome of the rollback
    and the lower rate, not the threshold rule (which cuts on its CUSUM; a cut that restores weights
    again starts this check from there). A round without an interval is not evidence either way.
    `drift` is printed with it, a measurement and not a check."""
    label = f"{run} stays above its loop's threshold after the rollback"
    if not after or dataset is None or threshold is None:
        return False, f"{label}: NOT: no watched dataset, threshold or round after the rollback"
    below = [s for s, _, high in after if high is not None and high < threshold]
    low = min(after, key=lambda r: r[1])
    upper = "no interval" if low[2] is None else f"its 95 % interval's upper end {low[2]:.3f}"
    return (not below, f"{label}: {dataset} {len(after)} full rounds from step {after[0][0]}, the lowest {low[1]:.3f} "
            f"at step {low[0]} ({upper} against the threshold {threshold:g})"
            + (f"; NOT: step {below[0]} shown below it" if below else "")
            + (f"; its drift since the first round after the rollback (a measurement, not a check: RL on every "
               f"weight at the cut rate does not learn in the demo's budget, docs/WORKLOAD.md): {drift}" if drift else ""))


def checks(store: Any, runs: list[str]) -> list[tuple[bool, str]]:
    """(passed, what) of each check the demo stands for."""
    params = {"runs": runs}
    stored = Stored.read(store, runs)
    out: list[tuple[bool, str]] = []
    read = [(run, reason, *scale_lr_evidence(reason)) for run, _args, reason in stored.scale_lr]
    wrong = [r for r in read if not r[2]]
    regression = [r for r in runs if r.endswith(REGRESSION_SUFFIX)]
    unanswered = [r for r in regression if not any(run == r for run, *_ in read)]
    out.append((not wrong and not unanswered and bool(read),
                f"scale_lr on evidence: {len(read) - len(wrong)} of {len(read)} commands cite an interval "
                "or test that supports them"
                + (f" (NOT: {wrong[0][0]}: {wrong[0][3]}: {wrong[0][1][:200]})" if wrong else
                   f" (e.g. {read[0][0]}: {read[0][3]})" if read else "")
                + (f"; NOT: the regression run {unanswered[0]} got no scale_lr" if unanswered else "")
                + ("; NOT: no command at all" if not read else "")))
    out.extend(regression_checks(store, runs, stored))
    out.extend(vote_checks(store, runs, stored))
    for dataset, fingerprints, n in store.query(FINGERPRINT_SQL, params).rows:
        out.append((len(fingerprints) == 1 and n == len(runs),
                    f"{dataset}: {n} of {len(runs)} runs evaluated, {len(fingerprints)} fingerprint(s) "
                    f"{', '.join(f[:12] for f in fingerprints)}"))
    return out  # the accuracies themselves are a measurement, printed in the evaluation table, not a check


def print_summary(settings: Any, runs: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    from areal_metrics.sinks.query import connect

    console = Console(width=max(Console().width, 140))
    with connect(settings) as store:
        for title, sql in (("training", TRAINING_SQL), ("evaluation (majority vote, full stage)", EVAL_SQL),
                           ("generations (shown prompts per full round)", GENERATIONS_SQL),
                           ("closed loop", LOOP_SQL)):
            result = store.query(sql, {"runs": runs})
            table = Table(title=f"{title}  [SQL over ClickHouse]")
            for column in result.columns:
                table.add_column(column)
            for row in result.rows:
                table.add_row(*(str(v) for v in row))
            console.print(table)
        table = Table(title=f"learning (the goal: {LEARNING_GOAL})  [SQL over ClickHouse]")
        for column in ("run", "dataset", "full_rounds", "first -> last", "rise", "slope_t", "goal"):
            table.add_column(column)
        for row in learning_rows(store.query(LEARNING_SQL, {"runs": runs}).rows):
            table.add_row(*(str(v) for v in row))
        console.print(table)
        for passed, what in checks(store, runs):
            console.print(f"[{'green' if passed else 'red'}]{'passed' if passed else 'NOT passed'}[/]: {what}")

"""Closed loop on evaluation: `scale_lr` from the consensus, and `no_improvement`, on evidence.

Pure: `on_consensus(state, consensus, cfg) -> (state, alerts, commands)`, fed with every
consensus the vote emits (areal_metrics.streams.core.voting); only non-stale results of the
watched stage (`lr_eval_stage`, default full) and dataset with at least one decided sample
count, each round at most once, in (attempt, step) order. `cfg` is the worker's config with
the run's own `run.config.eval_loop` applied (areal_metrics.streams.core.processor).

Rules (thresholds in areal_metrics.streams.core.config; the loop may send commands when
`eval_loop_enabled` and `lr_eval_threshold` is set). A run's decisions keep their
false-alarm rate at or below `lr_alpha` over its horizon, `lr_horizon_rounds` rounds (the
run's `eval_loop.horizon_rounds`; else total_steps / eval_interval_steps when its run event
publishes both; else the worker's setting, 200): each rule spends half of it, and every look
up to the horizon has the same power (tests/loop_simulation.py measures both, docs/STREAMS.md).
- The watched dataset is `lr_eval_dataset`, else the first dataset whose consensus of the
  stage the run reports (kept in the state, so the loop follows one dataset).
- Threshold: a one-sided CUSUM of the rounds' shortfall below `lr_eval_threshold`. Each round
  gives z = (threshold - p) / sqrt(threshold (1 - threshold) / n), p its accuracy with every
  undecided sample counted right (the optimistic side: undecided samples never make a cut), n
  its effective sample size (undecided included): p and n are what the high end of the round's
  interval stands on (statistics.side_reading, one rule); S = max(0, S + z - k) with k the one-sided
  normal quantile of alpha / 2, and a cut when S > h, h = cusum_horizon_limit(k, horizon, alpha / 2):
  a run whose rounds are independent at the threshold (z ~ N(0, 1)) is cut within its horizon in
  at most alpha / 2 of runs (the run-length distribution, computed exactly; 1.75 at the defaults). With k at the quantile
  of alpha / 2, a run whose rounds repeat the same data (the same prompts, the same sampling
  noise, unchanged weights) is cut in at most alpha / 2 of runs however long it lasts: S grows
  only while z > k. No samples are pooled across rounds, so a prompt seen in two rounds is never
  counted as two. A single round far below (z > k + h) cuts at once; a drop whose rounds sit
  a few standard errors below is cut within two rounds, as early in the run as late. Past the
  horizon the rule goes on with the same limit: its false-alarm rate per round stays what it
  was, about alpha / 2 per further horizon: a run at the threshold twice its horizon long is cut
  in about alpha of runs (cusum_false_alarm(k, h, 2 * horizon): 4.9 % at the defaults).
  A cut: `scale_lr` by `lr_factor` and an `eval_below_threshold` alert; the run is in a breach
  (no test) until a round's 95 % interval lies at or above threshold + `lr_restore_margin`.
- Raise after a cut: not before `lr_raise_after_rounds` rounds evaluated at the lower rate
  (step >= the cut's `from_step`) in a row read at or above the threshold, the latest with its
  95 % interval at or above threshold + margin; then `scale_lr` by `lr_restore_factor`, capped
  at the ceiling: a cut lowers the ceiling to the geometric middle of the rate it cut and the
  rate it set (the rate at which accuracy dropped is not returned to). A cut after a raise in the
  same attempt keeps the lower rate for the rest of the attempt (no more raises).
- Improvement stopped: every `no_improvement_rounds` (patience) rounds, once patience + 1
  rounds are in, a test over the last 2 x patience rounds: the weighted least-squares slope of
  the accuracy over the step (weights: each round's binomial variance from its effective
  sample size; reported per round at the window's mean interval), its standard error scaled by
  the run's dispersion (quasi-binomial: the mean of (difference of consecutive rounds)^2 /
  (sum of their binomial variances), at least 1: jitter between rounds widens it) and a
  Student t quantile on as many degrees of freedom as differences went into it. It is below
  `lr_improve_delta` when its one-sided upper bound at level alpha / 2 / (horizon / patience)
  is. Then a `no_improvement` alert that recommends stopping (no `stop` is sent; also with the
  loop off), and with the loop on, `scale_lr` by `lr_factor`; the rounds start over.
- Floor: the cumulative factor never goes below `lr_min_factor`; a drop that would is
  not sent (the alert says the lr is at its floor).
- One command per round at most, for the whole run (no target_node), with
  `{"factor": f, "from_step": s}`: s = the round's step + `lr_apply_delay_steps`. Every
  reason names the evaluation and cites its interval or its test.
- Rollback (`lr_rollback`, off by default): a threshold drop's command also carries
  `restore_step`, the latest round of the same attempt whose 95 % interval lay at or above the
  threshold (the round before, or further back when the drop was found late); the
  trainer restores the weights it had then before the lower lr applies (a lower lr alone
  does not bring back a policy that collapsed: docs/WORKLOAD.md). The drop is the threshold
  rule's, with its error rates; the choice of round has its own (tests/loop_simulation.py,
  docs/STREAMS.md).
"""

from __future__ import annotations

import math

from msgspec.structs import replace

from areal_metrics.streams.core.alerts import AlertDecision
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.stored import Stored
from areal_metrics.producers.contract.statistics import (cusum_horizon_limit, proportion_variance, slope_bound,
                                                         t_quantile, z_one_sided)
from areal_metrics.streams.core.triggers import CommandDecision
from areal_metrics.streams.core.voting import Consensus

_EPS = 1e-9


Window = tuple[tuple[int, float, float], ...]  # (step, accuracy, variance) of rounds, oldest first


class EvalLoopState(Stored):
    dataset: str | None = None  # the dataset the loop watches (pinned at its first result)
    last: tuple[int, int] | None = None  # (attempt, step) of the last round decided on
    factor: float = 1.0  # cumulative lr factor asked for so far
    in_breach: bool = False
    looks: int = 0  # threshold looks so far
    previous: tuple[float, float] | None = None  # the older threshold rule's; unused, kept so old records round-trip
    tests: int = 0  # improvement tests so far
    recent: tuple[tuple[float, float], ...] = ()  # the older plateau rule's; unused, likewise
    since_test: int = 0  # rounds since the last improvement test
    # (attempt, step) of the latest round whose 95 % interval lay at or above the threshold (rollback)
    good_round: tuple[int, int] | None = None
    cusum: float = 0.0  # the threshold rule's CUSUM of the rounds' shortfall (in standard errors)
    # (step, accuracy, variance) of the rounds since the last improvement decision, newest last
    window: Window = ()
    # the run's dispersion: sum and count of (difference of consecutive rounds)^2 / (their variances)
    dispersion: tuple[float, int] = (0.0, 0)
    last_round: tuple[float, float] | None = None  # (accuracy, variance) of the last round
    # the same three with each round's undecided samples counted wrong (above: counted right; equal without any)
    window_low: Window = ()
    dispersion_low: tuple[float, int] = (0.0, 0)
    last_round_low: tuple[float, float] | None = None
    lowered_from: int | None = None  # `from_step` of the threshold cut whose raise is still owed
    steady: int = 0  # rounds at the lower rate since then, in a row, read at or above the threshold
    ceiling: float = 1.0  # the highest cumulative factor a raise may reach
    raised_in: int | None = None  # the attempt of the last raise
    locked_in: int | None = None  # an attempt whose lr is no longer raised (a cut after a raise)


def loop_on(cfg: RunConfig) -> bool:
    return cfg.eval_loop_enabled and cfg.lr_eval_threshold is not None


def _counts(state: EvalLoopState, c: Consensus, cfg: RunConfig) -> bool:
    if c.key.stage != cfg.lr_eval_stage or c.stale or c.n_samples <= 0:
        return False
    if c.key.dataset != (cfg.lr_eval_dataset or state.dataset or c.key.dataset):
        return False
    return state.last is None or (c.key.attempt, c.step) > state.last


def _where(c: Consensus) -> str:
    return f"evaluation {c.key.dataset}/{c.key.stage} at step {c.step} (eval {c.key.eval_id})"


def _estimate(c: Consensus, size: float | None = None) -> str:
    """The round as an alert or command shows it, with the effective size the rule read: `size`, that of
    `pessimistic` for a rule on the low end, else `optimistic`'s (they differ only with undecided samples)."""
    undecided = f", {c.n_undecided} undecided" if c.n_undecided else ""
    shown = optimistic(c)[1] if size is None else size
    return (f"accuracy {c.accuracy:.4g} (95% CI [{c.ci_low:.3f}, {c.ci_high:.3f}], {c.n_samples} samples"
            f"{undecided}, effective {shown:.4g})")


def _alert(kind: str, c: Consensus, what: str, value: float, threshold: float | None) -> AlertDecision:
    """An alert about one round (its id: the round; the processor adds the attempt)."""
    return AlertDecision(kind=kind, severity="warning", message=f"{_where(c)}: {what}",
                         about=(kind, c.key.eval_id, c.key.dataset, c.key.stage), step=c.step, value=value,
                         threshold=threshold)


def _command(c: Consensus, factor: float, cumulative: float, why: str, cfg: RunConfig,
             rollback: tuple[int, str] | None = None) -> CommandDecision:
    start = c.step + cfg.lr_apply_delay_steps
    args: dict[str, int | float] = {"factor": factor, "from_step": start}
    restore = ""
    if rollback is not None:
        args["restore_step"], restore = rollback[0], f"; {rollback[1]}"
    return CommandDecision(
        "scale_lr",
        args,
        f"{_where(c)}: {why}; lr x{factor:.4g} from step {start} (cumulative x{cumulative:.4g}, "
        f"floor x{cfg.lr_min_factor:g}){restore}",
        c.step,
        attempt=c.key.attempt,
    )


def _drop(state: EvalLoopState, c: Consensus, why: str, cfg: RunConfig,
          rollback: tuple[int, str] | None = None) -> tuple[EvalLoopState, CommandDecision | None]:
    lowered = state.factor * cfg.lr_factor
    if lowered < cfg.lr_min_factor - _EPS:
        return state, None
    return replace(state, factor=lowered), _command(c, cfg.lr_factor, lowered, why, cfg, rollback)


def shown_good(c: Consensus, threshold: float) -> bool:
    """The round's 95 % interval lies at or above the threshold: weights a rollback may restore."""
    return c.ci_low >= threshold


def rollback_step(good_round: tuple[int, int] | None, c: Consensus, threshold: float) -> tuple[int, str] | None:
    """The step whose weights a drop's `scale_lr` restores, and why: the latest round of this
    attempt whose 95 % interval lay at or above the threshold (None: no such round, nothing to
    restore). A drop found one round late still finds it."""
    if good_round is None or good_round[0] != c.key.attempt or good_round[1] >= c.step:
        return None
    step = good_round[1]
    return step, f"weights of step {step} restored first (the latest round whose 95% CI lay at or above {threshold:g})"


def optimistic(c: Consensus) -> tuple[float, float]:
    """(accuracy, effective samples) over every sample of the round with each undecided sample
    counted right: the side a below-threshold test reads, so undecided samples never make a cut.
    The effective size is the one the interval's high end stands on (Consensus.n_effective_right)."""
    return _undecided_counted(c, right=True)


def pessimistic(c: Consensus) -> tuple[float, float]:
    """`optimistic`'s other end: each undecided sample counted wrong. A faulty grader at two replicas
    ties every sample it gets wrong, so the decided samples alone read a flat line whatever the run does:
    between the two ends lies what the round says."""
    return _undecided_counted(c, right=False)


def _undecided_counted(c: Consensus, right: bool) -> tuple[float, float]:
    """The round over every sample, each undecided one counted right (or wrong); the decided samples'
    own figures when none is undecided."""
    n, u = c.n_samples, max(c.n_undecided, 0)
    if u == 0:
        return c.accuracy, c.n_effective
    if n + u <= 0:
        return c.accuracy, 0.0
    accuracy = (c.accuracy * n + (u if right else 0)) / (n + u)
    side = c.n_effective_right if right else c.n_effective_wrong
    if side is not None:  # the interval's own end: one rule for the number it shows and the loop reads
        return accuracy, side
    scale = (n + u) / n if n > 0 else 1.0  # a consensus stored before the vote kept its sides
    return accuracy, c.n_effective * scale


def shortfall(p: float, n_eff: float, threshold: float) -> float:
    """How many standard errors (at the threshold) the accuracy `p` on `n_eff` samples lies below it."""
    if n_eff <= 0:
        return 0.0
    return (threshold - p) / math.sqrt(max(threshold * (1 - threshold), 1e-6) / n_eff)


def cusum_design(alpha: float, horizon: int) -> tuple[float, float]:
    """(reference k, limit h) of the threshold CUSUM that spends alpha / 2 over `horizon` rounds:
    rounds independent at the threshold are cut within the horizon in at most alpha / 2 of runs."""
    k = z_one_sided(alpha / 2)
    return k, cusum_horizon_limit(k, horizon, alpha / 2)


def below_threshold(c: Consensus, threshold: float, alpha: float, horizon: int,
                    cusum: float) -> tuple[bool, float, str]:
    """One look of the threshold CUSUM: (cut, the new statistic, why)."""
    k, h = cusum_design(alpha, horizon)
    p, n = optimistic(c)
    z = shortfall(p, n, threshold)
    statistic = max(0.0, cusum + z - k)
    counted = f", its {c.n_undecided} undecided samples counted right" if c.n_undecided else ""
    why = (f"{_estimate(c)}: {z:.3g} standard errors below threshold {threshold:g}{counted}; CUSUM of the "
           f"rounds' shortfall {statistic:.3g} {'>' if statistic > h else '<='} limit {h:.3g} (reference {k:.3g}; "
           f"false-alarm rate alpha/2 = {alpha / 2:g} over a horizon of {horizon} rounds)")
    return statistic > h, statistic, why


def _threshold_rule(
    state: EvalLoopState, c: Consensus, cfg: RunConfig
) -> tuple[EvalLoopState, list[AlertDecision], list[CommandDecision]]:
    threshold = cfg.lr_eval_threshold
    if threshold is None or not cfg.eval_loop_enabled:
        return state, [], []
    if state.in_breach:
        if c.ci_low >= threshold + cfg.lr_restore_margin:
            state = replace(state, in_breach=False, cusum=0.0, good_round=(c.key.attempt, c.step))
        return state, [], []
    below, statistic, why = below_threshold(c, threshold, cfg.lr_alpha, cfg.lr_horizon_rounds, state.cusum)
    state = replace(state, looks=state.looks + 1, cusum=statistic)
    if not below:
        if shown_good(c, threshold):
            state = replace(state, good_round=(c.key.attempt, c.step))
        return state, [], []
    state = replace(state, in_breach=True, cusum=0.0)
    rollback = rollback_step(state.good_round, c, threshold) if cfg.lr_rollback else None
    before, locked = state.factor, state.locked_in
    if state.raised_in == c.key.attempt:  # a drop after a raise: the lower rate stays
        locked, why = c.key.attempt, why + "; a drop after a raise: the lr is not raised again in this attempt"
    state, command = _drop(state, c, why, cfg, rollback)
    floor = "" if command is not None else f"; lr already at its floor x{state.factor:.4g}"
    if command is not None:
        # a cut that restores weights: the round at its from_step is (in the reference trainer, which evaluates
        # restored weights at once) of the restored weights, before any update at the lower rate: not evidence
        # of that rate, so the rounds counted for the raise start after it
        lowered_from = int(command.args["from_step"]) + (1 if "restore_step" in command.args else 0)
        state = replace(state, lowered_from=lowered_from, steady=0, locked_in=locked,
                        ceiling=min(state.ceiling, before * math.sqrt(cfg.lr_factor)))
    return state, [_alert("eval_below_threshold", c, why + floor, c.accuracy, threshold)], (
        [command] if command is not None else [])


def _raise_rule(state: EvalLoopState, c: Consensus, cfg: RunConfig) -> tuple[EvalLoopState, list[CommandDecision]]:
    """The raise a threshold cut owes, once the rounds at the lower rate have held."""
    threshold = cfg.lr_eval_threshold
    if state.lowered_from is None or threshold is None or not cfg.eval_loop_enabled:
        return state, []
    if state.locked_in == c.key.attempt or state.factor >= state.ceiling - _EPS:
        return replace(state, lowered_from=None, steady=0), []
    if c.step < state.lowered_from:
        return state, []
    steady = state.steady + 1 if c.accuracy >= threshold else 0
    state = replace(state, steady=steady)
    if state.in_breach or steady < cfg.lr_raise_after_rounds or c.ci_low < threshold + cfg.lr_restore_margin:
        return state, []
    raised = min(state.ceiling, state.factor * cfg.lr_restore_factor)
    why = (f"{_estimate(c, pessimistic(c)[1])}: the interval lies at or above threshold {threshold:g} + margin "
           f"{cfg.lr_restore_margin:g}, and {steady} rounds at the lower rate since step {state.lowered_from} read at "
           f"or above the threshold; raised to at most x{state.ceiling:.4g} (below the rate at which accuracy dropped)")
    command = _command(c, raised / state.factor, raised, why, cfg)
    return replace(state, factor=raised, lowered_from=None, steady=0, raised_in=c.key.attempt), [command]


def improvement_stopped(recent: tuple[tuple[int, float, float], ...], delta: float, alpha: float, tests: int,
                        dispersion: tuple[float, int]) -> tuple[bool, str]:
    """The improvement test over (step, accuracy, variance) rounds: (stopped, why). `tests` is the
    number of tests the horizon holds (the level is alpha / 2 shared among them)."""
    level = alpha / 2 / max(tests, 1)
    steps = [s for s, _, _ in recent]
    gap = (steps[-1] - steps[0]) / (len(steps) - 1) if steps[-1] > steps[0] else 1.0
    slope, se, _ = slope_bound(((s / gap, acc, var) for s, acc, var in recent), 0.0)
    total, count = dispersion
    phi = max(1.0, total / count) if count else 1.0
    quantile = t_quantile(count, 1.0 - level) if count else z_one_sided(level)
    se *= math.sqrt(phi)
    upper = slope + quantile * se
    stopped = upper < delta
    why = (f"accuracy slope {slope:+.4g} per round of {gap:.4g} steps (se {se:.3g}, dispersion {phi:.3g} on {count} "
           f"differences) over the last {len(recent)} rounds: upper bound {upper:+.4g} at one-sided level {level:.2g} "
           f"(one of {max(tests, 1)} tests over the horizon) {'<' if stopped else '>='} {delta:g} per round")
    return stopped, why


def _with_round(window: Window, dispersion: tuple[float, int], last_round: tuple[float, float] | None, step: int,
                reading: tuple[float, float], keep: int) -> tuple[Window, tuple[float, int], tuple[float, float]]:
    """One reading of the round (accuracy, effective samples) added to the plateau test's window (the last
    `keep` rounds) and to the run's dispersion."""
    accuracy, n_effective = reading
    variance = proportion_variance(accuracy, n_effective)
    total, count = dispersion
    if last_round is not None:
        total, count = total + (accuracy - last_round[0]) ** 2 / (variance + last_round[1]), count + 1
    return (*window, (step, accuracy, variance))[-keep:], (total, count), (accuracy, variance)


def _improvement_rule(
    state: EvalLoopState, c: Consensus, cfg: RunConfig, commanded: bool
) -> tuple[EvalLoopState, list[AlertDecision], list[CommandDecision]]:
    """The plateau test, on both ends of what each round says (its undecided samples counted right, and
    wrong): improvement has stopped only when it has on both, so samples a faulty grader leaves undecided
    never make a plateau of a run that improves (the decided samples alone can read flat)."""
    patience = cfg.no_improvement_rounds
    keep = max(2 * patience, 1)
    if not state.window_low and state.last_round_low is None and state.last_round is not None:
        # a state recorded before both ends were kept: its rounds' one reading stands for both
        state = replace(state, window_low=state.window, dispersion_low=state.dispersion,
                        last_round_low=state.last_round)
    window, dispersion, last_round = _with_round(state.window, state.dispersion, state.last_round, c.step,
                                                 optimistic(c), keep)
    window_low, dispersion_low, last_low = _with_round(state.window_low, state.dispersion_low, state.last_round_low,
                                                       c.step, pessimistic(c), keep)
    state = replace(state, last_round=last_round, dispersion=dispersion, last_round_low=last_low,
                    dispersion_low=dispersion_low)
    if patience <= 0:
        return state, [], []
    state = replace(state, window=window, window_low=window_low, since_test=state.since_test + 1)
    if len(window) < patience + 1 or state.since_test < patience or window[-1][0] <= window[0][0]:
        return state, [], []
    state = replace(state, tests=state.tests + 1, since_test=0)
    tests = math.ceil(cfg.lr_horizon_rounds / patience)
    stopped, why = improvement_stopped(window, cfg.lr_improve_delta, cfg.lr_alpha, tests, dispersion)
    if stopped and window_low != window:  # undecided samples in the window: the other end must say so too
        stopped, why_low = improvement_stopped(window_low, cfg.lr_improve_delta, cfg.lr_alpha, tests, dispersion_low)
        why = f"{why}, with undecided samples counted right; counted wrong: {why_low}"
    if not stopped:
        return state, [], []
    state = replace(state, window=(), window_low=())
    command = None
    if loop_on(cfg) and not commanded:
        state, command = _drop(state, c, f"improvement stopped: {why}", cfg)
    if command is not None:
        action = f"lr x{cfg.lr_factor:g} from step {command.args['from_step']}"
    elif loop_on(cfg) and not commanded:
        action = f"lr already at its floor x{state.factor:.4g}"
    else:
        action = "lr unchanged"
    alert = _alert("no_improvement", c, f"improvement stopped: {why}; {action}; consider stopping the run",
                   c.accuracy, None)
    return state, [alert], [command] if command is not None else []


def on_consensus(
    state: EvalLoopState, c: Consensus, cfg: RunConfig
) -> tuple[EvalLoopState, list[AlertDecision], list[CommandDecision]]:
    if not _counts(state, c, cfg):
        return state, [], []
    state = replace(state, dataset=c.key.dataset, last=(c.key.attempt, c.step))
    state, alerts, commands = _threshold_rule(state, c, cfg)
    if not commands:
        state, commands = _raise_rule(state, c, cfg)
    state, more_alerts, more_commands = _improvement_rule(state, c, cfg, commanded=bool(commands))
    return state, [*alerts, *more_alerts], [*commands, *more_commands]

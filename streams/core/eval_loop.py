"""Closed loop on evaluation: `scale_lr` from the consensus, and `no_improvement`, on evidence.

Pure: `on_consensus(state, consensus, cfg) -> (state, alerts, commands)`, fed with every
consensus the vote emits (areal_metrics.streams.core.voting); only non-stale results of the
watched stage (`lr_eval_stage`, default full) and dataset with at least one decided sample
count, each round at most once, in (attempt, step) order. `cfg` is the worker's config with
the run's own `run.config.eval_loop` applied (areal_metrics.streams.core.processor).

Rules (thresholds in areal_metrics.streams.core.config; the loop may send commands when
`eval_loop_enabled` and `lr_eval_threshold` is set). A run's decisions keep their
false-alarm rate at or below `lr_alpha` over all its rounds: each rule spends half of it,
its k-th test at level look_alpha(alpha / 2, k) = alpha/2 * 6 / (pi^2 k^2)
(areal_metrics.producers.contract.statistics), whose sum over any number of tests is alpha / 2.
- The watched dataset is `lr_eval_dataset`, else the first dataset whose consensus of the
  stage the run reports (kept in the state, so the loop follows one dataset).
- Threshold: out of a breach, every round is a look: the upper end of the one-sided
  interval of the accuracy at the look's level (Wilson on the consensus's effective sample
  size, on its optimistic side: undecided samples counted right, `optimistic`) below `lr_eval_threshold` -> `scale_lr` by `lr_factor` and an `eval_below_threshold`
  alert. A look after another looks twice, at half the level each: the round alone, and the
  two rounds pooled (a lasting drop is found on twice the samples). The breach lasts until the round's 95 % interval lies at or above threshold +
  `lr_restore_margin`; its end restores: `scale_lr` by `lr_restore_factor`, capped so the
  cumulative factor never exceeds 1.0. No test runs during a breach.
- Improvement stopped: every `no_improvement_rounds` (patience) rounds, once patience + 1
  rounds are in, a test over the last 2 x patience rounds: the weighted least-squares slope
  of the accuracy per round (weights: each round's variance from its effective sample size)
  is below `lr_improve_delta` when its one-sided upper bound at the test's level is. Then a
  `no_improvement` alert that recommends stopping (no `stop` is sent; also with the loop
  off), and with the loop on, `scale_lr` by `lr_factor`; the rounds start over.
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

from msgspec.structs import replace

from areal_metrics.streams.core.alerts import AlertDecision
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.stored import Stored
from areal_metrics.producers.contract.statistics import look_alpha, proportion_variance, slope_bound, wilson, z_one_sided
from areal_metrics.streams.core.triggers import CommandDecision
from areal_metrics.streams.core.voting import Consensus

_EPS = 1e-9


class EvalLoopState(Stored):
    dataset: str | None = None  # the dataset the loop watches (pinned at its first result)
    last: tuple[int, int] | None = None  # (attempt, step) of the last round decided on
    factor: float = 1.0  # cumulative lr factor asked for so far
    in_breach: bool = False
    looks: int = 0  # threshold looks so far (each spends its share of alpha / 2)
    previous: tuple[float, float] | None = None  # (accuracy, effective samples) of the last round looked at
    tests: int = 0  # improvement tests so far (likewise)
    # (accuracy, variance) of the rounds since the last improvement decision, newest last
    recent: tuple[tuple[float, float], ...] = ()
    since_test: int = 0  # rounds since the last improvement test
    # (attempt, step) of the latest round whose 95 % interval lay at or above the threshold (rollback)
    good_round: tuple[int, int] | None = None


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


def _estimate(c: Consensus) -> str:
    return (f"accuracy {c.accuracy:.4g} (95% CI [{c.ci_low:.3f}, {c.ci_high:.3f}], {c.n_samples} samples, "
            f"effective {c.n_effective:.4g})")


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


def optimistic(c: Consensus) -> tuple[float, float]:
    """(accuracy, effective samples) over every sample of the round with each undecided sample
    counted right: the side a below-threshold test reads, so undecided samples never make a cut.
    The effective size is the decided samples' scaled to the round's size."""
    total = c.n_samples + c.n_undecided
    if not c.n_undecided or not c.n_samples:
        return c.accuracy, c.n_effective
    return (c.accuracy * c.n_samples + c.n_undecided) / total, c.n_effective * total / c.n_samples


def shown_good(c: Consensus, threshold: float) -> bool:
    """The round's 95 % interval lies at or above the threshold: weights a rollback may restore."""
    return c.ci_low >= threshold


def rollback_step(good_round: tuple[int, int] | None, c: Consensus, threshold: float) -> tuple[int, str] | None:
    """The step whose weights a drop's `scale_lr` restores, and why: the latest round of this
    attempt whose 95 % interval lay at or above the threshold (None: no such round, nothing to
    restore). A drop found one round late (pooled with the round before) still finds it."""
    if good_round is None or good_round[0] != c.key.attempt or good_round[1] >= c.step:
        return None
    step = good_round[1]
    return step, f"weights of step {step} restored first (the latest round whose 95% CI lay at or above {threshold:g})"


def below_threshold(c: Consensus, threshold: float, alpha: float, look: int,
                    previous: tuple[float, float] | None = None) -> tuple[bool, str]:
    """The threshold test of one round: (the interval lies below the threshold, why).

    With the `previous` round's (accuracy, effective samples), a second test pools the two
    rounds (a drop that lasts is found on twice the samples); the look's level is then split
    between the two tests."""
    level = look_alpha(alpha / 2, look) / (2 if previous is not None else 1)
    z = z_one_sided(level)
    accuracy, n_effective = optimistic(c)
    upper = wilson(accuracy, n_effective, z)[1]
    what = "its" if not c.n_undecided else f"its ({c.n_undecided} undecided counted right)"
    if upper >= threshold and previous is not None:
        n = n_effective + previous[1]
        pooled = (accuracy * n_effective + previous[0] * previous[1]) / n if n > 0 else accuracy
        pooled_upper = wilson(pooled, n, z)[1]
        if pooled_upper < threshold:
            upper, what = pooled_upper, f"with the round before ({previous[0]:.4g}), pooled {pooled:.4g} on {n:.4g} " \
                                        "effective samples, their"
    why = (f"{_estimate(c)}: {what} upper bound {upper:.4g} at one-sided level {level:.2g} (look {look} of the run, "
           f"alpha {alpha:g} spent over its rounds) {'<' if upper < threshold else '>='} threshold {threshold:g}")
    return upper < threshold, why


def _threshold_rule(
    state: EvalLoopState, c: Consensus, cfg: RunConfig
) -> tuple[EvalLoopState, list[AlertDecision], list[CommandDecision]]:
    threshold = cfg.lr_eval_threshold
    if threshold is None or not cfg.eval_loop_enabled:
        return state, [], []
    if state.in_breach:
        if c.ci_low < threshold + cfg.lr_restore_margin:
            return state, [], []
        state = replace(state, in_breach=False, previous=None, good_round=(c.key.attempt, c.step))
        if state.factor >= 1.0 - _EPS:
            return state, [], []
        raised = min(1.0, state.factor * cfg.lr_restore_factor)
        why = f"{_estimate(c)}: the interval lies at or above threshold {threshold:g} + margin {cfg.lr_restore_margin:g}"
        command = _command(c, raised / state.factor, raised, why, cfg)
        return replace(state, factor=raised), [], [command]
    previous = state.previous
    state = replace(state, looks=state.looks + 1, previous=optimistic(c))
    below, why = below_threshold(c, threshold, cfg.lr_alpha, state.looks, previous)
    if not below:
        if shown_good(c, threshold):
            state = replace(state, good_round=(c.key.attempt, c.step))
        return state, [], []
    state = replace(state, in_breach=True)
    rollback = rollback_step(state.good_round, c, threshold) if cfg.lr_rollback else None
    state, command = _drop(state, c, why, cfg, rollback)
    floor = "" if command is not None else f"; lr already at its floor x{state.factor:.4g}"
    return state, [_alert("eval_below_threshold", c, why + floor, c.accuracy, threshold)], (
        [command] if command is not None else [])


def improvement_stopped(recent: tuple[tuple[float, float], ...], delta: float, alpha: float,
                        test: int) -> tuple[bool, str]:
    """The improvement test over (accuracy, variance) rounds: (stopped, why)."""
    level = look_alpha(alpha / 2, test)
    slope, se, upper = slope_bound(((i, acc, var) for i, (acc, var) in enumerate(recent)), z_one_sided(level))
    stopped = upper < delta
    why = (f"accuracy slope {slope:+.4g} per round (se {se:.3g}) over the last {len(recent)} rounds: upper bound "
           f"{upper:+.4g} at one-sided level {level:.2g} (test {test} of the run) "
           f"{'<' if stopped else '>='} {delta:g} per round")
    return stopped, why


def _improvement_rule(
    state: EvalLoopState, c: Consensus, cfg: RunConfig, commanded: bool
) -> tuple[EvalLoopState, list[AlertDecision], list[CommandDecision]]:
    patience = cfg.no_improvement_rounds
    if patience <= 0:
        return state, [], []
    recent = (*state.recent, (c.accuracy, proportion_variance(c.accuracy, c.n_effective)))[-2 * patience:]
    state = replace(state, recent=recent, since_test=state.since_test + 1)
    if len(recent) < patience + 1 or state.since_test < patience:
        return state, [], []
    state = replace(state, tests=state.tests + 1, since_test=0)
    stopped, why = improvement_stopped(recent, cfg.lr_improve_delta, cfg.lr_alpha, state.tests)
    if not stopped:
        return state, [], []
    state = replace(state, recent=())
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
    state, more_alerts, more_commands = _improvement_rule(state, c, cfg, commanded=bool(commands))
    return state, [*alerts, *more_alerts], [*commands, *more_commands]

"""Closed loop on evaluation: `scale_lr` from the full-stage consensus, and `no_improvement`.

Pure: `on_consensus(state, consensus, cfg) -> (state, alerts, commands)`, fed with every
consensus the vote emits (areal_metrics.streams.core.voting); only full-stage, non-stale results of the
watched dataset count, each round at most once, in (attempt, step) order (a round older
than the last one decided on changes nothing).

Rules (thresholds in areal_metrics.streams.core.config; the loop is on when `lr_eval_threshold` is set)
- The watched dataset is `lr_eval_dataset`, else the first dataset whose full-stage
  consensus the run reports (kept in the state, so the loop follows one dataset).
- Drop: when the accuracy falls below `lr_eval_threshold` (a round below it while not
  already in a breach: the first round too), `scale_lr` by `lr_factor`; the breach lasts
  until the accuracy is back at threshold + `lr_restore_margin`.
- No improvement: when `no_improvement_rounds` rounds in a row did not beat the best
  accuracy so far by more than `lr_improve_delta`, a `no_improvement` alert that
  recommends stopping (no `stop` is sent), and with the loop on, `scale_lr` by
  `lr_factor`; the count starts over after each such alert.
- Floor: the cumulative factor never goes below `lr_min_factor`; a drop that would is
  not sent (the alert says the lr is at its floor).
- Restore: when a breach ends and the cumulative factor is below 1, `scale_lr` by
  `lr_restore_factor`, capped so the cumulative factor never exceeds 1.0. Only the end of
  a breach restores, so a recovered run is not scaled up and down in turn.
- One command per round at most, for the whole run (no target_node), with
  `{"factor": f, "from_step": s}`: s = the round's step + `lr_apply_delay_steps`, the step
  boundary from which every rank applies it. The reason names the evaluation (dataset,
  stage, eval_id, step, accuracy, threshold).
"""

from __future__ import annotations


from areal_metrics.streams.core.alerts import AlertDecision
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.evolve import evolve, stored
from areal_metrics.streams.core.triggers import CommandDecision
from areal_metrics.streams.core.voting import Consensus

_EPS = 1e-9


@stored  # stored state (areal_metrics.streams.state.codec)
class EvalLoopState:
    dataset: str | None = None  # the dataset the loop watches (pinned at its first full-stage result)
    last: tuple[int, int] | None = None  # (attempt, step) of the last round decided on
    factor: float = 1.0  # cumulative lr factor asked for so far
    in_breach: bool = False
    best: float | None = None
    best_step: int | None = None
    rounds_since_best: int = 0


def _counts(state: EvalLoopState, c: Consensus, cfg: RunConfig) -> bool:
    if c.key.stage != "full" or c.stale:
        return False
    if c.key.dataset != (cfg.lr_eval_dataset or state.dataset or c.key.dataset):
        return False
    return state.last is None or (c.key.attempt, c.step) > state.last


def _where(c: Consensus) -> str:
    return f"evaluation {c.key.dataset}/{c.key.stage} at step {c.step} (eval {c.key.eval_id})"


def _alert(kind: str, c: Consensus, what: str, threshold: float | None) -> AlertDecision:
    """An alert about one round (its id: the round; the processor adds the attempt)."""
    return AlertDecision(kind=kind, severity="warning", message=f"{_where(c)}: {what}",
                         about=(kind, c.key.eval_id, c.key.dataset, c.key.stage), step=c.step, value=c.accuracy,
                         threshold=threshold)


def _command(c: Consensus, factor: float, cumulative: float, why: str, cfg: RunConfig) -> CommandDecision:
    start = c.step + cfg.lr_apply_delay_steps
    return CommandDecision(
        "scale_lr",
        {"factor": factor, "from_step": start},
        f"{_where(c)}: {why}; lr x{factor:.4g} from step {start} (cumulative x{cumulative:.4g}, "
        f"floor x{cfg.lr_min_factor:g})",
        c.step,
        attempt=c.key.attempt,
    )


def _drop(state: EvalLoopState, c: Consensus, why: str, cfg: RunConfig) -> tuple[EvalLoopState, CommandDecision | None]:
    lowered = state.factor * cfg.lr_factor
    if lowered < cfg.lr_min_factor - _EPS:
        return state, None
    return evolve(state, factor=lowered), _command(c, cfg.lr_factor, lowered, why, cfg)


def _threshold_rule(
    state: EvalLoopState, c: Consensus, cfg: RunConfig
) -> tuple[EvalLoopState, list[AlertDecision], list[CommandDecision]]:
    threshold = cfg.lr_eval_threshold
    if threshold is None:
        return state, [], []
    acc = c.accuracy
    if state.in_breach:
        if acc < threshold + cfg.lr_restore_margin:
            return state, [], []
        state = evolve(state, in_breach=False)
        if state.factor >= 1.0 - _EPS:
            return state, [], []
        raised = min(1.0, state.factor * cfg.lr_restore_factor)
        why = (f"consensus accuracy {acc:.4g} recovered to >= threshold {threshold:g} + margin "
               f"{cfg.lr_restore_margin:g}")
        command = _command(c, raised / state.factor, raised, why, cfg)
        return evolve(state, factor=raised), [], [command]
    if acc >= threshold:
        return state, [], []
    state = evolve(state, in_breach=True)
    state, command = _drop(state, c, f"consensus accuracy {acc:.4g} below threshold {threshold:g}", cfg)
    floor = "" if command is not None else f"; lr already at its floor x{state.factor:.4g}"
    alert = _alert("eval_below_threshold", c, f"consensus accuracy {acc:.4g} below {threshold:g}{floor}", threshold)
    return state, [alert], [command] if command is not None else []


def _improvement_rule(
    state: EvalLoopState, c: Consensus, cfg: RunConfig, commanded: bool
) -> tuple[EvalLoopState, list[AlertDecision], list[CommandDecision]]:
    acc = c.accuracy
    if state.best is None or acc > state.best + cfg.lr_improve_delta:
        return evolve(state, best=acc, best_step=c.step, rounds_since_best=0), [], []
    state = evolve(state, rounds_since_best=state.rounds_since_best + 1)
    k = cfg.no_improvement_rounds
    if k <= 0 or state.rounds_since_best < k:
        return state, [], []
    state = evolve(state, rounds_since_best=0)
    why = (f"accuracy {acc:.4g} has not beaten the best {state.best:.4g} (step {state.best_step}) by more than "
           f"{cfg.lr_improve_delta:g} for {k} rounds")
    command = None
    if cfg.lr_eval_threshold is not None and not commanded:
        state, command = _drop(state, c, why, cfg)
    if command is not None:
        action = f"lr x{cfg.lr_factor:g} from step {command.args['from_step']}"
    elif cfg.lr_eval_threshold is not None and not commanded:
        action = f"lr already at its floor x{state.factor:.4g}"
    else:
        action = "lr unchanged"
    alert = _alert("no_improvement", c, f"{why}; {action}; consider stopping the run", state.best)
    return state, [alert], [command] if command is not None else []


def on_consensus(
    state: EvalLoopState, c: Consensus, cfg: RunConfig
) -> tuple[EvalLoopState, list[AlertDecision], list[CommandDecision]]:
    if not _counts(state, c, cfg):
        return state, [], []
    state = evolve(state, dataset=c.key.dataset, last=(c.key.attempt, c.step))
    state, alerts, commands = _threshold_rule(state, c, cfg)
    state, more_alerts, more_commands = _improvement_rule(state, c, cfg, commanded=bool(commands))
    return state, [*alerts, *more_alerts], [*commands, *more_commands]

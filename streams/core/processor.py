"""One run's whole state and what each input does to it: the pure core the worker calls.

`on_step`, `on_eval`, `on_run`, `on_command_ack`, `on_rejected`, `on_tick` take a `RunState`, an input and
the worker clock `now`, and return the new state and the `Output`s to send. Outputs are
contract records (areal_metrics.producers.contract.events) with deterministic event_ids, so re-sending one after
a crash deduplicates downstream. `Output.must_ack` marks outputs the worker must see
delivered before it saves the new state: once the state says "done", the input will not
produce them again. (A `reward_smoothed` that the current step event completed is
exempt: a redelivery of that event re-sends its stored point.)

A step's reward goes through areal_metrics.streams.core.ranks first (the mean over the step's ranks, once
all `world_size` ranks reported or `step_wait_s` passed), then areal_metrics.streams.core.smoothing. Ids of
commands and alerts decided in a resumed attempt (> 0) include the attempt; a
`reward_smoothed` keeps its id per (run, step), so a resumed attempt's point replaces the
earlier one in FINAL reads (the later offset wins).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec.structs import replace

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.field_rules import fit_message
from areal_metrics.producers.contract.events import (
    AlertEvent,
    CommandAckEvent,
    CommandEvent,
    EvalConsensusEvent,
    EvalEvent,
    Event,
    RejectedEvent,
    RewardSmoothedEvent,
    RunEvent,
    StepEvent,
)
from areal_metrics.streams.core.acks import AckState, on_ack, on_node_step, on_sent
from areal_metrics.streams.core.alerts import (
    AlertDecision,
    BreachState,
    InvalidState,
    NonFiniteState,
    StallState,
    ThroughputState,
    check_ended,
    check_invalid,
    check_non_finite,
    check_reward,
    check_stalled,
    check_throughput,
    is_newest,
    saw_step,
)
from areal_metrics.streams.core.config import RunConfig, eval_loop_overrides
from areal_metrics.streams.core.eval_loop import EvalLoopState, on_consensus
from areal_metrics.streams.core.stored import NO_PAIRS, Pairs, Stored, hold_pairs
from areal_metrics.streams.core.lifecycle import Lifecycle, on_run_event, saw_attempt
from areal_metrics.streams.core.ranks import (
    RankReport,
    RankState,
    StepReward,
    add_rank,
    oldest_wait,
    supersede,
)
from areal_metrics.streams.core.ranks import expire as expire_ranks
from areal_metrics.streams.core.smoothing import SmoothedPoint, SmoothingState, add_reward, classify
from areal_metrics.streams.core.triggers import CommandDecision, TriggerState, decide, published_interval, rewind, with_base_interval
from areal_metrics.streams.core.voting import (
    Consensus,
    NodeResult,
    RoundKey,
    VoteOutcome,
    VoteState,
    add_result,
    answered_all,
    consensus_metric,
    expire,
    recheck,
)

WORKER_NODE = "areal-streams"  # the `node` of every event the worker derives
_ID_NAMESPACE = uuid.UUID("5d1f3c1e-6a57-4a53-9a8e-2f4b8c3e7a10")


def _id_part(part: object) -> str:
    # "\\" and "|" escaped: parts are joined without ambiguity (("a|b", "c") != ("a", "b|c")),
    # and parts without either character give the ids earlier versions gave.
    return str(part).replace("\\", "\\\\").replace("|", "\\|")


_ID_SEED = hashlib.sha1(_ID_NAMESPACE.bytes)


def derived_id(*parts: object) -> str:
    """Deterministic event id of a derived event: the same facts give the same id.

    It is `uuid.uuid5(_ID_NAMESPACE, name).hex`, computed without building UUID objects
    (the worker derives one or more per step)."""
    digest = _ID_SEED.copy()
    digest.update("|".join([_id_part(p) for p in parts]).encode())
    raw = bytearray(digest.digest()[:16])
    raw[6] = (raw[6] & 0x0F) | 0x50  # version 5
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    return raw.hex()


def _attempt_part(attempt: int) -> tuple[object, ...]:
    """Nothing for attempt 0 (the ids earlier versions gave), else ("attempt", n)."""
    return ("attempt", attempt) if attempt else ()


# a frozen Struct: made per output, and its __init__ costs a tenth of a frozen dataclass's
class Output(msgspec.Struct, frozen=True, gc=False):
    event: Event
    must_ack: bool = True


class RunState(Stored):
    run_id: str
    partition: int | None = None  # the input partition the run lives on (its clock ticks come there)
    smoothing: SmoothingState = SmoothingState()
    ranks: RankState = RankState()  # steps waiting for the rest of their ranks
    trigger: TriggerState = TriggerState()
    reward_alert: BreachState = BreachState(armed=False)  # see alerts.check_reward
    eval_loop: EvalLoopState = EvalLoopState()
    throughput: ThroughputState = ThroughputState()
    stall: StallState = StallState()
    lifecycle: Lifecycle = Lifecycle()
    non_finite: NonFiniteState = NonFiniteState()
    votes: VoteState = VoteState()
    invalid: Pairs[str, InvalidState] = NO_PAIRS  # per source topic
    # The run's own `run.config.eval_loop`, as RunConfig overrides (config.eval_loop_overrides)
    loop_overrides: Pairs[str, Any] = NO_PAIRS
    acks: AckState = AckState()  # the scale_lr commands sent and what the nodes acknowledged (acks.py)

    def __post_init__(self) -> None:
        if type(self.invalid) is not Pairs or type(self.loop_overrides) is not Pairs:  # (a replace keeps them)
            hold_pairs(self, "invalid", "loop_overrides")


def loop_config(state: RunState, cfg: RunConfig) -> RunConfig:
    """The worker's config with the run's `run.config.eval_loop` applied."""
    return cfg.with_overrides(state.loop_overrides) if state.loop_overrides else cfg


def adaptive(state: RunState, cfg: RunConfig) -> bool:
    """Does the run take `set_eval_interval`? (`eval_loop.adaptive_interval`, else the worker's setting)"""
    return bool(state.loop_overrides.get("adaptive_interval", cfg.adaptive_interval))


# ------------------------------------------------------------------ records


def smoothed_event(run_id: str, point: SmoothedPoint, ts: float) -> RewardSmoothedEvent:
    return RewardSmoothedEvent.build(
        run_id=run_id,
        node=WORKER_NODE,
        ts=ts,
        event_id=derived_id("reward_smoothed", run_id, point.step),
        step=point.step,
        reward=point.reward,
        window=max(1, point.window),
        sliding_avg=point.sliding_avg,
        ema=point.ema,
        slope=point.slope,
    )


def command_event(run_id: str, d: CommandDecision, ts: float) -> CommandEvent:
    return CommandEvent.build(
        run_id=run_id,
        node=WORKER_NODE,
        ts=ts,
        event_id=derived_id("command", run_id, d.command, d.step, json.dumps(d.args, sort_keys=True),
                            *_attempt_part(d.attempt)),
        command=d.command,
        args=d.args,
        reason=fit_message(d.reason),
    )


def alert_event(run_id: str, a: AlertDecision, ts: float, attempt: int = 0) -> AlertEvent:
    alert_id = derived_id("alert", run_id, *a.about, *_attempt_part(attempt))
    return AlertEvent.build(
        run_id=run_id,
        node=WORKER_NODE,
        ts=ts,
        event_id=alert_id,
        alert_id=alert_id,
        kind=a.kind,
        severity=a.severity,
        message=fit_message(a.message),
        step=a.step,
        value=a.value,
        threshold=a.threshold,
    )


def consensus_event(c: Consensus, ts: float) -> EvalConsensusEvent:
    k = c.key
    return EvalConsensusEvent.build(
        run_id=k.run_id,
        node=WORKER_NODE,
        ts=ts,
        # One id per round: a stale repeat and a real result can never both exist for it.
        event_id=derived_id("eval_consensus", k.run_id, k.eval_id, k.dataset, k.stage),
        eval_id=k.eval_id,
        step=c.step,
        dataset=k.dataset,
        stage=k.stage,
        accuracy=c.accuracy,
        response_length=c.response_length,
        votes=c.votes,
        replicas=c.replicas,
        agreement=min(1.0, max(0.0, c.agreement)),
        dissenters=c.dissenters,
        stale=c.stale,
        partial=c.partial,
        n_samples=c.n_samples,
        n_undecided=c.n_undecided,
        ci_low=min(1.0, max(0.0, c.ci_low)),
        ci_high=min(1.0, max(0.0, c.ci_high)),
        metrics=dict(c.metrics),
    )


def _vote_outputs(state: RunState, outcome: VoteOutcome, ts: float, cfg: RunConfig) -> tuple[RunState, list[Output]]:
    """The consensus and the vote's alerts, then what the closed loop makes of the consensus."""
    out: list[Output] = []
    c = outcome.consensus
    attempt = c.key.attempt if c is not None else 0
    if c is not None:
        out.append(Output(consensus_event(c, ts)))
    out.extend(Output(alert_event(state.run_id, a, ts, attempt)) for a in outcome.alerts)
    if c is not None:
        loop, alerts, commands = on_consensus(state.eval_loop, c, loop_config(state, cfg))
        state = replace(state, eval_loop=loop)
        out.extend(Output(alert_event(state.run_id, a, ts, attempt)) for a in alerts)
        state, sent = _send(state, commands, ts)
        out.extend(sent)
    return state, out


def _send(state: RunState, commands: list[CommandDecision], ts: float) -> tuple[RunState, list[Output]]:
    """The commands as events; a `scale_lr` is watched until the nodes acknowledge it (acks.py)."""
    out: list[Output] = []
    acks = state.acks
    for d in commands:
        event = command_event(state.run_id, d, ts)
        acks = on_sent(acks, event.event_id, d.command, d.args, d.attempt)
        out.append(Output(event))
    return (state if acks is state.acks else replace(state, acks=acks)), out


# ------------------------------------------------------------------ inputs


def _saw_attempt(state: RunState, attempt: int) -> RunState:
    lifecycle = saw_attempt(state.lifecycle, attempt)
    return state if lifecycle is state.lifecycle else replace(state, lifecycle=lifecycle)


def _smooth(
    state: RunState, ready: StepReward, cfg: RunConfig, current_id: str | None
) -> tuple[RunState, list[Output]]:
    """A step whose ranks are in (or whose wait is over): smooth it, then the decisions.

    Its `reward_smoothed` needs no ack only when `current_id` (the input being processed)
    completed it: a redelivery of that input re-sends it. Steps completed by a timeout or
    an eviction have no such input."""
    if ready.reward is None:
        return state, []
    before = state.smoothing
    smoothing, outcome = add_reward(before, ready.step, ready.reward, cfg.window, cfg.ema_alpha, ready.source_id,
                                    ready.attempt)
    point = outcome.point
    if point is None or outcome.kind == "duplicate":
        return state, []
    trigger = rewind(state.trigger, ready.step) if ready.attempt > before.attempt else state.trigger
    resend = bool(ready.source_id) and ready.source_id == current_id
    outputs = [Output(smoothed_event(state.run_id, point, ready.ts), must_ack=not resend)]
    if not outcome.is_newest:
        return replace(state, smoothing=smoothing, trigger=trigger), outputs
    trigger, commands = decide(trigger, point, cfg, outcome.slope_se, adaptive(state, cfg))
    reward_alert, alerts = check_reward(state.reward_alert, point, cfg)
    state = replace(state, smoothing=smoothing, trigger=trigger, reward_alert=reward_alert)
    if alerts or commands:  # (rarely: most steps decide nothing)
        outputs.extend(Output(alert_event(state.run_id, a, ready.ts, ready.attempt)) for a in alerts)
        state, sent = _send(state, commands, ready.ts)
        outputs.extend(sent)
    return state, outputs


def _smooth_all(
    state: RunState, ready: list[StepReward], cfg: RunConfig, current_id: str | None
) -> tuple[RunState, list[Output]]:
    outputs: list[Output] = []
    for r in ready:
        state, out = _smooth(state, r, cfg, current_id)
        outputs.extend(out)
    return state, outputs


def _step_reward(state: RunState, ev: StepEvent, now: float, cfg: RunConfig) -> tuple[RunState, list[Output]]:
    """The step's report of its rank: to the step's pending reports, or a repeat."""
    _, seen = classify(state.smoothing, ev.step, ev.attempt, cfg.window)
    if seen.kind == "duplicate":
        # The step was emitted: only a redelivery of the event that completed it re-sends it.
        point = seen.point
        if point is not None and point.source_id == ev.event_id:
            return state, [Output(smoothed_event(state.run_id, point, ev.ts), must_ack=False)]
        return state, []
    if seen.kind in ("stale", "too_late"):
        return state, []
    ranks = supersede(state.ranks, ev.attempt, ev.step) if ev.attempt else state.ranks
    report = RankReport(rank=ev.rank, reward=ev.reward, n_samples=ev.n_samples)
    ranks, ready = add_rank(ranks, (ev.attempt, ev.step), expected_ranks(state, ev, now, cfg), report, ev.ts,
                            ev.event_id, now, cfg.max_pending_steps)
    if ranks is not state.ranks:  # (a one-rank step leaves them as they were)
        state = replace(state, ranks=ranks)
    return _smooth_all(state, ready, cfg, ev.event_id)


def expected_ranks(state: RunState, ev: StepEvent, now: float, cfg: RunConfig) -> int | None:
    """The ranks a step waits for: its `world_size`, but no more than the ranks that registered the
    current attempt once that count is trusted (`registered`): a run logged from rank 0 alone under
    WORLD_SIZE > 1 needs nothing declared, its steps stop waiting for ranks that never log."""
    world = ev.world_size
    if world is None or world <= 1 or ev.attempt != state.lifecycle.attempt:
        return world
    trusted = registered(state, now, cfg)
    return world if trusted is None else min(world, max(trusted, 1))


def on_step(state: RunState, ev: StepEvent, now: float, cfg: RunConfig) -> tuple[RunState, list[Output]]:
    outputs: list[Output] = []
    state = _saw_attempt(state, ev.attempt)
    changes: dict[str, Any] = {}
    if ev.throughput is not None and is_newest(state.stall, ev.step, ev.attempt):
        changes["throughput"], alerts = check_throughput(state.throughput, ev.step, ev.throughput, cfg)
        outputs.extend(Output(alert_event(state.run_id, a, ev.ts, ev.attempt)) for a in alerts)
    changes["stall"] = saw_step(state.stall, ev.step, now, ev.attempt)
    if ev.non_finite:
        changes["non_finite"], alerts = check_non_finite(state.non_finite, ev.non_finite, ev.step, ev.rank)
        outputs.extend(Output(alert_event(state.run_id, a, ev.ts)) for a in alerts)
    if state.acks.sent and not state.lifecycle.ended:  # scale_lr commands this node should have acknowledged
        acks, alerts = on_node_step(state.acks, ev.node, ev.step, ev.attempt, cfg.command_ack_steps)
        if acks is not state.acks:
            changes["acks"] = acks
        outputs.extend(Output(alert_event(state.run_id, a, ev.ts, ev.attempt)) for a in alerts)
    state = replace(state, **changes)
    if ev.reward is None and (ev.world_size or 1) <= 1:
        return state, outputs  # nothing to average, and no other rank to wait for
    state, more = _step_reward(state, ev, now, cfg)
    return state, outputs + more


def on_eval(state: RunState, ev: EvalEvent, now: float, cfg: RunConfig) -> tuple[RunState, list[Output]]:
    if ev.status == "skipped":
        return state, []  # a round not evaluated (busy evaluator, quick stage said no): nothing to vote
    state = _saw_attempt(state, ev.attempt)
    key = round_key(ev)
    result = NodeResult(
        node=ev.node,
        ok=ev.status == "ok",
        accuracy=ev.accuracy,
        response_length=ev.response_length,
        verdicts=ev.verdicts,
        error=ev.error,
        sample_ids=ev.sample_ids,
        n_samples=ev.n_samples,
        samples_per_prompt=samples_per_prompt(ev),
        metrics={name: v for name, v in ev.metrics.items() if consensus_metric(name)},
    )
    votes, outcome = add_result(state.votes, key, ev.step, ev.replicas, result, now, cfg, ev.shard_nodes,
                                registered(state, now, cfg))
    return _vote_outputs(replace(state, votes=votes), outcome, ev.ts, cfg)


def round_key(ev: EvalEvent) -> RoundKey:
    """The vote round a result belongs to."""
    return RoundKey(ev.run_id, ev.eval_id, ev.dataset, ev.stage, ev.attempt)


def samples_per_prompt(ev: EvalEvent) -> int:
    """Consecutive sample ids that are answers to one prompt (`metrics["samples_per_prompt"]`,
    as areal_train publishes it; else 1): clustered in the consensus interval."""
    k = ev.metrics.get("samples_per_prompt")
    return int(k) if k is not None and float(k).is_integer() and 1 <= k <= 1 << 20 else 1


def registered(state: RunState, now: float | None = None, cfg: RunConfig | None = None) -> int | None:
    """Ranks that announced the current attempt (its `running`); None when none did. With `now`
    and `cfg`: only once that count has held for `step_wait_s` (the topics are read side by
    side, so a rank's `running` may come after a result; the vote's timeout uses the count as
    it is)."""
    lc = state.lifecycle
    if not lc.running_ranks:
        return None
    if now is not None and cfg is not None and (lc.ranks_changed_at is None
                                                or now - lc.ranks_changed_at < cfg.step_wait_s):
        return None
    return len(lc.running_ranks)


def on_command_ack(state: RunState, ev: CommandAckEvent, now: float,
                   cfg: RunConfig) -> tuple[RunState, list[Output]]:
    """A trainer node's acknowledgement of a command: remembered; `command_ignored` when it ignored it."""
    acks, alerts = on_ack(state.acks, ev.command_id, ev.command, ev.node, ev.status, ev.step, ev.detail)
    outputs = [Output(alert_event(state.run_id, a, ev.ts, ev.attempt)) for a in alerts]
    return replace(state, acks=acks), outputs


def on_run(state: RunState, ev: RunEvent, now: float, cfg: RunConfig) -> tuple[RunState, list[Output]]:
    """A rank's lifecycle news: the end of the stall watch, the trainer's eval interval."""
    lifecycle = on_run_event(state.lifecycle, ev.status, ev.rank, ev.world_size, ev.attempt)
    if lifecycle.running_ranks != state.lifecycle.running_ranks:
        lifecycle = replace(lifecycle, ranks_changed_at=now)
    trigger = state.trigger
    changes: dict[str, Any] = {}
    alerts = check_ended(state.lifecycle.ended and state.lifecycle.attempt == lifecycle.attempt, lifecycle.ended,
                         lifecycle.status, lifecycle.attempt, ev.rank, ev.exit_code)
    if ev.status == "running" and ev.attempt >= state.lifecycle.attempt:
        trigger = with_base_interval(trigger, published_interval(ev.config))
        if "eval_loop" in ev.config:  # the run's own loop settings (the latest `running` that carries them)
            changes["loop_overrides"], errors = eval_loop_overrides(ev.config.get("eval_loop"))
            alerts = [*alerts, *refused_loop_alerts(errors)]
        horizon = published_horizon(ev.config)
        overrides = changes.get("loop_overrides", state.loop_overrides)
        if horizon is not None and not _explicit_horizon(ev.config) and overrides.get("lr_horizon_rounds") != horizon:
            changes["loop_overrides"] = {**overrides, "lr_horizon_rounds": horizon}
        if changes.get("loop_overrides"):  # each key was checked alone; the rules across knobs hold too
            try:                           # (loop_config applies them at every event: it must not raise)
                cfg.with_overrides(changes["loop_overrides"])
            except ConfigError as exc:
                changes["loop_overrides"] = {}
                alerts = [*alerts, invalid_loop_alert(f"run.config.eval_loop: {exc}"[:300])]
    outputs = [Output(alert_event(state.run_id, a, ev.ts, lifecycle.attempt)) for a in alerts]
    return replace(state, lifecycle=lifecycle, trigger=trigger, **changes), outputs


def published_horizon(config: Mapping[str, Any]) -> int | None:
    """The run's horizon in rounds from its published `total_steps` and evaluation interval
    (None: either is missing): the rounds its loop keeps its false-alarm rate over."""
    total, interval = config.get("total_steps"), published_interval(config)
    if isinstance(total, bool) or not isinstance(total, int) or interval is None or not 1 <= total <= 1 << 40:
        return None
    return max(1, min(1_000_000, -(-total // interval)))


def _explicit_horizon(config: Mapping[str, Any]) -> bool:
    loop = config.get("eval_loop")
    return isinstance(loop, Mapping) and "horizon_rounds" in loop


REFUSED_KEYS_ALERTS = 8  # refused eval_loop keys of one run event named in an alert each; the rest in one more


def refused_loop_alerts(errors: list[str]) -> list[AlertDecision]:
    """An alert per refused key, up to REFUSED_KEYS_ALERTS, and one for the rest: a config of thousands of
    unknown keys (every rank's `running` repeats it) must not become thousands of alerts."""
    named = [invalid_loop_alert(e) for e in errors[:REFUSED_KEYS_ALERTS]]
    rest = errors[REFUSED_KEYS_ALERTS:]
    if rest:
        named.append(invalid_loop_alert(f"run.config.eval_loop: {len(rest)} more keys refused, the first: {rest[0]}"))
    return named


def invalid_loop_alert(error: str) -> AlertDecision:
    return AlertDecision(kind="invalid_config", severity="warning",
                         message=f"{error}; the worker's setting applies", about=("invalid_config", error))


def on_rejected(
    state: RunState, rejected: RejectedEvent, about: str, now: float, cfg: RunConfig
) -> tuple[RunState, list[Output]]:
    """A message that failed validation: the dead letter itself, and a rate-limited alert.

    `about` names the message (topic/partition/offset) so both ids are deterministic.
    """
    dead = rejected.replace(event_id=derived_id("rejected", about))
    previous = state.invalid.get(rejected.source_topic, InvalidState())
    invalid, alerts = check_invalid(previous, rejected.reason, rejected.source_topic, about, now, cfg)
    state = replace(state, invalid={**state.invalid, rejected.source_topic: invalid})
    outputs = [Output(dead, must_ack=False)]
    outputs.extend(Output(alert_event(state.run_id, a, rejected.ts)) for a in alerts)
    return state, outputs


def on_tick(state: RunState, now: float, cfg: RunConfig) -> tuple[RunState, list[Output]]:
    """The clock moved: steps whose ranks did not all come, stalled runs, vote timeouts."""
    ranks, ready = expire_ranks(state.ranks, now, cfg.step_wait_s)
    state, outputs = _smooth_all(replace(state, ranks=ranks), ready, cfg, None)
    stall, alerts = check_stalled(state.stall, now, cfg, ended=state.lifecycle.ended)
    outputs.extend(Output(alert_event(state.run_id, a, now, state.stall.last_attempt)) for a in alerts)
    votes, outcomes = recheck(state.votes, cfg, registered(state, now, cfg))
    votes, expired = expire(votes, now, cfg, registered(state))
    outcomes += expired
    state = replace(state, stall=stall, votes=votes)
    for outcome in outcomes:
        state, out = _vote_outputs(state, outcome, now, cfg)
        outputs.extend(out)
    return state, outputs


def has_clock_work(state: RunState, now: float, cfg: RunConfig) -> bool:
    """Cheap test whether `on_tick` could do anything (most ticks touch no run)."""
    waiting = oldest_wait(state.ranks)
    if waiting is not None and now - waiting >= cfg.step_wait_s:
        return True
    if any(now - r.opened_at >= cfg.vote_timeout_s for r in state.votes.open_rounds.values()):
        return True
    if state.votes.open_rounds:  # a round every registered rank answered, once that count is trusted
        trusted = registered(state, now, cfg)
        if trusted is not None and any(answered_all(r, trusted) for r in state.votes.open_rounds.values()):
            return True
    s = state.stall
    return bool(cfg.stall_seconds > 0 and not s.stalled and not state.lifecycle.ended
                and s.last_step_at is not None and now - s.last_step_at >= cfg.stall_seconds)


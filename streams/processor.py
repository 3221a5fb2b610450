"""One run's whole state and what each input does to it: the pure core the worker calls.

`on_step`, `on_eval`, `on_rejected`, `on_tick` take a `RunState`, an input and the worker
clock `now`, and return the new state and the `Output`s to send. Outputs are contract
records (producers.events) with deterministic event_ids, so re-sending one after a crash
deduplicates downstream. `Output.must_ack` marks outputs the worker must see delivered
before it saves the new state: once the state says "done", the input will not produce
them again. (`reward_smoothed` is exempt: a redelivered step re-sends its stored point.)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from producers.events import (
    AlertEvent,
    CommandEvent,
    EvalConsensusEvent,
    EvalEvent,
    Event,
    RejectedEvent,
    RewardSmoothedEvent,
    StepEvent,
)
from streams.alerts import (
    AlertDecision,
    BreachState,
    InvalidState,
    StallState,
    ThroughputState,
    check_invalid,
    check_reward,
    check_stalled,
    check_throughput,
    saw_step,
)
from streams import codec
from streams.config import RunConfig
from streams.smoothing import SmoothedPoint, SmoothingState, add_reward
from streams.triggers import CommandDecision, TriggerState, decide
from streams.voting import Consensus, NodeResult, RoundKey, VoteOutcome, VoteState, add_result, expire

WORKER_NODE = "areal-streams"  # the `node` of every event the worker derives
_ID_NAMESPACE = uuid.UUID("5d1f3c1e-6a57-4a53-9a8e-2f4b8c3e7a10")


def _id_part(part: object) -> str:
    # "\\" and "|" escaped: parts are joined without ambiguity (("a|b", "c") != ("a", "b|c")),
    # and parts without either character give the ids earlier versions gave.
    return str(part).replace("\\", "\\\\").replace("|", "\\|")


def derived_id(*parts: object) -> str:
    """Deterministic event id of a derived event: the same facts give the same id."""
    return uuid.uuid5(_ID_NAMESPACE, "|".join(_id_part(p) for p in parts)).hex


@dataclass(frozen=True, slots=True)
class Output:
    event: Event
    must_ack: bool = True


@dataclass(frozen=True, slots=True)
class RunState:
    run_id: str
    partition: int | None = None  # the input partition the run lives on (its clock ticks come there)
    smoothing: SmoothingState = SmoothingState()
    trigger: TriggerState = TriggerState()
    reward_alert: BreachState = BreachState(armed=False)  # see alerts.check_reward
    throughput: ThroughputState = ThroughputState()
    stall: StallState = StallState()
    votes: VoteState = field(default_factory=VoteState.empty)
    invalid: Mapping[str, InvalidState] = field(default_factory=dict)  # per source topic

    def to_json(self) -> bytes:
        return codec.dumps(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> RunState:
        """StateDecodeError (naming the field) for a record that is not a RunState."""
        return codec.loads(cls, raw)


# ------------------------------------------------------------------ records


def smoothed_event(run_id: str, point: SmoothedPoint, ts: float) -> RewardSmoothedEvent:
    return RewardSmoothedEvent(
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
    return CommandEvent(
        run_id=run_id,
        node=WORKER_NODE,
        ts=ts,
        event_id=derived_id("command", run_id, d.command, d.step, json.dumps(d.args, sort_keys=True)),
        command=d.command,
        args=d.args,
        reason=d.reason,
    )


def alert_event(run_id: str, a: AlertDecision, ts: float) -> AlertEvent:
    alert_id = derived_id("alert", run_id, *a.about)
    return AlertEvent(
        run_id=run_id,
        node=WORKER_NODE,
        ts=ts,
        event_id=alert_id,
        alert_id=alert_id,
        kind=a.kind,
        severity=a.severity,
        message=a.message,
        step=a.step,
        value=a.value,
        threshold=a.threshold,
    )


def consensus_event(c: Consensus, ts: float) -> EvalConsensusEvent:
    k = c.key
    return EvalConsensusEvent(
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
    )


def _vote_outputs(run_id: str, outcome: VoteOutcome, ts: float) -> list[Output]:
    out: list[Output] = []
    if outcome.consensus is not None:
        out.append(Output(consensus_event(outcome.consensus, ts)))
    out.extend(Output(alert_event(run_id, a, ts)) for a in outcome.alerts)
    return out


# ------------------------------------------------------------------ inputs


def on_step(state: RunState, ev: StepEvent, now: float, cfg: RunConfig) -> tuple[RunState, list[Output]]:
    outputs: list[Output] = []
    newest = state.stall.last_step is None or ev.step > state.stall.last_step
    if newest and ev.throughput is not None:
        throughput, alerts = check_throughput(state.throughput, ev.step, ev.throughput, cfg)
        state = replace(state, throughput=throughput)
        outputs.extend(Output(alert_event(state.run_id, a, ev.ts)) for a in alerts)
    state = replace(state, stall=saw_step(state.stall, ev.step, now))

    if ev.reward is None:
        return state, outputs
    smoothing, outcome = add_reward(state.smoothing, ev.step, ev.reward, cfg.window, cfg.ema_alpha, ev.event_id)
    point = outcome.point
    if outcome.kind == "duplicate":
        # A redelivery of the very event: re-send exactly what it produced. A copy of the
        # step from another rank adds nothing.
        if point is not None and point.source_id == ev.event_id:
            outputs.append(Output(smoothed_event(state.run_id, point, ev.ts), must_ack=False))
        return state, outputs
    if point is None:  # too late for the window
        return state, outputs
    state = replace(state, smoothing=smoothing)
    outputs.append(Output(smoothed_event(state.run_id, point, ev.ts), must_ack=False))
    if not outcome.is_newest:
        return state, outputs

    trigger, commands = decide(state.trigger, point, cfg)
    reward_alert, alerts, lr_commands = check_reward(state.reward_alert, point, cfg)
    state = replace(state, trigger=trigger, reward_alert=reward_alert)
    outputs.extend(Output(alert_event(state.run_id, a, ev.ts)) for a in alerts)
    outputs.extend(Output(command_event(state.run_id, c, ev.ts)) for c in (*lr_commands, *commands))
    return state, outputs


def on_eval(state: RunState, ev: EvalEvent, now: float, cfg: RunConfig) -> tuple[RunState, list[Output]]:
    key = RoundKey(ev.run_id, ev.eval_id, ev.dataset, ev.stage)
    result = NodeResult(
        node=ev.node,
        ok=ev.status == "ok",
        accuracy=ev.accuracy,
        response_length=ev.response_length,
        verdicts=ev.verdicts,
        error=ev.error,
    )
    votes, outcome = add_result(state.votes, key, ev.step, ev.replicas, result, now, cfg)
    return replace(state, votes=votes), _vote_outputs(state.run_id, outcome, ev.ts)


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
    """The clock moved: stalled runs, vote timeouts."""
    stall, alerts = check_stalled(state.stall, now, cfg)
    votes, outcomes = expire(state.votes, now, cfg)
    outputs = [Output(alert_event(state.run_id, a, now)) for a in alerts]
    for outcome in outcomes:
        outputs.extend(_vote_outputs(state.run_id, outcome, now))
    return replace(state, stall=stall, votes=votes), outputs


def has_clock_work(state: RunState, now: float, cfg: RunConfig) -> bool:
    """Cheap test whether `on_tick` could do anything (most ticks touch no run)."""
    if any(now - r.opened_at >= cfg.vote_timeout_s for r in state.votes.open_rounds.values()):
        return True
    s = state.stall
    return bool(cfg.stall_seconds > 0 and not s.stalled and s.last_step_at is not None
                and now - s.last_step_at >= cfg.stall_seconds)


def describe(state: RunState) -> dict[str, Any]:
    """A short summary for logs and debugging."""
    return {
        "run_id": state.run_id,
        "max_step": state.smoothing.max_step,
        "mode": state.trigger.mode,
        "interval": state.trigger.interval,
        "open_rounds": len(state.votes.open_rounds),
    }

"""Did the trainers do what the worker asked? `command_not_applied` and `command_ignored` (pure).

The worker remembers the `scale_lr` commands it sent a run (`sent`, the last `MAX_SENT`), and the
trainers acknowledge each command they handle (`command_ack` events, topic `acks`: applied from a
step, or ignored and why). Rules:

- `command_not_applied` (warning): a node of the run (one that publishes steps) has published a
  step at or beyond the command's `from_step` + `command_ack_steps` (the `AREAL_COMMAND_ACK_STEPS`
  setting) of the attempt the command was decided in, or a later attempt, and has acknowledged
  nothing for it. Once per command and node. A command with a `target_node` waits for that node only.
- `command_ignored` (info): a node said it ignored a command (the message carries its reason).
  Once per command and node.

An acknowledgement that comes after the warning does not take it back (the warning said the
node was late); acknowledgements of commands the worker did not send (a person's) are only
checked for `ignored`.
"""

from __future__ import annotations

from msgspec.structs import replace

from areal_metrics.streams.core.alerts import AlertDecision
from areal_metrics.streams.core.stored import Stored

MAX_SENT = 16  # scale_lr commands remembered per run (the loop sends at most one per round)
MAX_ACKED = 1024  # (command, node) pairs remembered per run


class SentCommand(Stored):
    command_id: str
    from_step: int
    attempt: int = 0
    target_node: str | None = None


class AckState(Stored):
    sent: tuple[SentCommand, ...] = ()
    acked: tuple[tuple[str, str], ...] = ()  # (command_id, node): acknowledged (applied or ignored)
    alerted: tuple[tuple[str, str], ...] = ()  # (command_id, node): command_not_applied raised


def on_sent(state: AckState, command_id: str, command: str, args: dict, attempt: int,
            target_node: str | None = None) -> AckState:
    """The worker sent a command: a `scale_lr` is watched until every node acknowledged it."""
    if command != "scale_lr" or any(s.command_id == command_id for s in state.sent):
        return state
    start = args.get("from_step", 0)
    start = start if isinstance(start, int) and not isinstance(start, bool) and start >= 0 else 0
    sent = (*state.sent, SentCommand(command_id, start, attempt, target_node))[-MAX_SENT:]
    kept = {s.command_id for s in sent}
    return replace(state, sent=sent, acked=tuple(p for p in state.acked if p[0] in kept),
                   alerted=tuple(p for p in state.alerted if p[0] in kept))


def on_ack(state: AckState, command_id: str, command: str, node: str, status: str, step: int | None,
           detail: str) -> tuple[AckState, list[AlertDecision]]:
    """A node's acknowledgement: remembered; an `ignored` one is a `command_ignored` alert (once)."""
    pair = (command_id, node)
    if pair in state.acked:
        return state, []
    state = replace(state, acked=(*state.acked, pair)[-MAX_ACKED:])
    if status != "ignored":
        return state, []
    at = f" at step {step}" if step is not None else ""
    return state, [AlertDecision(
        kind="command_ignored", severity="info", about=("command_ignored", command_id, node), step=step,
        message=f"node {node} ignored {command} {command_id}{at}: {detail or 'no reason given'}")]


def on_node_step(state: AckState, node: str, step: int, attempt: int,
                 ack_steps: int) -> tuple[AckState, list[AlertDecision]]:
    """A node published `step`: the watched commands it should have acknowledged by now and did not."""
    alerts: list[AlertDecision] = []
    alerted = state.alerted
    for s in state.sent:
        if attempt < s.attempt or step < s.from_step + ack_steps:
            continue
        if s.target_node is not None and s.target_node != node:
            continue
        pair = (s.command_id, node)
        if pair in state.acked or pair in alerted:
            continue
        alerted = (*alerted, pair)[-MAX_ACKED:]
        alerts.append(AlertDecision(
            kind="command_not_applied", severity="warning", about=("command_not_applied", s.command_id, node),
            step=step, value=float(step - s.from_step), threshold=float(ack_steps),
            message=(f"node {node} has not acknowledged scale_lr {s.command_id} (from step {s.from_step}) at "
                     f"step {step}, {step - s.from_step} steps after it (AREAL_COMMAND_ACK_STEPS {ack_steps}): "
                     "its trainer may not apply commands (docs/INTEGRATIONS.md)")))
    return (state if alerted is state.alerted else replace(state, alerted=alerted)), alerts

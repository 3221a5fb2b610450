"""Commands from the control topic: when they apply, and what they change (pure).

Rank 0 takes what arrived from `Run.commands()` (the public client's control
feed, which reads `areal.control` in a thread and keeps the commands for this
run and its node), the trainer broadcasts them in a `Control` (the records
themselves: a `CommandEvent` pickles, and is checked again as it is unpickled),
and every rank applies the same commands after the same step (`apply_commands`).

A `scale_lr` with `args.from_step` (the stream worker's closed loop) waits for
that step boundary: `due(pending, step)` holds it back until the step is
reached, and since every rank holds the same broadcast commands, every rank
applies it after the same step. The trainer keeps the scale at or above its
floor (`TrainConfig.lr_min_scale`). A `scale_lr` with `args.restore_step` (the
loop's rollback) also asks for the weights the run had at that step: the trainer
restores them when it kept them (`Session.restore_weights`), before the lower lr applies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from areal_metrics.producers.client.trainer_control import STALE_STOP, due, from_step, stale_stop
from areal_metrics.producers.contract.events import CommandEvent


@dataclass
class Applied:
    """What a step's commands changed, for the trainer to act on and report."""

    lr_factor: float = 1.0
    stop: bool = False
    count: int = 0
    restore_step: int | None = None  # the weights to restore first (the last such command's)


@dataclass(frozen=True)
class Control:
    """Rank 0's control of one step, broadcast to every rank: the commands that arrived and
    whether the time triggers (evaluation, checkpoint) are due at rank 0's clock `now`."""

    commands: tuple[CommandEvent, ...] = ()
    time_due: bool = False
    checkpoint_due: bool = False
    now: float = 0.0


# When a command is due is the public client's rule (`CommandApplier` uses it too); the trainer
# calls `due(pending, step)` after update `step`, so a command from step s changes the lr of
# update s + 1 on.
__all__ = ["STALE_STOP", "Applied", "Control", "apply_commands", "due", "from_step", "stale_stop"]


def apply_commands(commands: Iterable[CommandEvent], scheduler: Any) -> Applied:
    """Apply commands in order to the scheduler; return the rest for the trainer."""
    out = Applied()
    for cmd in commands:
        out.count += 1
        if cmd.command == "evaluate_now":
            scheduler.request()
        elif cmd.command == "set_eval_interval":
            scheduler.set_step_interval(int(cmd.args["steps"]))
        elif cmd.command == "scale_lr":
            out.lr_factor *= float(cmd.args["factor"])
            if "restore_step" in cmd.args:  # an integer >= 0: the contract checked it on reading
                out.restore_step = cmd.args["restore_step"]
        elif cmd.command == "stop":
            out.stop = True
    return out

"""When to evaluate and when to checkpoint: epoch, step and time triggers. Pure, time injected.

`Trigger` is one frequency control (as AReaL's `EpochStepTimeFreqCtl`): any
of its three triggers that is due fires, and each trigger that fired resets
only its own baseline (an evaluation forced by the step trigger does not
postpone the time trigger). Time is passed in, never read, so tests and the
distributed shell decide what "now" is: the trainer lets rank 0 decide
whether the time trigger is due and broadcasts that, so every rank acts at
the same step.

`EvalScheduler` is a trigger plus the evaluation commands
(`set_eval_interval` -> `set_step_interval`, `evaluate_now` -> `request`) and
the start option. The checkpoint schedule is a plain `Trigger`.

Both save and restore their state (`state_dict` / `load_state_dict`), so a
resumed run evaluates and checkpoints where the interrupted one would have.
Times are saved as ages ("the last time trigger fired 12 s before the
save"), so a restore on another clock keeps the intervals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STEP, EPOCH, TIME, START, COMMAND = "step", "epoch", "time", "start", "command"
TIME_SLACK_S = 1e-6


@dataclass
class Trigger:
    every_steps: int | None = None
    every_epochs: int | None = None
    every_seconds: float | None = None
    start_time: float = 0.0
    # baselines: the step / epoch / time at which each trigger last fired
    last_step: int = 0
    last_epoch: int = 0
    last_time: float = field(init=False)

    def __post_init__(self) -> None:
        self.last_time = self.start_time

    @property
    def can_fire(self) -> bool:
        """Whether any of the three triggers is set."""
        return self.every_steps is not None or self.every_epochs is not None or self.every_seconds is not None

    def time_due(self, now: float) -> bool:
        # a microsecond of slack: a restored baseline (now - time_since_last) is a few ulps off on another clock
        return self.every_seconds is not None and now - self.last_time >= self.every_seconds - TIME_SLACK_S

    def fire(self, step: int, epoch: int, time_due: bool, now: float) -> set[str]:
        """Reasons to act after update `step` in `epoch` (completed epochs); resets what fired.

        `time_due` is the (agreed) answer of `time_due`; `now` becomes the time
        baseline if the time trigger fires. Call this exactly once per step.
        """
        reasons: set[str] = set()
        if self.every_steps is not None and step - self.last_step >= self.every_steps:
            reasons.add(STEP)
            self.last_step = step
        if self.every_epochs is not None and epoch - self.last_epoch >= self.every_epochs:
            reasons.add(EPOCH)
            self.last_epoch = epoch
        if time_due and self.every_seconds is not None:
            reasons.add(TIME)
            self.last_time = now
        return reasons

    def state_dict(self, now: float) -> dict[str, Any]:
        return {"every_steps": self.every_steps, "every_epochs": self.every_epochs,
                "every_seconds": self.every_seconds, "last_step": self.last_step, "last_epoch": self.last_epoch,
                "time_since_last": now - self.last_time}

    def load_state_dict(self, state: dict[str, Any], now: float) -> None:
        self.every_steps = state["every_steps"]
        self.every_epochs = state["every_epochs"]
        self.every_seconds = state["every_seconds"]
        self.last_step = int(state["last_step"])
        self.last_epoch = int(state["last_epoch"])
        self.last_time = now - float(state["time_since_last"])


@dataclass
class EvalScheduler(Trigger):
    at_start: bool = False
    _requested: bool = field(default=False, init=False)
    _started: bool = field(default=False, init=False)

    @property
    def will_evaluate(self) -> bool:
        """Whether this schedule evaluates by itself (else only an `evaluate_now` command makes it)."""
        return self.at_start or self.can_fire

    # -- inputs --------------------------------------------------------------

    def set_step_interval(self, steps: int) -> None:
        """`set_eval_interval`: from now on every `steps` steps, counted from the last step-triggered eval."""
        if steps < 1:
            raise ValueError(f"eval interval must be >= 1 (got {steps})")
        self.every_steps = steps

    def request(self) -> None:
        """`evaluate_now`: evaluate at the next decision, whatever the triggers say."""
        self._requested = True

    # -- decisions -----------------------------------------------------------

    def before_training(self) -> set[str]:
        """Reasons to evaluate before the first update (the `at_start` option), once."""
        if self._started:
            return set()
        self._started = True
        return {START} if self.at_start else set()

    def after_step(self, step: int, epoch: int, time_due: bool, now: float) -> set[str]:
        """Reasons to evaluate now, after update `step` (see `Trigger.fire`), commands included."""
        self._started = True
        reasons = self.fire(step, epoch, time_due, now)
        if self._requested:
            reasons.add(COMMAND)
            self._requested = False
        return reasons

    def state_dict(self, now: float) -> dict[str, Any]:
        return {**super().state_dict(now), "requested": self._requested, "started": self._started}

    def load_state_dict(self, state: dict[str, Any], now: float) -> None:
        super().load_state_dict(state, now)
        self._requested = bool(state["requested"])
        self._started = bool(state["started"])

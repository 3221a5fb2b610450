"""When to evaluate: epoch, step and time triggers plus commands. Pure, time injected.

Any trigger that is due fires the evaluation, and each trigger that fired
resets only its own baseline (an evaluation forced by the step trigger does
not postpone the time trigger). Time is passed in, never read, so tests and
the distributed shell decide what "now" is: the trainer lets rank 0 decide
whether the time trigger is due and broadcasts that, so every rank evaluates
at the same step.

Adaptive commands (`set_eval_interval`, `evaluate_now`) arrive through
`set_step_interval` and `request`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STEP, EPOCH, TIME, START, COMMAND = "step", "epoch", "time", "start", "command"


@dataclass
class EvalScheduler:
    every_steps: int | None = None
    every_epochs: int | None = None
    every_seconds: float | None = None
    at_start: bool = False
    start_time: float = 0.0
    # baselines: the step / epoch / time of the last evaluation each trigger caused
    last_step: int = 0
    last_epoch: int = 0
    last_time: float = field(init=False)
    _requested: bool = field(default=False, init=False)
    _started: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.last_time = self.start_time

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

    def time_due(self, now: float) -> bool:
        return self.every_seconds is not None and now - self.last_time >= self.every_seconds

    def before_training(self) -> set[str]:
        """Reasons to evaluate before the first update (the `at_start` option), once."""
        if self._started:
            return set()
        self._started = True
        return {START} if self.at_start else set()

    def after_step(self, step: int, epoch: int, time_due: bool, now: float) -> set[str]:
        """Reasons to evaluate now, after update `step` in `epoch` (completed epochs).

        `time_due` is the (agreed) answer of `time_due`; `now` becomes the time
        baseline if the time trigger fires. The baselines of the triggers that
        fire are reset here, so call this exactly once per step.
        """
        self._started = True
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
        if self._requested:
            reasons.add(COMMAND)
            self._requested = False
        return reasons

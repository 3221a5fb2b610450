"""Commands applied to a torch training loop: `CommandApplier` (public: `areal_metrics.CommandApplier`).

    import areal_metrics as am
    run = am.init(...)
    control = am.CommandApplier(run, optimizer, scheduler, model=model, keep_rounds=3)
    for step in range(start, steps):
        due = control.at_step(step)        # before update `step`: the commands due now
        if due.stop: break
        loss = ...; loss.backward(); optimizer.step(); scheduler.step()
        run.log({"lr": scheduler.get_last_lr()[0], ...}, step=step)
        if due.evaluate or step % control.eval_interval(50) == 0:
            run.log_eval(...); control.keep(step)   # the weights a rollback may restore

What `at_step(step)` does, before the update numbered `step` (the step you log it at):

- `scale_lr` `{"factor": f, "from_step": s}` waits until `step >= s`, then multiplies the
  learning rate of every parameter group, and what the schedule multiplies, by `f`: each torch
  `LRScheduler`'s `base_lrs` and last lr (HF's `LambdaLR` schedules recompute the lr from
  `base_lrs` at every `step()`), `eta_min` (`CosineAnnealing*`), `max_lrs` (`CyclicLR`), the
  groups' `initial_lr` / `max_lr` / `min_lr` (`OneCycleLR`), and every scheduler inside a
  `SequentialLR` or `ChainedScheduler`. The schedule then goes on at `f` x its own value. The
  cumulative factor stays within [`lr_min_factor`, 1]: a command that would leave it is
  applied up to the bound. The update `s` is the first at the new lr.
- `restore_step` in a `scale_lr`: first the weights of that step back, from a snapshot this
  applier kept (`keep(step)`, host memory, the last `keep_rounds`: the trainable parameters of
  `model` and the optimizer's state) or from `restore(step)` (a checkpoint loader of yours: True
  when it restored them, the step of the weights it restored instead, e.g. the newest checkpoint
  before it, or False, or why not); when neither has them, the factor alone, and the acknowledgement says why.
- `evaluate_now`, `set_eval_interval`, `stop`: flags of the `Due` returned (`evaluate`,
  `eval_interval`, `stop`) for the loop to read. `ignore={"evaluate_now": "why"}` names
  commands this loop cannot carry out: they are acknowledged as ignored, with the reason.
- Every rank applies a command at the same step: with `torch.distributed` initialised and
  more than one process, rank 0 takes the commands (`run.commands()`; the other ranks do not
  read their feed: they pass their own run, to acknowledge what they apply, or `run=None`; rank 0
  reads every node's commands for them, and a command with a `target_node` is acknowledged as
  ignored by the node it names, since one rank cannot move alone) and
  broadcasts them at each `at_step` (one small object broadcast of the `CommandEvent` records
  themselves: a record pickles, and is checked again as it is unpickled), so every rank must
  call `at_step` at the same steps. `sync=` replaces that broadcast: it takes rank 0's commands
  in their JSON form (a list of `CommandEvent.to_dict()` dicts, which any transport carries:
  JSON over a store, MPI, a Ray actor) and returns that list on every rank (dicts, or the
  records themselves); a hook written for dicts keeps working.
- Each command applied or ignored is acknowledged on the run (`command_ack` events, CONTRACT.md:
  the step, the cumulative factor, or why not), so the stream worker sees what the loop did.
- `state_dict()` / `load_state_dict()`: the cumulative factor, the ids of the commands applied,
  the ones still waiting for their step, the interval (a `stop` is not carried: a resumed attempt
  goes on, and says the checkpoint's had stopped), and the time the run's first attempt started
  reading commands; save it in the same checkpoint as the optimizer and scheduler (which hold the
  scaled lrs), and a resumed attempt neither applies a command twice nor forgets one waiting, nor
  one that came after the checkpoint: it reads the control topic again from that time
  (`run.commands(since=...)`) and handles every command the checkpoint had not (a `stop` sent
  before it started excepted: acknowledged as ignored).

Nothing changes in training unless a command arrives; `at_step` never raises into the loop for a
command (a failure is logged and acknowledged as ignored). torch is imported only by the methods
that touch it: the client's thin install does not need it until an applier is built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from areal_metrics.producers.contract.events import CommandEvent, event_from_dict

log = logging.getLogger("areal_metrics.client.commands")

LR_MIN_FACTOR = 0.125  # the stream worker's default floor (streams config lr_min_factor)
_EPS = 1e-12
# param-group keys that hold a learning rate a schedule starts from (OneCycleLR keeps them there)
_GROUP_LR_KEYS = ("initial_lr", "max_lr", "min_lr")


# ---------------------------------------------------------------- pure: when a command applies


STALE_STOP = "a stop sent before this attempt started: the resumed attempt goes on (send stop again)"


def stale_stop(command: CommandEvent, started: Any) -> bool:
    """A `stop` that a resumed attempt reads again (it reads the control topic from the first attempt's start),
    sent before this attempt started (`started`, the run's): it ended the attempt it was sent to, not this one."""
    return command.command == "stop" and isinstance(started, (int, float)) and command.ts < started


def from_step(command: CommandEvent) -> int:
    """The step from which a command applies (0: at once); only `scale_lr` waits."""
    value = command.args.get("from_step") if command.command == "scale_lr" else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else 0


def due(pending: list[CommandEvent], step: int) -> tuple[list[CommandEvent], list[CommandEvent]]:
    """(the commands due at `step`, in arrival order; those that wait for a later step)."""
    return [c for c in pending if from_step(c) <= step], [c for c in pending if from_step(c) > step]


def bounded_factor(current: float, factor: float, lr_min_factor: float) -> float:
    """The cumulative lr factor after `factor`, kept within [lr_min_factor, 1]."""
    return min(1.0, max(lr_min_factor, current * factor))


@dataclass
class Due:
    """What the commands applied at one step ask of the loop (and what they changed)."""

    step: int
    evaluate: bool = False
    stop: bool = False
    eval_interval: int | None = None  # the latest set_eval_interval's steps
    lr_factor: float = 1.0  # the cumulative factor after this step's commands
    restored_step: int | None = None  # the weights put back at this step
    applied: list[CommandEvent] = field(default_factory=list)
    ignored: list[tuple[CommandEvent, str]] = field(default_factory=list)


# ---------------------------------------------------------------- the applier


class CommandApplier:
    """Apply the control commands to a torch optimizer (and LR scheduler) at step boundaries; module doc."""

    def __init__(self, run: Any, optimizer: Any = None, scheduler: Any = None, *, model: Any = None,
                 keep_rounds: int = 0, restore: Callable[[int], bool | int | str] | None = None,
                 lr_min_factor: float = LR_MIN_FACTOR, ignore: Mapping[str, str] | None = None,
                 sync: Callable[[list[dict[str, Any]]], Sequence[dict[str, Any] | CommandEvent]] | None = None
                 ) -> None:
        if not 0 < lr_min_factor <= 1:
            raise ValueError(f"CommandApplier: lr_min_factor must be in (0, 1] (got {lr_min_factor})")
        if keep_rounds < 0:
            raise ValueError(f"CommandApplier: keep_rounds must be >= 0 (got {keep_rounds})")
        if keep_rounds and model is None:
            raise ValueError("CommandApplier: keep_rounds needs model= (the weights to keep)")
        self.run = run
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.model = model
        self.keep_rounds = keep_rounds
        self.restore = restore
        self.lr_min_factor = lr_min_factor
        self.ignore = dict(ignore or {})
        self._sync = sync
        self.factor = 1.0
        self.interval: int | None = None
        self.stopped = False
        self.applied_ids: list[str] = []
        self._applied: set[str] = set()
        self.waiting: list[CommandEvent] = []
        self.kept: dict[int, dict[str, Any]] = {}
        self._inbox: list[CommandEvent] = []
        self._since: float | None = None  # a resumed attempt's: the control topic read again from this time

    # ------------------------------------------------------------ the call per step

    def at_step(self, step: int) -> Due:
        """Apply the commands due before update `step` (every rank calls this at the same steps)."""
        out = Due(step, stop=self.stopped, eval_interval=self.interval, lr_factor=self.factor)
        try:
            arrived = self._arrived(step, out)
        except Exception as exc:  # noqa: BLE001 - monitoring never stops training
            log.warning("commands at step %d not read: %s", step, exc)
            return out
        commands, self.waiting = due([*self.waiting, *arrived], step)
        together = self._together()
        for command in commands:
            if command.event_id in self._applied:
                continue  # seen before (a resumed attempt reading it again)
            self._remember(command.event_id)
            if together and command.target_node is not None:
                # one rank cannot change the lr (or stop, or evaluate) alone in a loop whose ranks move
                # together: the node it names says so; the others have nothing to acknowledge
                if command.target_node == getattr(self.run, "node", None):
                    why = (f"the ranks of a distributed loop apply commands together: send it to the run, "
                           f"without target_node {command.target_node!r}")
                    out.ignored.append((command, why))
                    self._ack(command, "ignored", step, why)
                continue
            try:
                status, detail = self._apply(command, step, out)
            except Exception as exc:  # noqa: BLE001
                status, detail = "ignored", f"failed: {type(exc).__name__}: {exc}"[:512]
                log.warning("command %s at step %d %s", command.command, step, detail)
            if status == "applied":
                out.applied.append(command)
            else:
                out.ignored.append((command, detail or status))
            self._ack(command, status, step, detail)
        out.lr_factor, out.stop, out.eval_interval = self.factor, self.stopped, self.interval
        return out

    def submit(self, commands: Iterable[CommandEvent]) -> None:
        """Commands this process drained from `run.commands()` itself (on rank 0): they join the next
        `at_step`'s, so a loop that read the feed before the applier existed loses none."""
        self._inbox.extend(commands)

    def eval_interval(self, default: int) -> int:
        """The evaluation interval a `set_eval_interval` set, else `default`."""
        return self.interval or default

    # ------------------------------------------------------------ rollback

    def keep(self, step: int) -> None:
        """Keep the weights of `step` (an evaluated round) for a `restore_step`: the trainable parameters
        of `model` and the optimizer's state, in host memory, the last `keep_rounds` steps."""
        if not self.keep_rounds or self.model is None:
            return
        try:
            self.kept[step] = {
                "params": {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()
                           if p.requires_grad},
                "optimizer": (_to_cpu(_inner_optimizer(self.optimizer).state_dict()["state"])
                              if self.optimizer else None)}
        except Exception as exc:  # noqa: BLE001 - an optimizer without torch's state_dict shape: never into the loop
            self.kept.pop(step, None)
            log.warning("the weights of step %d not kept (a rollback to it applies the factor alone): %s: %s",
                        step, type(exc).__name__, exc)
            return
        for old in sorted(self.kept)[:-self.keep_rounds]:
            del self.kept[old]

    def _restore_weights(self, step: int) -> tuple[int | None, str | None]:
        """Put back the weights of `step`: (the step whose weights were restored, None) or (None, why not)."""
        snapshot = self.kept.get(step)
        if snapshot is not None:
            import torch

            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, value in snapshot["params"].items():
                    params[name].copy_(value.to(params[name].device))
            if self.optimizer is not None and snapshot["optimizer"] is not None:
                inner = _inner_optimizer(self.optimizer)
                current = inner.state_dict()  # the groups as they are now: their lrs stay
                inner.load_state_dict({"state": snapshot["optimizer"], "param_groups": current["param_groups"]})
            return step, None
        if self.restore is not None:
            done = self.restore(step)
            if done is True:
                return step, None
            if isinstance(done, int) and not isinstance(done, bool):
                return done, None
            return None, done if isinstance(done, str) and done else f"restore({step}) did not restore them"
        kept = ", ".join(map(str, sorted(self.kept))) or "none"
        return None, f"the weights of step {step} were not kept (kept: {kept})"

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        state = {"factor": self.factor, "applied": list(self.applied_ids), "interval": self.interval,
                 "stopped": self.stopped, "waiting": [c.to_dict() for c in self.waiting]}
        since = self._since if self._since is not None else getattr(self.run, "commands_since", None)
        if isinstance(since, (int, float)):  # the run's first attempt's start: from where a resumed one reads again
            state["commands_since"] = float(since)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The applier's state from a checkpoint. The lrs themselves come back with the optimizer's and the
        scheduler's state of the same checkpoint: nothing is applied again here."""
        self.factor = float(state["factor"])
        self.applied_ids, self._applied = [], set()
        for event_id in state["applied"]:
            self._remember(str(event_id))
        self.interval = state.get("interval")
        # a `stop` ended the attempt that obeyed it: one resumed from its checkpoint is started to go on
        # (its id stays applied, so it is not obeyed again); before, it stopped after one update, unsaid
        self.stopped = False
        if state.get("stopped"):
            log.warning("the checkpoint's attempt had stopped on a `stop` command; this attempt goes on "
                        "(send stop again to stop it)")
        self.waiting = [event_from_dict(c, CommandEvent) for c in state.get("waiting", ())]
        # The commands that came after this checkpoint was saved went with the attempt that crashed (their lr
        # and weights with it): the feed reads the control topic again from the first attempt's start, and
        # every command not handled here (by id) is handled again (a `stop` for an earlier attempt excepted)
        since = state.get("commands_since")
        self._since = float(since) if isinstance(since, (int, float)) and not isinstance(since, bool) else None

    # ------------------------------------------------------------ inside

    def _arrived(self, step: int, out: Due) -> list[CommandEvent]:
        inbox, self._inbox = self._inbox, []
        reads = self.run is not None and self._leads()  # only rank 0 reads the feed when ranks agree
        mine = [*inbox, *(self._read() if reads else ())]
        if reads and self._since is not None:  # decided where they are read, before every rank gets them
            # a resumed attempt reads again what its checkpoint had handled: not handed to the ranks (one whose
            # node kept no state would apply it again), and a stop sent before it started is not obeyed
            mine = self._without_stale_stops([c for c in mine if c.event_id not in self._applied], step, out)
        return self._broadcast(mine)

    def _without_stale_stops(self, commands: list[CommandEvent], step: int, out: Due) -> list[CommandEvent]:
        """A resumed attempt's commands less the `stop`s sent before it started (`stale_stop`), each
        acknowledged as ignored once. Decided on the rank that reads them: the others have no run (and no
        start time) to decide by, and a stop obeyed by some ranks alone would hang the rest."""
        started = getattr(self.run, "started", None)
        kept = []
        for command in commands:
            if not stale_stop(command, started):
                kept.append(command)
            elif command.event_id not in self._applied:
                self._remember(command.event_id)
                out.ignored.append((command, STALE_STOP))
                self._ack(command, "ignored", step, STALE_STOP)
        return kept

    def _read(self) -> list[CommandEvent]:
        """The run's new commands: when the ranks move together, every node's (rank 0 reads for all of
        them, and each rank then sees those naming it: `at_step`)."""
        since = {"since": self._since} if self._since is not None else {}
        if self._together():
            try:
                return list(self.run.commands(every_node=True, **since))
            except TypeError:  # a run of the user's own whose commands() takes no keyword: as it gives them
                pass
        try:
            return list(self.run.commands(**since))
        except TypeError:
            return list(self.run.commands())

    def _together(self) -> bool:
        """Whether every rank applies the same commands (a `sync=` hook, or torch.distributed)."""
        return self._sync is not None or self._dist() is not None

    def _leads(self) -> bool:
        """Whether this process's commands are the ones every rank applies (rank 0, or no distribution)."""
        if self._sync is not None:
            return True
        dist = self._dist()
        return dist is None or dist.get_rank() == 0

    @staticmethod
    def _dist() -> Any:
        """torch.distributed when it is initialised with more than one process, else None."""
        import sys

        if "torch" not in sys.modules:  # nothing distributed without torch
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return dist

    def _broadcast(self, mine: list[CommandEvent]) -> list[CommandEvent]:
        """Rank 0's commands on every rank: the records, in one `broadcast_object_list`; or through
        the user's `sync=`, which carries their JSON form (dicts, read back as records)."""
        if self._sync is not None:
            shared = self._sync([c.to_dict() for c in mine])
            return [c if isinstance(c, CommandEvent) else event_from_dict(c, CommandEvent) for c in shared]
        dist = self._dist()
        if dist is None:
            return mine
        holder: list[list[CommandEvent] | None] = [mine if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        return list(holder[0] or [])

    def _apply(self, command: CommandEvent, step: int, out: Due) -> tuple[str, str | None]:
        """Apply one command: ("applied", a note or None) or ("ignored", why)."""
        name = command.command
        if name in self.ignore:
            return "ignored", self.ignore[name]
        if name == "evaluate_now":
            out.evaluate = True
        elif name == "stop":
            self.stopped = True
        elif name == "set_eval_interval":
            self.interval = int(command.args["steps"])
        elif name == "scale_lr":
            return self._scale_lr(command, step, out)
        else:
            return "ignored", f"unknown command {name!r}"
        return "applied", None

    def _scale_lr(self, command: CommandEvent, step: int, out: Due) -> tuple[str, str | None]:
        if self.optimizer is None:
            return "ignored", "no optimizer was given to the applier"
        notes = []
        restore = command.args.get("restore_step")
        if restore is not None:
            try:
                outcome = self._restore_weights(int(restore))
            except Exception as exc:  # noqa: BLE001 - every rank must still reach the comparison in _agreed
                outcome = None, f"restoring failed: {type(exc).__name__}: {exc}"[:512]
            restored, why = self._agreed(*outcome)
            if restored is not None:
                out.restored_step = restored
                notes.append(f"weights of step {restored} restored" +
                             (f" (the newest kept at or before step {restore})" if restored != restore else ""))
            else:
                notes.append(f"factor alone: {why}")
                log.warning("scale_lr at step %d: %s", step, notes[-1])
        new = bounded_factor(self.factor, float(command.args["factor"]), self.lr_min_factor)
        if abs(new - self.factor * float(command.args["factor"])) > _EPS:
            notes.append(f"cumulative factor kept at {new:g} (bounds [{self.lr_min_factor:g}, 1])")
        ratio = new / self.factor
        if abs(ratio - 1.0) > _EPS:
            scale_schedule(self.optimizer, self.scheduler, ratio)
        self.factor = new
        log.info("scale_lr at step %d: lr factor %g%s", step, new, "".join(f"; {n}" for n in notes))
        return "applied", "; ".join(notes) or None

    def _agreed(self, restored: int | None, why: str | None) -> tuple[int | None, str | None]:
        """Every rank's restore, the same on all (torch.distributed): each rank restores from its own snapshot
        or loader, and ranks that disagree would part ways (one evaluating the restored weights waits in a
        collective the others never join). Where they disagree, none counts as restored, and why says which
        rank did what: the replicas' weights then differ, which only a checkpoint mends."""
        dist = self._dist()
        if dist is None:
            return restored, why
        everyone: list[int | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, restored)
        if len(set(everyone)) == 1:
            return restored, why
        said = ", ".join(f"rank {r}: {'step ' + str(s) if s is not None else 'not restored'}"
                         for r, s in enumerate(everyone))
        log.error("scale_lr: the ranks disagree on the restored weights (%s); the replicas now differ", said)
        return None, f"the ranks disagree on the restored weights ({said}): the replicas now differ"

    def _remember(self, event_id: str) -> None:
        self._applied.add(event_id)
        self.applied_ids.append(event_id)
        if len(self.applied_ids) > 4096:  # bounded: the oldest commands cannot come back
            self._applied.discard(self.applied_ids.pop(0))

    def _ack(self, command: CommandEvent, status: str, step: int, detail: str | None) -> None:
        acknowledge = getattr(self.run, "acknowledge", None)
        if acknowledge is None:
            return
        try:
            acknowledge(command, status, step=step, lr_factor=self.factor, detail=detail)
        except Exception as exc:  # noqa: BLE001 - never into the loop
            log.warning("acknowledgement of %s not sent: %s", command.command, exc)


# ---------------------------------------------------------------- torch: what a schedule multiplies


def scale_schedule(optimizer: Any, scheduler: Any, ratio: float) -> None:
    """Multiply the current lr of every group of `optimizer`, and what `scheduler` (any torch LRScheduler,
    chained ones included, HF/accelerate wrappers unwrapped) computes it from, by `ratio`."""
    for group in _inner_optimizer(optimizer).param_groups:
        _scale_key(group, "lr", ratio)
        for key in _GROUP_LR_KEYS:
            if key in group:
                _scale_key(group, key, ratio)
    for sched in _schedulers(scheduler):
        for name in ("base_lrs", "max_lrs", "_last_lr"):
            values = getattr(sched, name, None)
            if isinstance(values, list):
                setattr(sched, name, [_scaled(v, ratio) for v in values])
        eta_min = getattr(sched, "eta_min", None)
        if isinstance(eta_min, (int, float)) and not isinstance(eta_min, bool):
            sched.eta_min = eta_min * ratio


def _schedulers(scheduler: Any) -> Iterable[Any]:
    """The scheduler and the ones inside it (SequentialLR, ChainedScheduler; accelerate's wrapper)."""
    seen: set[int] = set()
    todo = [scheduler]
    while todo:
        s = todo.pop()
        if s is None or id(s) in seen:
            continue
        seen.add(id(s))
        yield s
        inner = getattr(s, "scheduler", None)  # accelerate's AcceleratedScheduler
        if inner is not None and not isinstance(inner, (str, bytes)):
            todo.append(inner)
        todo.extend(getattr(s, "_schedulers", None) or ())


def _inner_optimizer(optimizer: Any) -> Any:
    """accelerate's AcceleratedOptimizer (and the like) wraps the torch optimizer as `.optimizer`."""
    import torch

    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer


def _scale_key(group: dict[str, Any], key: str, ratio: float) -> None:
    value = group[key]
    if hasattr(value, "mul_"):  # a tensor lr (capturable optimizers): in place
        value.mul_(ratio)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        group[key] = value * ratio


def _scaled(value: Any, ratio: float) -> Any:
    if hasattr(value, "mul"):
        return value.mul(ratio)
    return value * ratio if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _to_cpu(state: Any) -> Any:
    """An optimizer's state with every tensor copied to host memory."""
    if hasattr(state, "detach"):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_cpu(v) for v in state)
    return state


__all__ = ["CommandApplier", "Due", "bounded_factor", "due", "from_step", "scale_schedule"]

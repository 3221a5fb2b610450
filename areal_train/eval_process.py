"""The evaluation process: rounds on weight snapshots, outside the training interpreter.

Started by `evaluator.Evaluator` in `async` mode, one per rank: spawned (a
fresh interpreter), or forked as a `Standby` by the rank's entry point before
the rank starts any thread, so that it inherits the imported torch instead of
importing it again (2-3 s of CPU per process on 2 cores). It
receives the evaluation sets once, then jobs (a `RoundJob` and a snapshot of
the weights); it sends back each stage's `Outcome` as soon as it is done and
then ("done", round_no, memory). It owns the quick-stage memory between
rounds, and its own client of the ranks' store for adjudication (`board`). `cpu_share` < 1 makes it pause after each generation batch for as
long as the share asks (0.5: as long as the batch took), so evaluation takes
at most that share of a core from training; when training is over (the trainer
waits for the last rounds) it runs them without pauses.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from areal_metrics.areal_train.board import open_board
from areal_metrics.areal_train.evalsets import EvalSet, adjudicates
from areal_metrics.areal_train.evaluation import Board, Outcome, RoundJob, StageMemory, TwoStage, run_round


class EventLike(Protocol):  # multiprocessing's Event (its class is not public)
    def set(self) -> None: ...
    def wait(self, timeout: float | None = None) -> bool: ...


@dataclass(frozen=True)
class ProcessSpec:
    model: dict[str, int]  # Policy(**model)
    sets: dict[str, EvalSet]
    device: str
    threads: int
    cpu_share: float
    rule: TwoStage
    memory: dict[str, StageMemory]


def pause_for(busy_seconds: float, cpu_share: float) -> float:
    """Seconds to sleep after `busy_seconds` of work so the work is `cpu_share` of the time."""
    if cpu_share >= 1.0:
        return 0.0
    return busy_seconds * (1.0 / cpu_share - 1.0)


def make_pause(cpu_share: float, unthrottled: EventLike | None) -> Callable[[float], None]:
    """After `busy` seconds of work, sleep for the CPU share; no sleep, or the end of one, once
    `unthrottled` is set."""
    def pause(busy: float) -> None:
        seconds = pause_for(busy, cpu_share)
        if unthrottled is None:
            time.sleep(seconds)
        elif seconds > 0:
            unthrottled.wait(seconds)
    return pause


def main(conn: Connection, spec: ProcessSpec, unthrottled: EventLike | None = None) -> None:
    """Evaluate rounds until told to stop; once `unthrottled` is set (training is over), without pauses."""
    import torch

    from areal_metrics.areal_train.policy import Policy

    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    policy = Policy(**spec.model).to(device).eval()
    memory = dict(spec.memory)

    def emit(outcome: Outcome) -> None:
        conn.send(("outcome", outcome))

    pause = make_pause(spec.cpu_share, unthrottled)
    board: Board | None = None  # opened at the first round with adjudication
    while True:
        try:
            message: tuple[Any, ...] = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if message[0] == "stop":
            return
        _, job, weights = message
        assert isinstance(job, RoundJob)
        policy.load_state_dict(weights)
        if board is None and adjudicates(job.world_size, job.replicas):
            board = open_board()
        memory = run_round(policy, spec.sets, job, memory, spec.rule, emit, device, pause, board)
        conn.send(("done", job.round_no, memory))


@dataclass
class Standby:
    """An evaluation process forked ahead of need: it waits for ("spec", ProcessSpec), then runs `main`,
    or exits on ("stop",) or when the trainer's end of the pipe closes."""

    process: mp.process.BaseProcess
    conn: Connection
    unthrottled: EventLike


def fork_standby() -> Standby:
    """Fork the evaluation process now. Only while this process runs no other thread: a forked child
    holds copies of every lock, and one held by a thread that does not exist there would never open."""
    context = mp.get_context("fork")
    parent, child = context.Pipe()
    unthrottled = context.Event()
    process = context.Process(target=_standby_main, args=(child, parent, unthrottled), name="areal-eval",
                              daemon=True)
    process.start()
    child.close()
    return Standby(process, parent, unthrottled)


def _standby_main(conn: Connection, trainer_end: Connection, unthrottled: EventLike) -> None:
    trainer_end.close()  # the fork copied the trainer's end: closed here, the trainer's exit reads as EOF
    try:
        message = conn.recv()
    except EOFError:
        return
    if message[0] == "spec":
        main(conn, message[1], unthrottled)

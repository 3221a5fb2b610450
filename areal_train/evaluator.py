"""The trainer's side of evaluation: inline (`sync`) or in an evaluation process (`async`).

`submit(policy, job)` evaluates a round now (sync) or sends a snapshot of the
weights and the job to this rank's evaluation process (async) and returns at
once; `poll()` hands finished outcomes to `on_outcome` (async: whatever has
arrived, never waiting). At most `max_pending` rounds are in the process at
a time; `busy()` says whether another would exceed that, and the trainer
skips (and records) a round while any rank is busy, so the ranks stay in
step. If the process dies, its pending rounds are reported failed and the
next round starts a new one.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from areal_metrics.areal_train.board import open_board
from areal_metrics.areal_train.eval_process import EventLike, ProcessSpec, Standby
from areal_metrics.areal_train.eval_process import main as process_main
from areal_metrics.areal_train.evalsets import EvalSet, adjudicates
from areal_metrics.areal_train.evaluation import Board, Outcome, RoundJob, StageMemory, TwoStage, run_round
from areal_metrics.areal_train.policy import Policy

log = logging.getLogger(__name__)


@dataclass
class Evaluator:
    sets: dict[str, EvalSet]
    on_outcome: Callable[[Outcome], None]
    model: dict[str, int]  # Policy(**model), for the process's copy
    device: torch.device
    asynchronous: bool = False
    rule: TwoStage = field(default_factory=TwoStage)
    threads: int = 1
    cpu_share: float = 1.0
    max_pending: int = 1
    memory: dict[str, StageMemory] = field(default_factory=dict)  # the quick stage's, as of the last finished round
    # async: start the process now, so that its interpreter starts while training does; False
    # (a run with no scheduled evaluation): at the first round, if any (an `evaluate_now`)
    start_early: bool = True
    # async: a process forked before the rank's threads started (`eval_process.fork_standby`), used
    # for the first process instead of spawning one; a later one (after a crash) is spawned
    standby: Standby | None = None
    # sync: where the ranks exchange verdicts for adjudication (opened at the first round that needs it)
    board: Board | None = None

    def __post_init__(self) -> None:
        self._process: mp.process.BaseProcess | None = None
        self._conn = None
        self._unthrottled: EventLike | None = None  # the process's: set when training is over
        self._pending: dict[int, RoundJob] = {}
        if self.asynchronous and self.start_early:
            self._ensure_process()

    def wait_idle(self, timeout: float) -> None:
        """Wait (up to `timeout` s) until another round would not be skipped: a forced round (the first, the last, a
        restore's), so an asynchronous run pauses training for it."""
        deadline = time.monotonic() + timeout
        while self.asynchronous and len(self._pending) >= self.max_pending and time.monotonic() < deadline:
            self.poll(timeout=0.5)

    # -- the trainer's calls ------------------------------------------------------

    def busy(self) -> bool:
        self.poll()
        return self.asynchronous and len(self._pending) >= self.max_pending

    def submit(self, policy: Policy, job: RoundJob) -> None:
        if not self.asynchronous:
            was_training = policy.training
            policy.eval()
            if self.board is None and adjudicates(job.world_size, job.replicas):
                self.board = open_board()
            self.memory = run_round(policy, self.sets, job, self.memory, self.rule, self.on_outcome, self.device,
                                    board=self.board)
            policy.train(was_training)
            return
        self._ensure_process()
        weights = {k: v.detach().to("cpu", copy=True) for k, v in policy.state_dict().items()}
        self._pending[job.round_no] = job
        assert self._conn is not None
        self._conn.send(("round", job, weights))

    def poll(self, timeout: float = 0.0) -> None:
        """Deliver what the process has sent; wait up to `timeout` seconds for the first message."""
        if self._conn is None:
            return
        try:
            while self._conn.poll(timeout):
                timeout = 0.0
                message = self._conn.recv()
                if message[0] == "outcome":
                    self.on_outcome(message[1])
                elif message[0] == "done":
                    self._pending.pop(message[1], None)
                    self.memory = message[2]
        except (EOFError, OSError):
            pass
        if self._process is not None and not self._process.is_alive():
            self._lost(f"the evaluation process exited (exit code {self._process.exitcode})")

    def close(self, timeout: float = 600.0) -> None:
        """Wait for the pending rounds (their results are published), then stop the process.
        Training is over: the process runs them without the CPU share's pauses."""
        deadline = time.monotonic() + timeout
        if self._unthrottled is not None:  # nothing left to share the CPU with: the last rounds at full speed
            self._unthrottled.set()
        while self._pending and self._process is not None and time.monotonic() < deadline:
            self.poll(timeout=0.5)
        if self._pending:
            self._lost(f"evaluation did not finish within {timeout:.0f} s of the end of training")
        if self.standby is not None:  # never needed: no round came
            self._process, self._conn, self.standby = self.standby.process, self.standby.conn, None
        if self._conn is not None:
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
        if self._process is not None:
            self._process.join(10)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(5)
        self._process, self._conn = None, None

    # -- the process --------------------------------------------------------------

    def _ensure_process(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        spec = ProcessSpec(self.model, self.sets, str(self.device), self.threads, self.cpu_share, self.rule,
                           dict(self.memory))
        standby, self.standby = self.standby, None
        if standby is not None and standby.process.is_alive():
            try:
                standby.conn.send(("spec", spec))
                self._process, self._conn, self._unthrottled = standby.process, standby.conn, standby.unthrottled
                return
            except OSError:
                pass
        context = mp.get_context("spawn")  # a fresh interpreter: no forked torch or Kafka threads
        parent, child = context.Pipe()
        self._unthrottled = context.Event()
        self._process = context.Process(target=process_main, args=(child, spec, self._unthrottled), name="areal-eval",
                                        daemon=True)
        self._process.start()
        child.close()
        self._conn = parent

    def _lost(self, why: str) -> None:
        """Report the pending rounds as failed (their results will not come)."""
        for job in self._pending.values():
            log.warning("evaluation round %d (step %d) lost: %s", job.round_no, job.step, why)
            for name, evalset in self.sets.items():
                for stage in ("quick", "full") if job.two_stage else ("full",):
                    self.on_outcome(Outcome(job.step, name, stage, "failed", evalset.fingerprint(), error=why))
        self._pending.clear()
        if self._process is not None and not self._process.is_alive():
            self._process, self._conn = None, None

"""A run's lifecycle from `areal.runs` (and the attempts its steps carry): has it ended?

Pure: `on_run_event(state, status, rank, world_size, attempt)` and `saw_attempt(state,
attempt)` return the new state.

Rules (CONTRACT.md `run`; every rank sends `running` at start and one terminal status)
- The run has ended when rank 0 sent a terminal status (finished, failed, killed) for the
  current attempt, or every rank of its `world_size` did. An ended run is not watched for
  `stalled` any more (a finished run is quiet, not stalled).
- A later attempt re-arms the watch: its `running`, or any step or result that carries it
  (a client that sends no run events still resumes). Events of an earlier attempt change
  nothing; a `running` of the current attempt does not undo its end.
- The ranks that sent `running` for the current attempt are kept (`running_ranks`): a
  vote round waits only for ranks that registered (logging from rank 0 only works).
- At most MAX_RANKS_TRACKED terminal (or running) ranks are remembered per attempt (a hostile stream
  of rank numbers must not grow the state); rank 0's status ends the run regardless.
"""

from __future__ import annotations

from msgspec.structs import replace

from areal_metrics.streams.core.stored import Stored

TERMINAL = ("finished", "failed", "killed")
MAX_RANKS_TRACKED = 4096


class Lifecycle(Stored):
    attempt: int = 0
    world_size: int = 1
    done_ranks: tuple[int, ...] = ()  # ranks that sent a terminal status for `attempt`, sorted
    ended: bool = False
    status: str | None = None  # the terminal status that ended it (rank 0's, else the last one)
    running_ranks: tuple[int, ...] = ()  # ranks that announced `attempt` (sorted): the nodes a round waits for
    ranks_changed_at: float | None = None  # worker clock when running_ranks last changed (the processor sets it)


def saw_attempt(state: Lifecycle, attempt: int) -> Lifecycle:
    """Any event of `attempt`: a later attempt starts afresh (not ended)."""
    if attempt <= state.attempt:
        return state
    return Lifecycle(attempt=attempt, world_size=state.world_size)


def on_run_event(state: Lifecycle, status: str, rank: int, world_size: int, attempt: int) -> Lifecycle:
    if attempt < state.attempt:
        return state  # an earlier attempt's news
    state = saw_attempt(state, attempt)
    # A rank number beyond world_size means a larger world than the event says.
    state = replace(state, world_size=max(state.world_size, world_size, min(rank, MAX_RANKS_TRACKED - 1) + 1))
    if status == "running" and rank not in state.running_ranks and len(state.running_ranks) < MAX_RANKS_TRACKED:
        state = replace(state, running_ranks=tuple(sorted((*state.running_ranks, rank))))
    if status not in TERMINAL or state.ended:
        return state
    done = state.done_ranks
    if rank not in done and len(done) < MAX_RANKS_TRACKED:
        done = tuple(sorted((*done, rank)))
    if rank == 0 or len(done) >= state.world_size:
        return replace(state, done_ranks=(), ended=True, status=status)  # ranks no longer needed
    return replace(state, done_ranks=done)

"""A run's status from its `run` events (pure): the rule `v_runs` states in SQL (sinks/views.py).

- a rank's status in an attempt: its terminal event if it sent one, else `running`;
- an attempt's: `failed` if a rank failed, else `killed` if a rank was killed, else
  `running` while a rank that reported runs, else `finished` (the ranks that registered: a run
  logged from rank 0 alone under `WORLD_SIZE` > 1 ends when rank 0 does);
- the run's: its latest attempt's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from areal_metrics.producers.contract.events import RunEvent


@dataclass(frozen=True, slots=True)
class RunState:
    run_id: str
    status: str
    attempt: int
    attempts: int  # attempts seen
    ranks: int  # ranks of the latest attempt that reported
    world_size: int
    started: float  # first event of any attempt
    ended: float | None  # when the latest attempt ended (None while running)


def attempt_status(rank_statuses: Iterable[str], world_size: int = 1) -> str:
    """`world_size` is no longer part of the rule (ranks that never register are not waited for)."""
    statuses = list(rank_statuses)
    if "failed" in statuses:
        return "failed"
    if "killed" in statuses:
        return "killed"
    if "running" in statuses:
        return "running"
    return "finished"


def fold(events: Iterable[RunEvent]) -> dict[str, RunState]:
    """run_id -> its state, from any of its run events in any order (duplicates included)."""
    ranks: dict[tuple[str, int, int, str], RunEvent] = {}  # (run, attempt, rank, node) -> its deciding event
    started: dict[str, float] = {}
    world: dict[tuple[str, int], int] = {}  # (run, attempt) -> the largest world_size any of its events gave
    for ev in events:
        started[ev.run_id] = min(started.get(ev.run_id, ev.ts), ev.ts)
        world[ev.run_id, ev.attempt] = max(world.get((ev.run_id, ev.attempt), 1), ev.world_size)
        key = (ev.run_id, ev.attempt, ev.rank, ev.node)
        held = ranks.get(key)
        if held is None or (ev.status != "running", ev.ts, ev.status) > (held.status != "running", held.ts, held.status):
            ranks[key] = ev
    latest: dict[str, int] = {}
    for run_id, attempt, _, _ in ranks:
        latest[run_id] = max(latest.get(run_id, attempt), attempt)
    out = {}
    for run_id, attempt in latest.items():
        mine = [ev for (r, a, _, _), ev in ranks.items() if r == run_id and a == attempt]
        size = world[run_id, attempt]
        status = attempt_status((ev.status for ev in mine), size)
        ended = None if status == "running" else max((ev.ts for ev in mine if ev.status != "running"), default=None)
        attempts = len({a for (r, a, _, _) in ranks if r == run_id})
        out[run_id] = RunState(run_id, status, attempt, attempts, len(mine), size, started[run_id], ended)
    return out

"""A consumer that stopped fetching, told apart from one with nothing to fetch.

kafka-python 3.0.12 has been seen here to keep partitions assigned, with positions set and nothing
paused, and send no FetchRequest for 60-90 s after two quick rejoins. Upstream reports look alike
(dpkp/kafka-python#3106, #3131; the fix of #3131 is in 3.0.12, so the cause here is not known). The sink would sit
on a backlog it never reads. The watch compares, every `stall_s`, the positions of the
partitions the sink fetches with their end offsets; a partition behind its end at two checks
in a row, at the same position, while the sink polled for at least `min_poll_s` in between
(a store outage holds the loop, not the fetcher; at most half of `stall_s`), is stalled, and the sink makes a new
consumer (sinks/sink.py): `stall_s` to twice that after the stall began, while the loop polls and the
offsets can be read. The sink does not check during a rebalance (positions stand still until its
assignment), unless it outlasts the group's rebalance timeout: a join that does not complete. Not seen: a stalled partition of a sink so busy with
the others that it spends less than `min_poll_s` of `stall_s` in poll(). Pure: the sink hands it the offsets
and the time it spent polling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

P = TypeVar("P")  # a partition, as the caller names it


@dataclass
class FetchWatch(Generic[P]):
    stall_s: float = 30.0  # 0: never watch
    # the polling a working fetcher needs to move a partition with records to read: ten times the
    # longest a fetch waits at the broker (kafka-python's fetch_max_wait_ms, 500 ms); at most half of
    # `stall_s`, which a check allows
    min_poll_s: float = 5.0
    _checked_at: float | None = None
    _polled_s: float = 0.0  # time spent in poll() since the last check
    _behind: dict[P, int] = field(default_factory=dict)  # position of each partition behind its end, last check

    def __post_init__(self) -> None:
        if self.stall_s < 0 or self.min_poll_s < 0:
            raise ValueError("stall_s and min_poll_s must be >= 0")

    def polled(self, seconds: float) -> None:
        """The sink spent `seconds` in one poll()."""
        self._polled_s += seconds

    def due(self, now: float) -> bool:
        """Whether to look at the offsets now (the first call only starts the clock)."""
        if self.stall_s == 0:
            return False
        if self._checked_at is None:
            self._checked_at = now
            return False
        return now - self._checked_at >= self.stall_s

    def check(self, now: float, positions: dict[P, int], ends: dict[P, int]) -> set[P]:
        """The partitions stalled: behind their end now and at the last check, at the same
        position, with enough polling in between. `positions`: those the sink fetches (none it
        paused itself); a partition missing from `ends` is not judged."""
        behind = {p: pos for p, pos in positions.items() if p in ends and pos < ends[p]}
        polled_enough = self._polled_s >= min(self.min_poll_s, self.stall_s / 2)
        stalled = {p for p, pos in behind.items() if polled_enough and self._behind.get(p) == pos}
        self._behind = behind
        self._checked_at = now
        self._polled_s = 0.0
        return stalled

    def rebalance_stuck(self, now: float, since: float, bound_s: float) -> bool:
        """A rebalance under way since `since`: positions stand still until its assignment, so nothing is judged
        (and the watch starts again) unless it has lasted past `bound_s` (the group's rebalance timeout, past
        which the coordinator completes it without the members that did not join: this one is stuck)."""
        if self.stall_s == 0 or now - since <= bound_s:
            self.reset(now)
            return False
        return True

    def forget(self, partitions: set[P]) -> None:
        """Judge these afresh (resumed after a pause: standing still until then was on purpose)."""
        for p in partitions:
            self._behind.pop(p, None)

    def reset(self, now: float) -> None:
        """Forget what was seen (a new consumer; offsets that could not be read)."""
        self._behind = {}
        self._checked_at = now
        self._polled_s = 0.0

"""Guard against input messages that Faust skips: notice the hole, seek back, re-read.

Why: faust-streaming 0.15.3 sometimes drops messages it has already fetched when its flow is
suspended around a (re)start, and books the missing offsets as an acknowledged "gap", so
they would never be processed. Seen in tests/test_streams_e2e.py: a worker restarted after
kill -9 jumped from offset 10 to 150 on a partition, or stopped delivering a partition
whose messages were already fetched. Our input topics have contiguous offsets (no
transactions), so a jump is a loss. The guard asks the shell to seek the partition back to
the first missing offset and drops later messages until that one arrives; processing is
idempotent (steps dedup by step, results by node), so re-reading is harmless. A hole that
seeking cannot fill (deleted by retention, transaction markers) is accepted after
`give_up_s` from when it was first seen: the partition is read once more from the hole, and
the first message that comes at or below the offset that gave up is taken, whatever its offset.

Pure bookkeeping with an injected clock; the shell does the seeking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

TP = tuple[str, int]  # (topic, partition)
Verdict = Literal["process", "drop", "seek"]


@dataclass
class Hole:
    """A partition's first missing offset, being sought."""

    target: int
    since: float  # when it was first seen: `give_up_s` counts from here, whatever the seeks in between
    sought: float  # the last seek back to it: `stuck_after_s` counts from here
    # given up at this offset: the last re-read's first message (the first at or below it) is taken, whatever
    # its offset; later ones of the fetch that gave up (the shell goes on through a fetch after a seek) are dropped
    final: int | None = None


@dataclass
class InputGuard:
    give_up_s: float = 30.0
    stuck_after_s: float = 10.0
    last: dict[TP, int] = field(default_factory=dict)  # last offset processed
    seeking: dict[TP, Hole] = field(default_factory=dict)
    progress_at: dict[TP, float] = field(default_factory=dict)
    accepted_gaps: int = 0
    seeks: int = 0

    def on_message(self, tp: TP, offset: int, now: float) -> tuple[Verdict, int | None]:
        """What to do with a delivered message: process it, drop it, or seek to the returned offset."""
        hole = self.seeking.get(tp)
        if hole is not None:
            if offset > hole.target and hole.final is None:
                if now - hole.since < self.give_up_s:
                    return "drop", None
                # Give up on the hole, but read once more from it: the messages dropped while waiting
                # come again, and the first that does is the first offset after the hole that exists.
                hole.final, hole.sought = offset, now
                self.seeks += 1
                return "seek", hole.target
            if hole.final is not None and offset > hole.final:
                return "drop", None  # the rest of the fetch that gave up: the re-read brings it again
            if offset > hole.target:
                self.accepted_gaps += 1  # the hole stays: given up on
            del self.seeking[tp]
        else:
            last = self.last.get(tp)
            if last is not None and offset > last + 1:
                self.seeking[tp] = Hole(last + 1, now, now)
                self.seeks += 1
                return "seek", last + 1
        if offset > self.last.get(tp, -1):
            self.last[tp] = offset
        self.progress_at[tp] = now
        return "process", None

    def stuck(self, tp: TP, position: int | None, now: float, committed: int | None = None) -> int | None:
        """Offset to seek to when `tp` has fetched messages (position) but delivers none.

        Before the first message of a partition, the committed offset is the baseline. A seek
        that did not help is repeated every `stuck_after_s`; the hole's own age is kept, so a
        hole that seeking cannot fill is still given up on after `give_up_s` (`on_message`).
        """
        last = self.last.get(tp)
        if last is None and committed is not None:
            last = committed - 1
            self.progress_at.setdefault(tp, now)
        if position is None or last is None or position <= last + 1:
            return None
        hole = self.seeking.get(tp)
        quiet_since = hole.sought if hole is not None else self.progress_at.get(tp, now)
        if now - quiet_since < self.stuck_after_s:
            return None
        if hole is None:
            hole = self.seeking[tp] = Hole(last + 1, now, now)
        # a re-read after giving up that brought nothing at or below its offset (retention moved the log's
        # start past it meanwhile): give up afresh at the next message, or the partition would stall
        hole.sought, hole.final = now, None
        self.seeks += 1
        return hole.target

    def touch(self, now: float) -> None:
        """The reader paused on purpose (its own backlog): every quiet spell starts again now. A hole keeps its
        age: giving up on it only reads the partition once more from it, so a hole the pause kept unfilled
        loses nothing, while one restarted at every pause (a sustained backlog) would never be given up on."""
        for tp in self.progress_at:
            self.progress_at[tp] = now
        for hole in self.seeking.values():
            hole.sought = now

    def forget(self) -> None:
        """After a rebalance: offsets restart from the committed ones."""
        self.last.clear()
        self.seeking.clear()
        self.progress_at.clear()

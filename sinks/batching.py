"""Batching policy, batch plans and deduplication tokens (pure).

A batch is cut per Kafka partition: one chunk is a contiguous run of offsets
of one partition. Before a chunk is inserted the sink records its plan
(first, last); after a crash the next sink finds the plan and cuts exactly the
same chunk again. Without a plan the cut depends on timing (rows or time,
whichever first), which is fine because nothing was inserted.

The chunks of one topic cut in one flush are stored as one block (`Block`):
one INSERT per table per flush, not one per partition, because most of an
insert's cost is fixed (the materialized views' query is planned for every
INSERT; docs/PERFORMANCE.md "The sink's cost per block"). Its token names
every chunk, ``<topic>:<partition>:<first>-<last>[,<partition>:<first>-<last>...]``,
and after a crash `Batcher.take` cuts the same chunks of the same partitions
again, so the retried block carries the same token and ClickHouse drops it.
A retry that cannot group them the same (a rebalance moved one of the
partitions elsewhere) inserts their rows again under another token: the raw
tables' FINAL and the aggregates' duplicate check (sinks/step_means.py)
absorb it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
TopicPartition = tuple[str, int]


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """Flush when `max_rows` rows are buffered or the oldest waited `max_wait_s`, whichever
    first; and, when `idle_s` > 0, as soon as the log has been quiet for `idle_s` (a poll that
    long brought nothing): the end of a burst is stored at once instead of waiting out
    `max_wait_s`, while a steady stream still goes in blocks of up to `max_rows`."""

    max_rows: int = 5_000
    max_wait_s: float = 0.5
    idle_s: float = 0.05

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        if self.max_wait_s < 0:
            raise ValueError("max_wait_s must be >= 0")
        if self.idle_s < 0:
            raise ValueError("idle_s must be >= 0")


@dataclass(frozen=True, slots=True)
class Plan:
    """The offsets of a chunk that was (or was about to be) inserted."""

    first: int
    last: int


@dataclass(frozen=True, slots=True)
class Chunk(Generic[T]):
    topic: str
    partition: int
    first: int
    last: int
    items: tuple[T, ...]

    @property
    def next_offset(self) -> int:
        return self.last + 1


@dataclass(slots=True)
class _Buffer(Generic[T]):
    since: float
    offsets: list[int] = field(default_factory=list)
    items: list[T] = field(default_factory=list)


def block_token(chunks: Sequence[Chunk[T]], prefix: str = "") -> str:
    """The token of the block holding `chunks` (of one topic, in partition order): every chunk's range."""
    ranges = ",".join(f"{c.partition}:{c.first}-{c.last}" for c in chunks)
    return f"{prefix}{chunks[0].topic}:{ranges}"


@dataclass(frozen=True, slots=True)
class Block(Generic[T]):
    """The chunks of one topic cut in one flush: stored as one INSERT into the topic's table."""

    chunks: tuple[Chunk[T], ...]

    @property
    def topic(self) -> str:
        return self.chunks[0].topic

    def token(self, prefix: str = "") -> str:
        return block_token(self.chunks, prefix)

    def __str__(self) -> str:
        return f"{self.topic}[" + ",".join(f"{c.partition}@{c.first}-{c.last}" for c in self.chunks) + "]"


def blocks(chunks: Sequence[Chunk[T]]) -> list[Block[T]]:
    """The chunks grouped by topic (one block each), in the order the topics first appear."""
    by_topic: dict[str, list[Chunk[T]]] = {}
    for c in chunks:
        by_topic.setdefault(c.topic, []).append(c)
    return [Block(tuple(sorted(group, key=lambda c: c.partition))) for group in by_topic.values()]


class Batcher(Generic[T]):
    """Buffers read messages per partition and cuts chunks by the policy."""

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self._buffers: dict[TopicPartition, _Buffer[T]] = {}
        self.total = 0

    def add(self, tp: TopicPartition, offset: int, item: T, now: float) -> None:
        buf = self._buffers.get(tp)
        if buf is None:
            buf = self._buffers[tp] = _Buffer(since=now)
        if buf.offsets and offset <= buf.offsets[-1]:
            return  # a re-fetch after seek: already buffered
        buf.offsets.append(offset)
        buf.items.append(item)
        self.total += 1

    def due(self, now: float, quiet: bool = False) -> bool:
        """Whether to flush now; `quiet`: the last poll (`poll_timeout` long) brought nothing."""
        if self.total >= self.policy.max_rows:
            return True
        if quiet and self.total and self.policy.idle_s > 0:
            return True
        return any(buf.offsets and now - buf.since >= self.policy.max_wait_s for buf in self._buffers.values())

    def wait_left(self, now: float) -> float:
        """Seconds until the oldest buffer is due by age; max_wait when empty."""
        ages = [now - b.since for b in self._buffers.values() if b.offsets]
        if not ages:
            return self.policy.max_wait_s
        return max(0.0, self.policy.max_wait_s - max(ages))

    def poll_timeout(self, now: float) -> float:
        """How long the next poll may wait: until a buffer is due by age, and no longer than
        `idle_s` while rows are buffered (a poll that long with nothing new means quiet)."""
        left = self.wait_left(now)
        if self.total and self.policy.idle_s > 0:
            return min(left, self.policy.idle_s)
        return left

    def take(
        self,
        now: float,
        plans: Mapping[TopicPartition, Plan] | None = None,
        positions: Mapping[TopicPartition, int] | None = None,
    ) -> list[Chunk[T]]:
        """Cut one chunk per buffered partition (at most `max_rows` items each).

        After a crash the flush that was under way is cut again, the same: a
        partition with a plan whose range holds its first buffered offset (or,
        not fetched yet, its position) is cut exactly at the plan's end. While
        one such partition has not reached that end and the consumer's
        `positions` say more may come, its topic is held back; and a topic with
        planned partitions is cut to those alone (the others wait for the next
        flush), so each topic's block (`blocks`) is the one the store knows.
        """
        plans = plans or {}
        positions = positions or {}
        redo = self._redo(plans, positions)
        redo_topics = {tp[0] for tp in redo}
        held = {tp[0] for tp, plan in redo.items() if not self._reached(tp, plan, positions)}
        out: list[Chunk[T]] = []
        for tp, buf in sorted(self._buffers.items()):
            if not buf.offsets or tp[0] in held:
                continue
            limit = self.policy.max_rows
            if tp in redo:
                limit = sum(1 for o in buf.offsets if o <= redo[tp].last)
            elif tp[0] in redo_topics:
                continue  # not in the retried block: cut with the next flush
            n = min(limit, len(buf.offsets))
            out.append(Chunk(tp[0], tp[1], buf.offsets[0], buf.offsets[n - 1], tuple(buf.items[:n])))
            del buf.offsets[:n], buf.items[:n]
            self.total -= n
            buf.since = now
        return out

    def _redo(self, plans: Mapping[TopicPartition, Plan],
              positions: Mapping[TopicPartition, int]) -> dict[TopicPartition, Plan]:
        """The plans of a flush under way when the last sink stopped: read again from their start."""
        out = {}
        for tp, plan in plans.items():
            buf = self._buffers.get(tp)
            start = buf.offsets[0] if buf is not None and buf.offsets else positions.get(tp)
            if start is not None and plan.first <= start <= plan.last:
                out[tp] = plan
        return out

    def _reached(self, tp: TopicPartition, plan: Plan, positions: Mapping[TopicPartition, int]) -> bool:
        """Whether the partition's buffer holds the plan's whole range (or the log has nothing more of it)."""
        buf = self._buffers.get(tp)
        return (buf is not None and bool(buf.offsets) and buf.offsets[-1] >= plan.last) \
            or positions.get(tp, 0) > plan.last

    def drop(self, tps: set[TopicPartition] | None = None) -> None:
        """Forget buffered messages: those of partitions a rebalance gave to another member, which reads them again."""
        for tp in list(self._buffers):
            if tps is None or tp in tps:
                self.total -= len(self._buffers.pop(tp).offsets)

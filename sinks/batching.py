"""Batching policy, batch plans and deduplication tokens (pure).

A batch is cut per Kafka partition: one chunk is a contiguous run of offsets
of one partition, inserted as one block with the token
``<topic>:<partition>:<first>-<last>``. Before a chunk is inserted the sink
records its plan (first, last); after a crash the next sink finds the plan and
cuts exactly the same chunk again, so the retried insert carries the same
token and ClickHouse drops it. Without a plan the cut depends on timing
(rows or time, whichever first), which is fine because nothing was inserted.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def dedup_token(topic: str, partition: int, first: int, last: int, prefix: str = "") -> str:
    """The `insert_deduplication_token` of a chunk: the same log range gives the same token."""
    return f"{prefix}{topic}:{partition}:{first}-{last}"


@dataclass(slots=True)
class _Buffer(Generic[T]):
    since: float
    offsets: list[int] = field(default_factory=list)
    items: list[T] = field(default_factory=list)


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

        A partition with a plan whose range starts at or before its first
        buffered offset is cut exactly at the plan's end; while its buffer has
        not reached that end and the consumer's `positions` say more may come,
        it is held back.
        """
        plans = plans or {}
        positions = positions or {}
        out: list[Chunk[T]] = []
        for tp, buf in sorted(self._buffers.items()):
            if not buf.offsets:
                continue
            limit = self.policy.max_rows
            plan = plans.get(tp)
            if plan is not None and plan.first <= buf.offsets[0] <= plan.last:
                reached = buf.offsets[-1] >= plan.last or positions.get(tp, 0) > plan.last
                if not reached:
                    continue
                limit = sum(1 for o in buf.offsets if o <= plan.last)
            n = min(limit, len(buf.offsets))
            out.append(Chunk(tp[0], tp[1], buf.offsets[0], buf.offsets[n - 1], tuple(buf.items[:n])))
            del buf.offsets[:n], buf.items[:n]
            self.total -= n
            buf.since = now
        return out

    def drop(self, tps: set[TopicPartition] | None = None) -> None:
        """Forget buffered messages: those of partitions a rebalance gave to another member, which reads them again."""
        for tp in list(self._buffers):
            if tps is None or tp in tps:
                self.total -= len(self._buffers.pop(tp).offsets)

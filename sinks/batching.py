"""Batching policy, batch plans and deduplication tokens (pure).

A batch is cut per Kafka partition: one chunk is a contiguous run of offsets
of one partition, whose token is ``<topic>:<partition>:<first>-<last>``. A
flush's chunks of one topic are inserted as one block (`blocks_by_topic`), whose
token joins theirs (`block_token`): the store's cost is mostly per INSERT.
Before a block is inserted the sink records its chunks' plans (first, last),
each with the block's token as its `group`. After a crash the
next sink finds the plans and cuts exactly the same chunks again, holding each
back until every chunk of its block that it reads is cut (`Batcher.take`); the
block inserted again carries the same token, so ClickHouse drops what it has
and stores, in the tables its materialized views fill, what it lacks. Without
a plan the cut depends on timing (rows or time, whichever first), which is
fine because nothing was inserted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")
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
    # after a crash: how long a block of recorded plans waits for each of its partitions this sink reads to
    # be read again (one slow partition must not hold its topic's others for ever); then its chunks read go
    # in alone, by the rows the store lacks
    replan_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        if self.max_wait_s < 0:
            raise ValueError("max_wait_s must be >= 0")
        if self.idle_s < 0:
            raise ValueError("idle_s must be >= 0")
        if self.replan_wait_s < 0:
            raise ValueError("replan_wait_s must be >= 0")


@dataclass(frozen=True, slots=True)
class Plan:
    """The offsets of a chunk that was (or was about to be) inserted; `group`: the token of the block it went
    in (a chunk cut again is the same chunk whatever its block: equality ignores it)."""

    first: int
    last: int
    group: str = field(default="", compare=False)


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


TOKEN_MAX = 200  # a joint token longer than this is hashed (ZooKeeper and Keeper keep tokens in node names)


def block_token(chunks: Sequence[Chunk[object]]) -> str:
    """The token of one block of chunks of one topic: a chunk's own token when alone, else theirs joined."""
    joined = "+".join(dedup_token(c.topic, c.partition, c.first, c.last) for c in chunks)
    if len(joined) <= TOKEN_MAX:
        return joined
    return f"{chunks[0].topic}:blocks:{hashlib.blake2b(joined.encode(), digest_size=16).hexdigest()}"


def blocks_by_topic(pairs: Sequence[tuple[Chunk[T], U]],
                    block_of: Callable[[Chunk[T]], str] | None = None) -> list[list[tuple[Chunk[T], U]]]:
    """The chunks (each with what goes with it) grouped by topic, in their order: one block to insert each;
    `block_of`: within a topic, by the block it names too (chunks cut again by their plans)."""
    out: dict[tuple[str, str], list[tuple[Chunk[T], U]]] = {}
    for pair in pairs:
        out.setdefault((pair[0].topic, block_of(pair[0]) if block_of else ""), []).append(pair)
    return list(out.values())


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
        self._replan_since: dict[tuple[str, str], float] = {}  # a planned block waiting for a chunk: since when
        # after take(): the partitions read to their planned chunk's end and held for the rest of its block; what
        # they would fetch meanwhile only grows their buffers (the sink pauses them)
        self.held: set[TopicPartition] = set()

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
        not reached that end and the consumer's `positions` (of the partitions
        this sink reads) say more may come, it is held back, and so are the
        other partitions of its plan's block (same topic and group), which go
        into the store again as one block with it.
        """
        plans = plans or {}
        positions = positions or {}
        held = self._held_blocks(now, plans, positions)
        self.held = set()
        out: list[Chunk[T]] = []
        for tp, buf in sorted(self._buffers.items()):
            if not buf.offsets:
                continue
            limit = self.policy.max_rows
            plan = plans.get(tp)
            if plan is not None and plan.first <= buf.offsets[0] <= plan.last:
                waiting = self._replanned(tp, plan, positions) == "waiting"
                if waiting or (tp[0], plan.group) in held:
                    buf.since = now  # held: its age must not make every poll a flush of the others
                    if not waiting:
                        self.held.add(tp)
                    continue
                limit = sum(1 for o in buf.offsets if o <= plan.last)
            n = min(limit, len(buf.offsets))
            out.append(Chunk(tp[0], tp[1], buf.offsets[0], buf.offsets[n - 1], tuple(buf.items[:n])))
            del buf.offsets[:n], buf.items[:n]
            self.total -= n
            buf.since = now
        return out

    def _held_blocks(self, now: float, plans: Mapping[TopicPartition, Plan],
                     positions: Mapping[TopicPartition, int]) -> set[tuple[str, str]]:
        """The (topic, group) of each planned block with a chunk still to be read, waiting less than
        `replan_wait_s` since it was first seen so."""
        waiting = {(tp[0], plans[tp].group) for tp in plans
                   if tp in positions and self._replanned(tp, plans[tp], positions) == "waiting"}
        self._replan_since = {key: self._replan_since.get(key, now) for key in waiting}
        return {key for key, since in self._replan_since.items() if now - since < self.policy.replan_wait_s}

    def _replanned(self, tp: TopicPartition, plan: Plan, positions: Mapping[TopicPartition, int]) -> str:
        """Where the chunk a plan names stands: "ready" (buffered to its end, or its end is gone from the log),
        "waiting" (more of it may come) or "past" (the buffer is beyond it, or nothing is buffered and the
        consumer's position is past its end)."""
        buf = self._buffers.get(tp)
        position = positions.get(tp, 0)
        if buf is None or not buf.offsets:
            return "past" if position > plan.last else "waiting"
        if not plan.first <= buf.offsets[0] <= plan.last:
            return "past"
        return "ready" if buf.offsets[-1] >= plan.last or position > plan.last else "waiting"

    def buffered(self, tp: TopicPartition) -> int:
        """How many messages of the partition wait in its buffer."""
        buf = self._buffers.get(tp)
        return len(buf.offsets) if buf else 0

    def drop(self, tps: set[TopicPartition] | None = None) -> None:
        """Forget buffered messages: those of partitions a rebalance gave to another member, which reads them again;
        all of them (`None`): a new consumer reads them again, and a held block's wait starts again with it."""
        for tp in list(self._buffers):
            if tps is None or tp in tps:
                self.total -= len(self._buffers.pop(tp).offsets)
        if tps is None:
            self._replan_since = {}
            self.held = set()

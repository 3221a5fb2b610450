"""The stream worker's state in its table: one small head record per run, one record per
vote round, so a batch rewrites only what changed.

A run's RunState (areal_metrics.streams.core.processor) is kept as (keys are JSON arrays):

  [run, "run"]                the head: every part of the state but the steps and rounds below
                              (the smoothing window, triggers, alert memory, eval loop, stall,
                              lifecycle, the last good consensus), the keys of the waiting steps
                              and open rounds, and the range of closed-round numbers
  [run, "pending", [a, s]]    one step waiting for the rest of its ranks (PendingStep less its
                              reports: PendingRecord, with their generation and count)
  [run, "reports", [a, s], g, i]  the reports of that step that one save added, the ith on:
                              each report is written once, so a step of 1,024 ranks reporting
                              one per batch writes 1,024 reports, not 1+2+...+1,024
  [run, "round", RoundKey]    one open vote round (RoundState)
  [run, "closed", RoundKey]   one decided round: its number in closing order

Saving compares the new state with the one last saved and writes only what changed, in an
order that keeps a crash harmless: step and round records first, then the head, then
tombstones. Kafka keeps a partition's order and every record of a run goes to the run's
partition, so a crash leaves a prefix of those writes; the head decides what is live (the
steps and rounds it lists, the closed numbers in its range), so a half-written save reads
back as the state before it, except that a waiting step or open round the save rewrote
already holds the new report or result: the batch the worker reads again adds those
once more, which changes nothing (one report per rank, one result per node). A batch of
steps writes its run's head and, for each waiting step that got reports, a record of those
reports and the step's record; closing a round adds one record, never the 2,048 before it.

A waiting step's record names how many reports it has (`count`); they are read from
position 0, each record of them saying how many it holds, so reports a save wrote before
a crash cut it short (beyond the count) are not read, and are written over when the batch
comes again. Reports that do not continue the saved ones (a step's record of the layout
before, which held its reports itself) are written anew as the next generation `g`, whose
records replace the old generation's once the step's record names it; the old ones go
with the tombstones.

A run evicted (`evict`: the worker's bound on its live runs, areal_metrics.streams.shell.batch)
leaves the table as tombstones, head first; if it comes back it has no state and starts over.

A run whose records do not decode starts over from an empty state; each bad record is
reported once (`bad`, for the shell to dead-letter) and the run's leftover records are
deleted at its next save, as are records nothing refers to. A record written before this
layout (key = the run id, value = the whole state) loads the same way and is replaced at
the next save; so does a waiting step's record that holds its reports (before issue 42),
rewritten in the layout above at the step's next change.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from msgspec.structs import FieldInfo, fields

from areal_metrics.producers.contract.errors import ArealError
from areal_metrics.streams.state import codec
from areal_metrics.streams.state.codec import StateDecodeError
from areal_metrics.streams.core.processor import RunState
from areal_metrics.streams.core.ranks import PendingStep, RankReport, RankState, Reports, StepKey
from areal_metrics.streams.core.stored import Stored
from areal_metrics.streams.core.voting import RoundKey, RoundState, VoteState

log = logging.getLogger("streams")

HEAD, PENDING, REPORTS, ROUND, CLOSED = "run", "pending", "reports", "round", "closed"
# The parts kept in records of their own; every other part is in the head.
SPLIT_RUN = ("run_id", "ranks", "votes")
SPLIT_RANKS = ("pending",)
SPLIT_VOTES = ("open_rounds", "closed")


@dataclass(frozen=True, slots=True)
class BadRecord:
    run_id: str
    raw: bytes
    why: str


class PendingRecord(Stored, omit_defaults=True):
    """A waiting step's record: its PendingStep less the reports, which are in the step's
    `reports` records of generation `gen`, `count` of them in all; or, when the step is first
    written, its reports in `reports` here (one record, where most steps, whose ranks arrive
    within two batches, never need another). A record of the layout before (every report in
    `reports`, here) reads as the same step."""

    world_size: int
    opened_at: float
    ts: float
    reports: tuple[RankReport, ...] = ()  # a step's first reports (and the layout before: all of them)
    gen: int = 0
    count: Annotated[int, msgspec.Meta(ge=0)] = 0


@dataclass(slots=True)
class _Written:
    """A waiting step's reports as the table holds them: records of generation `gen` at the
    positions `starts` (in order), `count` reports in all; `inline`: the step's own record
    holds its reports (its first write, or the layout before), to be rewritten in records of
    their own at the step's next change."""

    gen: int
    starts: list[int]
    count: int
    inline: bool = False


@dataclass(slots=True)
class _Saved:
    """What the table holds for one run: the state, the numbers of its closed rounds and
    where its waiting steps' reports are."""

    state: RunState
    closed_no: dict[RoundKey, int]  # closed round -> its number
    next_no: int  # the number the next closed round gets
    steps: dict[StepKey, _Written] = field(default_factory=dict)  # waiting step -> its reports' records


def record_key(run_id: str, kind: str, *parts: Any) -> bytes:
    return codec.dumps([run_id, kind, *parts])


def _rest(cls: type[Stored], split: tuple[str, ...]) -> tuple[str, ...]:
    """The fields of `cls` that stay in the head."""
    return tuple(f.name for f in fields(cls) if f.name not in split)


def _head_struct(name: str, cls: type[Stored], split: tuple[str, ...],
                 extra: list[tuple[str, Any, Any]]) -> type[Stored]:
    """The head's part for `cls`: its fields but the `split` ones (same types and defaults),
    then the `extra` (name, type, default) ones."""

    def spec(f: FieldInfo) -> tuple[str, Any, Any]:
        if f.default_factory is not msgspec.NODEFAULT:
            return f.name, f.type, msgspec.field(default_factory=f.default_factory)
        return f.name, f.type, f.default

    return msgspec.defstruct(name, [spec(f) for f in fields(cls) if f.name not in split] + extra,
                             bases=(Stored,), module=__name__)


HEAD_FIELDS, RANK_FIELDS, VOTE_FIELDS = _rest(RunState, SPLIT_RUN), _rest(RankState, SPLIT_RANKS), \
    _rest(VoteState, SPLIT_VOTES)
# The head record of a run: keys of the waiting steps and open rounds, the range of closed-round numbers
RanksHead = _head_struct("RanksHead", RankState, SPLIT_RANKS, [("waiting", tuple[StepKey, ...], ())])
VotesHead = _head_struct("VotesHead", VoteState, SPLIT_VOTES, [("open", tuple[RoundKey, ...], ()),
                                                               ("closed_range", tuple[int, int], (0, 0))])
Head = _head_struct("Head", RunState, SPLIT_RUN, [("ranks", RanksHead, RanksHead()),
                                                  ("votes", VotesHead, VotesHead())])


def _changed(a: Any, b: Any) -> bool:
    return a is not b and a != b


class TableWrites:
    """Puts and tombstones on the worker's table: a dict (tests, the benchmark's core) or
    Faust's table, whose changelog gets each record for the run's partition.

    `direct`: a Faust table's changelog records wait in `outbox` (partition, key, value or
    None for a tombstone), in the order written, for the caller to hand to the producer
    itself (`take`); otherwise each goes through the table's `send_changelog`.
    """

    def __init__(self, table: Any, direct: bool = False) -> None:
        self.table = table
        self.faust = hasattr(table, "send_changelog") and hasattr(table, "data")
        self.data = table.data if self.faust else table
        self.outbox: list[tuple[int, bytes, bytes | None]] | None = [] if direct and self.faust else None
        # Faust's memory store forgets, once a rebalance's recovery completes, the keys of the partitions
        # this worker no longer holds, but only the keys it knows the partition of: those it restored
        # from the changelog. A key written here is told too, or a run this worker started would stay in
        # its table after its partition went to another worker (and be written, evicted, tombstoned there).
        self._partition_of: dict[Any, int] | None = getattr(self.data, "_key_partition", None) if self.faust else None

    def put(self, partition: int, key: bytes, value: bytes) -> None:
        self.data[key] = value
        if self._partition_of is not None:
            self._partition_of[key] = partition
        if self.outbox is not None:
            self.outbox.append((partition, key, value))
        elif self.faust:
            self.table.send_changelog(partition, key, value)

    def delete(self, partition: int, key: bytes) -> None:
        if self._partition_of is not None:
            self._partition_of.pop(key, None)
        if self.data.pop(key, None) is None or not self.faust:
            return
        if self.outbox is not None:
            self.outbox.append((partition, key, None))
        else:
            self.table.send_changelog(partition, key, None, value_serializer="raw")

    def take(self) -> list[tuple[int, bytes, bytes | None]]:
        """The changelog records written since the last call (always [] unless `direct`)."""
        if not self.outbox:
            return []
        out, self.outbox = self.outbox, []
        return out

    def get(self, key: bytes) -> Any:
        return self.data.get(key)

    def keys(self) -> Iterator[Any]:
        return iter(list(self.data.keys()))


# A Kafka record's bytes beyond its key and value, within the record batch the topic's
# max.message.bytes bounds (the batch header 61, a record's header and varints)
RECORD_OVERHEAD = 128


class StateRecordTooLarge(ArealError):
    """A save would write a record over the bound: nothing of it was written, and the run's
    state is as the table holds it (the message that made the record is the shell's to
    dead-letter)."""


@dataclass
class StateStore:
    """RunStates over the table's records: loaded once (then cached), saved by difference.
    `max_record_bytes` bounds a record's key, value and overhead (None: no bound): the broker
    refuses a record over its changelog topic's max.message.bytes, and a state it refused is a
    state lost."""

    table: Any
    states: dict[str, RunState] = field(default_factory=dict)  # decoded, as last saved
    bad: list[BadRecord] = field(default_factory=list)  # records that did not decode, to report
    writes: int = 0  # records put or deleted (the changelog's share of the work)
    direct_changelog: bool = False  # TableWrites' `direct`: the caller sends the changelog records
    max_record_bytes: int | None = None

    def __post_init__(self) -> None:
        self.io = TableWrites(self.table, self.direct_changelog)
        self._saved: dict[str, _Saved] = {}
        self._index: dict[str, dict[bytes, tuple[Any, ...]]] | None = None  # run -> raw key -> (kind, part)

    # ---------------------------------------------------------------- index

    def _runs(self) -> dict[str, dict[bytes, tuple[Any, ...]]]:
        """Every record key of the table by run (built from the table once, then kept)."""
        if self._index is None:
            self._index = {}
            for raw in self.io.keys():
                run_id, tail = _parse_key(raw)
                self._index.setdefault(run_id, {})[raw] = tail
        return self._index

    def run_ids(self) -> list[str]:
        return list({**dict.fromkeys(self._runs()), **dict.fromkeys(self.states)})

    def holds(self, run_id: str) -> bool:
        """Does the table hold records of the run (decoded or not), or the cache a state of it?"""
        return run_id in self.states or bool(self._runs().get(run_id))

    def forget_saved(self, run_id: str) -> None:
        """What the last save wrote of the run is no longer known: its next save writes it whole (and deletes
        the records it does not write), whatever the table holds."""
        self._saved.pop(run_id, None)

    def forget(self) -> None:
        """After a rebalance: the table is the truth again (another worker may have written)."""
        self.states.clear()
        self._saved.clear()
        self._index = None

    def evict(self, run_id: str, partition: int) -> int:
        """The run leaves the table: a tombstone for each of its records (the head first, so a
        crash part-way leaves records nothing refers to, which load as no state and go at the
        run's next save or eviction), and its decoded state leaves the cache. Returns the
        number of records deleted."""
        keys = self._runs().pop(run_id, {})
        order = sorted(keys, key=lambda k: keys[k] != (HEAD,))  # the head first
        for key in order:
            self.io.delete(partition, key)
        self.writes += len(order)
        self.states.pop(run_id, None)
        self._saved.pop(run_id, None)
        return len(order)

    # ---------------------------------------------------------------- load

    def load(self, run_id: str) -> RunState | None:
        """The run's state (None: nothing stored, or it did not decode: see `bad`)."""
        found = self.states.get(run_id)
        if found is not None:
            return found
        keys = self._runs().get(run_id)
        if not keys:
            return None
        head = next((k for k, tail in keys.items() if tail == (HEAD,)), None)
        legacy = next((k for k, tail in keys.items() if tail == ()), None)
        if head is None and legacy is None:
            return None  # only records nothing refers to: deleted at the run's first save
        raw = self.io.get(head if head is not None else legacy)
        if raw is None:
            # the table no longer holds them (a rebalance gave their partition to another worker
            # after this index was built): not this worker's run now
            self._runs().pop(run_id, None)
            return None
        try:
            if head is None:
                state = self._decode_legacy(run_id, raw)
                self.states[run_id] = state  # nothing in `_saved`: its first save writes it all anew
                return state
            saved = self._decode(run_id, raw, keys)
        except StateDecodeError as exc:
            self._report(run_id, raw, str(exc))
            return None
        self.states[run_id], self._saved[run_id] = saved.state, saved
        return saved.state

    def _report(self, run_id: str, raw: Any, why: str) -> None:
        log.error("streams: stored state of run %r does not decode (%s); starting it over", run_id, why)
        raw = bytes(raw) if isinstance(raw, (bytes, bytearray)) else str(raw).encode()
        self.bad.append(BadRecord(run_id, raw, why))

    def _decode_legacy(self, run_id: str, raw: Any) -> RunState:
        try:
            state = codec.loads(RunState, raw)
        except TypeError as exc:
            raise StateDecodeError(f"stream state: {exc}") from None
        if state.run_id != run_id:
            raise StateDecodeError(f"stream state $.run_id: {state.run_id!r} stored under {run_id!r}")
        return state

    def _decode(self, run_id: str, head_raw: Any, keys: dict[bytes, tuple[Any, ...]]) -> _Saved:
        head = codec.loads(Head, head_raw)
        low, next_no = head.votes.closed_range
        open_rounds = self._listed(run_id, ROUND, head.votes.open, RoundState, "$.votes.open_rounds", "round")
        closed_no = self._closed_rounds(keys, low, next_no)
        pending, written = self._pending(run_id, head.ranks.waiting)
        vote_state = VoteState(open_rounds=open_rounds, closed=tuple(closed_no),
                               **{name: getattr(head.votes, name) for name in VOTE_FIELDS})
        ranks = RankState(pending=pending, **{name: getattr(head.ranks, name) for name in RANK_FIELDS})
        state = RunState(run_id=run_id, ranks=ranks, votes=vote_state,
                         **{name: getattr(head, name) for name in HEAD_FIELDS})
        return _Saved(state, closed_no, next_no, written)

    def _pending(self, run_id: str, waiting: tuple[StepKey, ...]) -> tuple[dict[StepKey, PendingStep],
                                                                            dict[StepKey, _Written]]:
        """The waiting steps the head lists: each step's record, then its reports' records from
        position 0 to its `count` (each record says how many reports it holds)."""
        records = self._listed(run_id, PENDING, waiting, PendingRecord, "$.ranks.pending", "step")
        pending, written = {}, {}
        for i, (key, rec) in enumerate(records.items()):
            where = f"$.ranks.pending[{i}].reports"
            reports, starts, at = list(rec.reports), [], 0
            while at < rec.count:
                raw = self.io.get(record_key(run_id, REPORTS, key, rec.gen, at))
                if raw is None:
                    raise StateDecodeError(f"stream state {where}[{at}]: the reports' record is missing")
                part = codec.loads(list[RankReport], raw, f"{where}[{at}]")
                if not part or at + len(part) > rec.count:
                    raise StateDecodeError(f"stream state {where}[{at}]: {len(part)} reports where "
                                           f"{rec.count - at} are left of {rec.count}")
                starts.append(at)
                reports.extend(part)
                at += len(part)
            pending[key] = PendingStep(rec.world_size, rec.opened_at, rec.ts, Reports(reports))
            written[key] = _Written(rec.gen, starts, rec.count, inline=bool(rec.reports))
        return pending, written

    def _listed(self, run_id: str, kind: str, keys: tuple[Any, ...], cls: type, where: str,
                what: str) -> dict[Any, Any]:
        """The records the head lists (open rounds, waiting steps), each decoded as `cls`."""
        out = {}
        for i, key in enumerate(keys):
            raw = self.io.get(record_key(run_id, kind, key))
            if raw is None:
                raise StateDecodeError(f"stream state {where}[{i}]: the {what}'s record is missing")
            out[key] = codec.loads(cls, raw, f"{where}[{i}]")
        return out

    def _closed_rounds(self, keys: dict[bytes, tuple[Any, ...]], low: int, high: int) -> dict[RoundKey, int]:
        """The closed rounds numbered low..high-1 (others are left over from a save cut
        short, or forgotten), in closing order."""
        found = []
        for raw, tail in keys.items():
            if tail[:1] != (CLOSED,):
                continue
            try:
                key = codec.convert(RoundKey, tail[1], "$.votes.closed[]")
                no = codec.loads(int, self.io.get(raw), "$.votes.closed[]")
            except (StateDecodeError, IndexError):
                continue  # a closed round's number is only a memory: one that does not read is forgotten
            if low <= no < high:
                found.append((no, key))
        return {key: no for no, key in sorted(found, key=lambda p: p[0])}

    # ---------------------------------------------------------------- save

    def save(self, state: RunState) -> None:
        """Write what changed since the last save (everything, when nothing is known of it)."""
        run_id = state.run_id
        partition = state.partition if state.partition is not None else 0
        old = self._saved.get(run_id)
        puts: list[tuple[bytes, bytes]] = []
        deletes: list[bytes] = []
        if old is None:
            saved = _Saved(state, {k: i for i, k in enumerate(state.votes.closed)}, len(state.votes.closed))
            for k, p in state.ranks.pending.items():
                saved.steps[k] = _put_first(run_id, k, p, puts)
            puts += [(record_key(run_id, ROUND, k), codec.dumps(r)) for k, r in state.votes.open_rounds.items()]
            puts += [(record_key(run_id, CLOSED, k), codec.dumps(n)) for k, n in saved.closed_no.items()]
            puts.append((record_key(run_id, HEAD), self._head(saved)))
            written = {k for k, _ in puts}
            deletes = [k for k in self._runs().get(run_id, {}) if k not in written]
        else:
            saved = _Saved(state, old.closed_no, old.next_no, old.steps)
            head_changed = old.state.ranks.pending is not state.ranks.pending and _diff_pending(
                run_id, old.state.ranks.pending, state.ranks.pending, saved.steps, puts, deletes)
            head_changed = self._diff_rounds(old.state.votes, state.votes, saved, puts, deletes) or head_changed
            if head_changed or self._head_changed(old.state, state):
                puts.append((record_key(run_id, HEAD), self._head(saved)))
        if self.max_record_bytes is not None:
            self._check_sizes(run_id, puts)
        index = self._runs().setdefault(run_id, {})
        for key, value in puts:
            self.io.put(partition, key, value)
            if key not in index:  # a key's tail is a function of its bytes: the head's and a waiting step's are known
                index[key] = _parse_key(key)[1]
        for key in deletes:
            self.io.delete(partition, key)
            index.pop(key, None)
        self.writes += len(puts) + len(deletes)
        self.states[run_id], self._saved[run_id] = state, saved

    def _check_sizes(self, run_id: str, puts: list[tuple[bytes, bytes]]) -> None:
        """StateRecordTooLarge before anything is written. The diff may have moved the last save's
        bookkeeping (where a step's reports are), so the run is forgotten: its next load reads
        the table, which still holds the state before."""
        for key, value in puts:
            why = self._too_large(key, value)
            if why is not None:
                self.states.pop(run_id, None)
                self._saved.pop(run_id, None)
                raise StateRecordTooLarge(why)

    def round_too_large(self, state: RunState, key: RoundKey) -> str | None:
        """Why the run's open round `key` could not be kept (its record over the bound), or None (decided,
        or within it). Asked after each result, so that the one that makes a round too large is refused
        before anything it led to goes out, however the results are batched."""
        rnd = state.votes.open_rounds.get(key)
        if rnd is None or self.max_record_bytes is None:
            return None
        return self._too_large(record_key(state.run_id, ROUND, key), codec.dumps(rnd))

    def _too_large(self, key: bytes, value: bytes) -> str | None:
        size = len(key) + len(value) + RECORD_OVERHEAD
        if self.max_record_bytes is None or size <= self.max_record_bytes:
            return None
        kind = _parse_key(key)[1][0]
        return (f"the run's state record {kind!r} would be {size:,} bytes, over the {self.max_record_bytes:,} "
                "a state record may take (AREAL_WORKER_STATE_RECORD_MAX_BYTES, or the changelog topic's "
                "max.message.bytes)" + (": a vote round keeps every node's verdicts and sample_ids until it "
                                        "is decided" if kind == ROUND else ""))

    def _head_changed(self, old: RunState, new: RunState) -> bool:
        if any(_changed(getattr(old, name), getattr(new, name)) for name in HEAD_FIELDS):
            return True
        if old.ranks is not new.ranks and any(
                _changed(getattr(old.ranks, name), getattr(new.ranks, name)) for name in RANK_FIELDS):
            return True
        return old.votes is not new.votes and any(
            _changed(getattr(old.votes, name), getattr(new.votes, name)) for name in VOTE_FIELDS)

    def _head(self, saved: _Saved) -> bytes:
        state = saved.state
        ranks = RanksHead(**{name: getattr(state.ranks, name) for name in RANK_FIELDS},
                          waiting=tuple(state.ranks.pending))
        # numbers are given in order, so the first one kept is the lowest
        closed_range = (next(iter(saved.closed_no.values()), saved.next_no), saved.next_no)
        votes = VotesHead(**{name: getattr(state.votes, name) for name in VOTE_FIELDS},
                          open=tuple(state.votes.open_rounds), closed_range=closed_range)
        return codec.dumps(Head(**{name: getattr(state, name) for name in HEAD_FIELDS}, ranks=ranks, votes=votes))

    def _diff_rounds(self, old: VoteState, new: VoteState, saved: _Saved, puts: list[tuple[bytes, bytes]],
                     deletes: list[bytes]) -> bool:
        """Round records to put and delete; True when the head's list of them changes."""
        if old is new:
            return False
        run_id = saved.state.run_id
        changed = False
        if old.open_rounds is not new.open_rounds:
            changed = _diff_records(run_id, ROUND, old.open_rounds, new.open_rounds, puts, deletes)
        if old.closed is not new.closed:
            added, evicted = _closed_changes(old.closed, new.closed, saved.closed_no)
            saved.closed_no = dict(saved.closed_no)
            for key in evicted:
                saved.closed_no.pop(key, None)
                deletes.append(record_key(run_id, CLOSED, key))
            for key in added:
                saved.closed_no[key] = saved.next_no
                puts.append((record_key(run_id, CLOSED, key), codec.dumps(saved.next_no)))
                saved.next_no += 1
            changed = changed or bool(added or evicted)
        return changed


def _put_step(run_id: str, key: StepKey, step: PendingStep, gen: int, reports: list[RankReport],
              puts: list[tuple[bytes, bytes]], written: _Written | None = None) -> _Written:
    """The records of a waiting step that `written` (None: nothing, or another generation)
    does not hold yet: `reports`, the ones after those, as one record at the next position,
    then the step's own record. Returns where its reports are now."""
    if written is None:
        written = _Written(gen, [], 0)
    if reports:
        puts.append((record_key(run_id, REPORTS, key, gen, written.count), codec.dumps(reports)))
        written.starts.append(written.count)  # appended in place: a step's save costs its new reports only
        written.count += len(reports)
    puts.append((record_key(run_id, PENDING, key), codec.dumps(PendingRecord(
        step.world_size, step.opened_at, step.ts, gen=gen, count=written.count))))
    return written


def _put_first(run_id: str, key: StepKey, step: PendingStep, puts: list[tuple[bytes, bytes]]) -> _Written:
    """A step new to the table: one record holding its reports. Most steps complete at the next
    batch and leave with that one record (records of their own and their tombstones cost the
    worker 2.4x the changelog records at 8 ranks); a step that waits longer has its reports
    moved into records of their own at its next change (`_diff_pending`), and from then on
    each save writes its new reports only."""
    puts.append((record_key(run_id, PENDING, key), codec.dumps(PendingRecord(
        step.world_size, step.opened_at, step.ts, reports=tuple(step.reports)))))
    return _Written(0, [], 0, inline=True)


def _step_keys(run_id: str, key: StepKey, written: _Written | None) -> list[bytes]:
    """The reports' records of a waiting step."""
    if written is None:
        return []
    return [record_key(run_id, REPORTS, key, written.gen, at) for at in written.starts]


def _diff_pending(run_id: str, old: Any, new: Any, steps: dict[StepKey, _Written],
                  puts: list[tuple[bytes, bytes]], deletes: list[bytes]) -> bool:
    """The records of the waiting steps that changed (`steps`: where their reports are, kept up
    to date): a step that got reports writes them, and its own record; one whose reports do not
    continue the saved ones (or were in its record: the layout before) writes them all anew as
    the next generation, whose records replace the old ones only once the step's record names
    it (a save cut short leaves the old ones readable); a step gone leaves with its reports.
    True when the set of steps changed."""
    added = False
    for key, step in new.items():
        before = old.get(key)
        if before is step:  # most steps: the very object saved last time (the map is copied per change)
            continue
        written = steps.get(key) if before is not None else None
        if written is not None and not written.inline:
            more = step.reports.added_since(before.reports)
            if more is not None:
                if more or before != step:
                    _put_step(run_id, key, step, written.gen, more, puts, written)
                continue
        if before is None:
            steps[key] = _put_first(run_id, key, step, puts)
            added = True
            continue
        deletes.extend(_step_keys(run_id, key, written))
        steps[key] = _put_step(run_id, key, step, written.gen + 1 if written is not None else 0,
                               list(step.reports), puts)
    gone = [k for k in old if k not in new]
    for key in gone:
        deletes.append(record_key(run_id, PENDING, key))
        deletes.extend(_step_keys(run_id, key, steps.pop(key, None)))
    return added or bool(gone)


def _diff_records(run_id: str, kind: str, old: Any, new: Any, puts: list[tuple[bytes, bytes]],
                  deletes: list[bytes]) -> bool:
    """A record per changed entry of mapping `new`, a tombstone per entry gone; True when the
    set of keys changed."""
    added = False
    for key, value in new.items():
        before = old.get(key)
        if before is value:  # most entries: the very object saved last time (the map is copied per change)
            continue
        if before is None or before != value:
            puts.append((record_key(run_id, kind, key), codec.dumps(value)))
            added = added or before is None
    gone = [k for k in old if k not in new]
    deletes.extend(record_key(run_id, kind, k) for k in gone)
    return added or bool(gone)


def _closed_changes(old: tuple[RoundKey, ...], new: tuple[RoundKey, ...],
                    numbered: dict[RoundKey, int]) -> tuple[list[RoundKey], list[RoundKey]]:
    """(rounds closed since, rounds forgotten since). Closing appends and forgets the oldest
    (areal_metrics.streams.core.voting), so the usual case costs the new rounds only; anything else, a set."""
    n_new = 0
    while n_new < len(new) and new[len(new) - 1 - n_new] not in numbered:
        n_new += 1
    added = list(new[len(new) - n_new:])
    n_evicted = len(old) + n_new - len(new)
    if 0 <= n_evicted <= len(old) and old[n_evicted:] == new[:len(new) - n_new]:
        return added, list(old[:n_evicted])
    kept = set(new)
    return [k for k in new if k not in numbered], [k for k in numbered if k not in kept]


def _parse_key(raw: Any) -> tuple[str, tuple[Any, ...]]:
    """(run id, (kind, part...)) of a record key; (run id, ()) for a whole-state record."""
    raw = bytes(raw) if isinstance(raw, (bytes, bytearray)) else str(raw).encode()
    if raw.startswith(b"["):
        try:
            parts = codec.parse(raw)
        except StateDecodeError:
            parts = None
        if isinstance(parts, list) and len(parts) >= 2 and isinstance(parts[0], str) and isinstance(parts[1], str):
            return parts[0], tuple(parts[1:])
    return raw.decode("utf-8", "replace"), ()


def stored_state(table: Any, run_id: str) -> RunState | None:
    """The state of one run as the table holds it (tests, debugging)."""
    return StateStore(table).load(run_id)

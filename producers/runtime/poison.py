"""A message that kills its service twice is dead-lettered and skipped (CONTRACT.md, "No input
stops the pipeline"): a crash never loops.

Any crash counts, not only a decode error: a bug in a rule, a segfault, an out-of-memory
kill. Before a service processes a batch it records the batch's log positions in
`inflight.json` in its state folder (`CrashGuard.begin`) and empties the record once the
batch is processed (`end`). A record found at start means the last process died while it
processed those positions: each position counts one crash (`after_crash`; the counts live
in `suspects.json`). A position with a crash is processed alone, in a batch of its own, so a
second crash names one message; a position with `limit` crashes (AREAL_POISON_CRASHES,
default 2) is poison: the service does not process it again but dead-letters it
(`poison_events`: the dead letter and a critical `poison_message` alert naming topic,
partition and offset, both with ids from the position, so publishing them again after yet
another crash stores them once) and moves past it.

The rules (`spans`, `after_crash`, `crashes`, `forget`, `verdict`) are pure; `CrashGuard` is
the shell that keeps them in two small files. One service process per state folder.
`crash_marker` is a test hook (AREAL_TEST_CRASH_ON): the named service dies while it
processes a message that holds the marker, as a crash in a rule would make it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from areal_metrics.producers.contract.deadletter import letter_ts, raw_as_text, rejected
from areal_metrics.producers.contract.events import AlertEvent, RejectedEvent

log = logging.getLogger("areal.poison")

INFLIGHT_FILE = "inflight.json"
SUSPECTS_FILE = "suspects.json"
MAX_SUSPECTS = 1000  # positions remembered at most (the oldest go first)
CRASH_EXIT = 70  # the exit status of a crash the test hook makes

Span = tuple[str, int, int, int]  # topic, partition, first offset, last offset (inclusive)
Position = tuple[str, int, int]  # topic, partition, offset


@dataclass(frozen=True, slots=True)
class Suspect:
    """Offsets `first`..`last` of one partition were being processed during `crashes` crashes."""

    topic: str
    partition: int
    first: int
    last: int
    crashes: int

    def holds(self, topic: str, partition: int, offset: int) -> bool:
        return self.partition == partition and self.first <= offset <= self.last and self.topic == topic


# ------------------------------------------------------------------ the rules (pure)

def spans(positions: Iterable[Position]) -> list[Span]:
    """One span per partition: its first and last offset in the batch. A batch holds each
    partition's messages in log order (Kafka's), with no other batch's between them."""
    first: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    for t, p, o in positions:  # one pass: a batch's positions are many, its partitions few
        where = (t, p)
        if where not in first:
            first[where] = o
        last[where] = o
    return [(t, p, first[(t, p)], o) for (t, p), o in sorted(last.items())]


def crashes(suspects: Iterable[Suspect], topic: str, partition: int, offset: int) -> int:
    """How many crashes happened while the message at this position was being processed."""
    return max((s.crashes for s in suspects if s.holds(topic, partition, offset)), default=0)


def after_crash(suspects: tuple[Suspect, ...], inflight: Iterable[Span]) -> tuple[Suspect, ...]:
    """The suspects after a crash during the processing of `inflight`: one more crash for each
    of its positions."""
    out = list(suspects)
    for topic, partition, first, last in inflight:
        before = max((s.crashes for s in suspects
                      if s.topic == topic and s.partition == partition and s.first <= last and first <= s.last),
                     default=0)
        out = [s for s in out if not (s.topic == topic and s.partition == partition
                                      and first <= s.first and s.last <= last)]
        out.append(Suspect(topic, partition, first, last, before + 1))
    return tuple(out[-MAX_SUSPECTS:])


def forget(suspects: tuple[Suspect, ...], done: Mapping[tuple[str, int], int]) -> tuple[Suspect, ...]:
    """Without the suspects whose every offset is processed: `done` is the last offset processed
    per (topic, partition)."""
    return tuple(s for s in suspects if (s.topic, s.partition) not in done or s.last > done[(s.topic, s.partition)])


OK, ALONE, POISON = "ok", "alone", "poison"


def verdict(suspects: Iterable[Suspect], topic: str, partition: int, offset: int, limit: int) -> str:
    """OK: process as usual; ALONE: it was in flight in a crash, process it in a batch of its own;
    POISON: it was in flight in `limit` crashes, dead-letter it without processing it."""
    n = crashes(suspects, topic, partition, offset)
    if n >= limit:
        return POISON
    return ALONE if n else OK


def poison_reason(topic: str, partition: int, offset: int, n: int, service: str) -> str:
    return (f"{topic}/{partition}/{offset}: this message crashed the {service} {n} times while it was being "
            f"processed; dead-lettered and skipped (AREAL_POISON_CRASHES={n})")


def _position_id(kind: str, service: str, topic: str, partition: int, offset: int) -> str:
    return uuid.uuid5(uuid.NAMESPACE_URL, f"areal-poison:{kind}:{service}:{topic}:{partition}:{offset}").hex


def poison_events(raw: bytes | None, key: bytes | None, topic: str, partition: int, offset: int, n: int, *,
                  service: str, node: str, ts: float | None, now: float) -> tuple[RejectedEvent, AlertEvent]:
    """The dead letter of a poison message and its `poison_message` alert (critical). The
    message is not parsed (parsing it may be what crashed): its run is the key's, if any.
    `ts`: the message's log time in seconds, whatever its producer set (year 3000, -1, none),
    kept within what `ts` holds (`letter_ts`); `now` when it has none."""
    at = letter_ts(ts)
    ts = now if at is None else at
    reason = poison_reason(topic, partition, offset, n, service)
    dead = rejected(b"", reason, topic, node=node, key=key)
    dead = dead.replace(raw=raw_as_text(raw or b""), ts=ts,
                        event_id=_position_id("deadletter", service, topic, partition, offset))
    alert_id = _position_id("alert", service, topic, partition, offset)
    alert = AlertEvent.build(
        run_id=dead.run_id, node=node, ts=ts, event_id=alert_id, alert_id=alert_id, kind="poison_message",
        severity="critical",
        message=f"a message crashed the {service} {n} times: topic {topic}, partition {partition}, offset {offset}; "
                "dead-lettered and skipped",
    )
    return dead, alert


def crash_marker(service: str, value: str | None) -> bytes | None:
    """The marker of the test hook for this service: AREAL_TEST_CRASH_ON is `<service>:<marker>`,
    comma-separated for several services."""
    for entry in (value or "").split(","):
        name, _, marker = entry.partition(":")
        if name.strip() == service and marker:
            return marker.encode()
    return None


def crash_now(service: str, position: Position) -> None:
    """The test hook's crash: the process dies at once, as a segfault or a bug that escapes would stop it."""
    topic, partition, offset = position
    log.critical("%s: crashing on %s/%s/%s (AREAL_TEST_CRASH_ON)", service, topic, partition, offset)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(CRASH_EXIT)


# ------------------------------------------------------------------ the shell: two files

class CrashGuard:
    """The positions in flight and the suspects of one service, kept in `folder`."""

    def __init__(self, folder: Path, limit: int = 2, service: str = "service") -> None:
        self.folder = Path(folder)
        self.limit = max(1, limit)
        self.service = service
        self.suspects: tuple[Suspect, ...] = ()
        self._inflight = self.folder / INFLIGHT_FILE
        self._suspects = self.folder / SUSPECTS_FILE
        self._open = False
        self._fd: int | None = None
        self._size = 0  # the file's length, once open
        # `abandon` runs on the stop bound's timer thread, beside `begin` and `end` on the event loop
        self._lock = threading.Lock()
        self._abandoned = False

    def start(self) -> list[Span]:
        """Read the files; the spans a crash interrupted (each now counts one more crash)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.suspects = _read_suspects(self._suspects)
        crashed = _read_spans(self._inflight)
        if crashed:
            self.suspects = after_crash(self.suspects, crashed)
            self._save()
            for t, p, f, last in crashed:
                log.warning("%s: the last process died while processing %s/%d offsets %d-%d; %s", self.service, t, p,
                            f, last, "each is processed alone" if f < last else "processed alone")
        if self._inflight.exists():
            os.truncate(self._inflight, 0)  # counted once: a death before the next batch is not this one's
        return crashed

    def verdict(self, topic: str, partition: int, offset: int) -> str:
        if not self.suspects:
            return OK
        return verdict(self.suspects, topic, partition, offset, self.limit)

    def crashes(self, topic: str, partition: int, offset: int) -> int:
        return crashes(self.suspects, topic, partition, offset)

    def begin(self, batch: Iterable[Span]) -> None:
        """Record what is processed now (a crash before `end` counts against these positions)."""
        record = json.dumps([list(s) for s in batch]).encode()
        with self._lock:
            if self._abandoned:  # the process is leaving: what it starts now is not in flight at a crash
                return
            self._write(record)
            self._open = True

    def end(self, done: Iterable[Span] = ()) -> None:
        """The recorded batch is processed: its record goes, and suspects wholly processed are forgotten."""
        with self._lock:
            if self._open:
                self._write(b"[]")
                self._open = False
        if self.suspects:
            kept = forget(self.suspects, {(t, p): last for t, p, _, last in done})
            if kept != self.suspects:
                self.suspects = kept
                self._save()

    def abandon(self) -> None:
        """The process leaves on purpose with a batch in flight (a stop past its bound): not a crash, so
        nothing in flight counts against its positions at the next start; a batch begun after it is not
        recorded."""
        with self._lock:
            self._abandoned = True
            self._write(b"[]")
            self._open = False

    def _write(self, record: bytes) -> None:
        """`record` over the start of the one open file, padded with spaces to the file's length
        (JSON allows them): one pwrite a call, no path lookup and no ftruncate. `end` used to
        truncate the file its `begin` had just written (page cache dropped, blocks freed): the
        most costly line of the worker's shell in a sampled profile of the pipeline benchmark
        (2.7 % of the worker's CPU samples); written over in place, the page stays. A record
        torn by a crash while it is written names nothing processed yet and reads as none: the
        file holds `[]` and spaces before each `begin`, and a strict prefix of a record followed
        by those is not JSON (or is `[]`); a torn `[]` over a record leaves that record, in
        flight as before `end`."""
        if self._fd is None:
            self._fd = os.open(self._inflight, os.O_RDWR | os.O_CREAT, 0o644)
            self._size = os.fstat(self._fd).st_size
        if len(record) < self._size:
            record += b" " * (self._size - len(record))
        os.pwrite(self._fd, record, 0)
        self._size = len(record)

    def _save(self) -> None:
        tmp = self._suspects.with_suffix(".tmp")
        tmp.write_text(json.dumps([[s.topic, s.partition, s.first, s.last, s.crashes] for s in self.suspects]))
        os.replace(tmp, self._suspects)


def _read_spans(path: Path) -> list[Span]:
    try:
        raw = json.loads(path.read_text())
        return [(str(t), int(p), int(f), int(last)) for t, p, f, last in raw]
    except (OSError, ValueError, TypeError):  # none, or torn while written (nothing processed yet)
        return []


def _read_suspects(path: Path) -> tuple[Suspect, ...]:
    try:
        raw = json.loads(path.read_text())
        return tuple(Suspect(str(t), int(p), int(f), int(last), int(n)) for t, p, f, last, n in raw)
    except (OSError, ValueError, TypeError):
        return ()

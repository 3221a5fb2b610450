"""An append-only local journal of messages that could not be sent yet.

One line per message: ``topic \\t key \\t value``. The value is the event's
JSON, which never contains a raw tab or newline (json escapes them). A cursor
file holds the byte offset of the first message not yet acknowledged by the
broker; it moves forward only after the broker acknowledged, so a crash at any
point re-sends (same event_id) rather than loses. When everything is sent the
journal is truncated.

Writes go to the OS page cache (flushed per append), which survives a crash of
the process; `fsync=True` also survives a crash of the machine, at a cost.
"""

from __future__ import annotations

import fcntl
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from areal_metrics.producers.contract.errors import UserError


@dataclass(frozen=True, slots=True)
class JournalRecord:
    topic: str
    key: bytes
    value: bytes
    end: int  # byte offset just after this record


class JournalLocked(UserError, RuntimeError):
    """Another publisher owns this journal directory."""


class Journal:
    def __init__(self, directory: Path, *, fsync: bool = False) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._lock = threading.Lock()
        self._lock_file = open(self.directory / "journal.lock", "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise JournalLocked(f"journal {self.directory} is in use by another publisher") from None
        self._path = self.directory / "journal.log"
        self._cursor_path = self.directory / "journal.cursor"
        self._file = open(self._path, "ab")
        self._cursor = self._read_cursor()
        self._size = self._path.stat().st_size
        self._drop_torn_tail()

    def _read_cursor(self) -> int:
        try:
            return int(self._cursor_path.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _drop_torn_tail(self) -> None:
        """A crash mid-append can leave a line without its newline: drop it."""
        if self._size == 0:
            return
        with open(self._path, "rb") as f:
            f.seek(self._size - 1)
            if f.read(1) == b"\n":
                return
            data = self._path.read_bytes()
        keep = data.rfind(b"\n") + 1
        self._file.truncate(keep)
        self._size = keep

    @property
    def pending_bytes(self) -> int:
        return self._size - self._cursor

    def has_pending(self) -> bool:
        return self._size > self._cursor

    def append(self, topic: str, key: bytes, value: bytes) -> None:
        """Add a record at the end; an OSError (a full disk, a file-size limit) leaves the journal as it
        was, without a part of the line that a later append would run into."""
        line = b"%s\t%s\t%s\n" % (topic.encode(), key, value)
        with self._lock:
            try:
                self._file.write(line)
                self._file.flush()
                if self._fsync:
                    os.fsync(self._file.fileno())
            except OSError:
                self._reopen_at(self._size)
                raise
            self._size += len(line)

    def _reopen_at(self, size: int) -> None:
        """After a failed write: drop what its buffer still holds and what reached the file past `size`."""
        try:
            self._file.close()  # its flush fails again, and the file is closed all the same
        except OSError:
            pass
        os.truncate(self._path, size)  # shrinking needs no space
        self._file = open(self._path, "ab")

    def read(self, max_records: int) -> list[JournalRecord]:
        """The oldest pending records, in order."""
        with self._lock:
            start, end = self._cursor, self._size
        out: list[JournalRecord] = []
        with open(self._path, "rb") as f:
            f.seek(start)
            offset = start
            while len(out) < max_records and offset < end:
                line = f.readline()
                if not line.endswith(b"\n"):
                    break
                offset += len(line)
                topic, key, value = line[:-1].split(b"\t", 2)
                out.append(JournalRecord(topic.decode(), key, value, offset))
        return out

    def advance(self, offset: int) -> None:
        """Everything before `offset` is acknowledged; truncate when all is."""
        with self._lock:
            self._cursor = max(self._cursor, offset)
            if self._cursor >= self._size:
                self._file.truncate(0)
                self._file.seek(0)
                self._size = self._cursor = 0
            tmp = self._cursor_path.with_suffix(".tmp")
            tmp.write_text(str(self._cursor))
            os.replace(tmp, self._cursor_path)

    def prepend(self, records: list[tuple[str, bytes, bytes]]) -> None:
        """Put older records before the pending ones (rare: closing with messages in flight)."""
        if not records:
            return
        with self._lock:
            with open(self._path, "rb") as f:
                f.seek(self._cursor)
                pending = f.read(self._size - self._cursor)
            tmp = self._path.with_suffix(".rewrite")
            try:
                with open(tmp, "wb") as f:
                    for topic, key, value in records:
                        f.write(b"%s\t%s\t%s\n" % (topic.encode(), key, value))
                    f.write(pending)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError:  # the journal as it was; the records were not added
                tmp.unlink(missing_ok=True)
                raise
            self._file.close()
            os.replace(tmp, self._path)
            self._cursor_path.write_text("0")
            self._cursor = 0
            self._file = open(self._path, "ab")
            self._size = self._path.stat().st_size

    def close(self) -> None:
        with self._lock:
            self._file.close()
        fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        self._lock_file.close()


SLOTS = 64  # directories a journal falls back to: <dir>, <dir>.1, ... <dir>.63


def open_journal(directory: Path, *, fsync: bool = False) -> Journal:
    """The journal in `directory`, or in the first free sibling slot `<dir>.1`, `<dir>.2`, ... when it is in use.

    Two processes that default to one directory (two ranks on one host, an old
    attempt still exiting) each get their own; a journal left in a slot is
    re-sent by the next process that opens that slot.
    """
    directory = Path(directory)
    for slot in range(SLOTS):
        path = directory if slot == 0 else directory.with_name(f"{directory.name}.{slot}")
        try:
            return Journal(path, fsync=fsync)
        except JournalLocked:
            continue
    raise JournalLocked(f"journal {directory} and its {SLOTS - 1} fallback slots are all in use")

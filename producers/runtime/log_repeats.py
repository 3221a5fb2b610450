"""A bound on the long-running services' log (the stream worker, the sink) while a failure repeats.

With its broker gone the stream worker's Kafka client (aiokafka) logged the same five lines
~100 times a second: 384,603 bytes in 30 s, about 1 GB a day, appended to
`$AREAL_HOME/logs/worker.log` (docs/RELIABILITY.md). `RepeatedLines` lets a line through when
the same logger has not let the same line through at the same level within `window_s`; the next
one let through says how many like it were held back. Of our own loggers a line is its text: one
that differs in anything (another run, another offset) shows at once. Of a library's (aiokafka,
kafka-python, Faust) a line is its text without its fractional numbers: their retry lines carry
a changing backoff ("... failed: ... (backoff 0.41 secs)") and are one line, while another node,
address or error is another line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

MAX_LINES = 1_000  # distinct lines remembered, the least recent forgotten first
OWN_LOGGERS = frozenset({"areal", "areal_metrics", "streams"})  # the first part of our loggers' names


def _shape(record: logging.LogRecord) -> str:
    """A library's line without what changes from one retry to the next: its template and its
    arguments but the fractional numbers (a backoff, a wait); a node, an address, an error stay."""
    args = record.args if isinstance(record.args, tuple) else ()
    return "\x00".join([str(record.msg), *(str(a) for a in args if not isinstance(a, float))])


class RepeatedLines(logging.Filter):
    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self._seen: OrderedDict[tuple[str, int, str], tuple[float, int]] = OrderedDict()  # -> (let through at, held)
        self._lock = threading.Lock()  # the Kafka clients log from their own threads, and filters run unlocked

    def filter(self, record: logging.LogRecord) -> bool:
        if self.window_s <= 0:
            return True
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - arguments that do not fit: logging reports it when it formats
            return True
        key = (record.name, record.levelno, text if record.name.partition(".")[0] in OWN_LOGGERS else _shape(record))
        with self._lock:
            now = self.clock()
            last, held = self._seen.get(key, (None, 0))
            if last is not None and now - last < self.window_s:
                self._seen[key] = (last, held + 1)
                return False
            self._seen[key] = (now, 0)
            self._seen.move_to_end(key)
            while len(self._seen) > MAX_LINES:
                self._seen.popitem(last=False)
        if held and last is not None:
            record.msg, record.args = f"{text} ({held} more like it held back in the last {now - last:.0f} s)", None
        return True


def bound_repeated_lines(window_s: float) -> None:
    """`RepeatedLines` on every handler of the root logger (basicConfig's): every logger's lines pass there."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(RepeatedLines(window_s))

"""A bound on the long-running services' log (the stream worker, the sink) while a failure repeats.

With its broker gone the stream worker's Kafka client logged the same five messages ~100 times
a second: 800 KB of log a minute, about 1 GB a day, appended to `$AREAL_HOME/logs/worker.log`
(docs/RELIABILITY.md). `RepeatedLines` lets a line through when its logger and message template
(the text before its arguments) have not been let through within `window_s`; the next one let
through says how many like it were held back. Each distinct failure still shows at once, and a
failure that goes on shows once a window, with its count.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

MAX_KINDS = 1_000  # templates remembered, the least recent forgotten first (a message formatted in place is its own)


class RepeatedLines(logging.Filter):
    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self._kinds: OrderedDict[tuple[str, int, str], tuple[float, int]] = OrderedDict()  # -> (let through at, held)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.window_s <= 0:
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        last, held = self._kinds.get(key, (None, 0))
        if last is not None and now - last < self.window_s:
            self._kinds[key] = (last, held + 1)
            return False
        self._kinds[key] = (now, 0)
        self._kinds.move_to_end(key)
        while len(self._kinds) > MAX_KINDS:
            self._kinds.popitem(last=False)
        if held and last is not None:
            try:
                text = record.getMessage()
            except Exception:  # noqa: BLE001 - arguments that do not fit: logging reports it when it formats
                return True
            record.msg, record.args = f"{text} ({held} more like it held back in the last {now - last:.0f} s)", None
        return True


def bound_repeated_lines(window_s: float) -> None:
    """`RepeatedLines` on every handler of the root logger (basicConfig's): every logger's lines pass there."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(RepeatedLines(window_s))

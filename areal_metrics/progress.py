"""Progress on the terminal for the CLI's long steps (`up`, `replay`, `report`, `demo`, waits).

Shown on standard error only when it is a terminal, so that scripts, pipes and
logs see the verb's one result line and nothing else. One line, redrawn in
place; cleared when the step ends.

    with Progress("starting Kafka") as p:
        ...; p.update("creating topics")
    with Progress("replaying", total=n) as p:
        for i in ...: p.advance()
    wait_for(lambda: broker_ready(), timeout=30, label="waiting for Kafka")
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24
REDRAW_S = 0.1  # at most ten redraws a second


def render(label: str, elapsed: float, done: int | None = None, total: int | None = None) -> str:
    """One progress line (pure): a bar when the total is known, else the elapsed time."""
    if total:
        share = min(max((done or 0) / total, 0.0), 1.0)
        filled = int(round(share * BAR_WIDTH))
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        return f"{label} [{bar}] {done}/{total} {elapsed:.0f}s"
    if done:
        return f"{label} ... {done} {elapsed:.0f}s"
    return f"{label} ... {elapsed:.0f}s"


class Progress:
    """A one-line progress display on `stream` (stderr), silent when it is not a TTY."""

    def __init__(self, label: str, total: int | None = None, stream: TextIO | None = None,
                 force: bool | None = None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self._stream = stream or sys.stderr
        self.enabled = force if force is not None else _is_tty(self._stream)
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._width = 0

    def __enter__(self) -> Progress:
        self._draw(force=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.clear()

    def update(self, label: str | None = None, done: int | None = None, total: int | None = None) -> None:
        if label is not None:
            self.label = label
        if done is not None:
            self.done = done
        if total is not None:
            self.total = total
        self._draw(force=label is not None)

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def tick(self) -> None:
        """Redraw (the elapsed time moves on) without progress; for waits."""
        self._draw()

    def clear(self) -> None:
        if self.enabled and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
            self._width = 0

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < REDRAW_S:
            return
        self._last_draw = now
        line = render(self.label, now - self._start, self.done, self.total)
        pad = max(self._width - len(line), 0)
        self._stream.write("\r" + line + " " * pad)
        self._stream.flush()
        self._width = len(line)


def wait_for(ready: Callable[[], bool], timeout: float, label: str, interval: float = 0.2) -> bool:
    """Poll `ready()` until it is true or `timeout` seconds passed; progress on a terminal."""
    deadline = time.monotonic() + timeout
    with Progress(label) as progress:
        while True:
            if ready():
                return True
            if time.monotonic() >= deadline:
                return False
            progress.tick()
            time.sleep(min(interval, max(deadline - time.monotonic(), 0.0)))


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False

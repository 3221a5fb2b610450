"""A log line that repeats is written once a window, the next one counting what was held back
(producers/runtime/log_repeats.py); with the broker gone the worker's log stays small
(tests/test_worker_stop.py)."""

from __future__ import annotations

import logging

from areal_metrics.producers.runtime.log_repeats import MAX_KINDS, RepeatedLines


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def written(window_s: float, lines: list[tuple[float, str, str, tuple[object, ...]]]) -> list[str]:
    """(time, logger, template, args) through a RepeatedLines: the messages it lets through."""
    clock = Clock()
    kept = RepeatedLines(window_s, clock)
    out = []
    for at, name, template, args in lines:
        clock.now = 1000.0 + at
        record = logging.LogRecord(name, logging.ERROR, __file__, 1, template, args, None)
        if kept.filter(record):
            out.append(record.getMessage())
    return out


def test_a_repeated_line_is_written_once_a_window_with_the_count_held_back() -> None:
    failing = [(i / 10, "aiokafka", "Unable connect to node with id %s: %s", (1, f"Errno {111 + i % 2}"))
               for i in range(1201)]  # 10 a second for two minutes, its arguments changing
    assert written(60, failing) == ["Unable connect to node with id 1: Errno 111",
                                    "Unable connect to node with id 1: Errno 111 (599 more like it held back in the last 60 s)",
                                    "Unable connect to node with id 1: Errno 111 (599 more like it held back in the last 60 s)"]


def test_other_loggers_and_templates_pass_at_once_and_a_window_of_0_keeps_every_line() -> None:
    lines = [(0, "aiokafka", "a %s", (1,)), (1, "aiokafka.fetcher", "a %s", (1,)), (2, "aiokafka", "b", ()),
             (3, "aiokafka", "a %s", (2,))]
    assert written(60, lines) == ["a 1", "a 1", "b"]
    assert written(0, lines) == ["a 1", "a 1", "b", "a 2"]


def test_arguments_that_do_not_fit_never_raise_into_the_caller() -> None:
    lines = [(0, "x", "%d items", ("many",)), (61, "x", "%d items", ("many",)), (200, "x", "%d items", (3,))]
    clock = Clock()
    kept = RepeatedLines(60, clock)
    let_through = []
    for at, name, template, args in lines:
        clock.now = at
        let_through.append(kept.filter(logging.LogRecord(name, logging.ERROR, __file__, 1, template, args, None)))
    assert let_through == [True, True, True]


def test_the_templates_remembered_are_bounded() -> None:
    clock = Clock()
    kept = RepeatedLines(60, clock)
    for i in range(MAX_KINDS + 500):  # messages formatted in place: each its own template
        kept.filter(logging.LogRecord("x", logging.ERROR, __file__, 1, f"run {i} failed", None, None))
    assert len(kept._kinds) == MAX_KINDS
    # the oldest were forgotten: their line passes again, the newest is still held
    assert kept.filter(logging.LogRecord("x", logging.ERROR, __file__, 1, "run 0 failed", None, None))
    assert not kept.filter(logging.LogRecord("x", logging.ERROR, __file__, 1, f"run {MAX_KINDS + 499} failed", None,
                                             None))

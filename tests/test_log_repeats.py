"""A log line that repeats is written once a window, the next one counting what was held back
(producers/runtime/log_repeats.py); with the broker gone the worker's log stays small
(tests/test_worker_stop.py)."""

from __future__ import annotations

import logging
import threading

from areal_metrics.producers.runtime.log_repeats import MAX_LINES, RepeatedLines


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(name: str, template: str, args: tuple[object, ...] | None = None) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, template, args, None)


def written(window_s: float, lines: list[tuple[float, str, str, tuple[object, ...]]]) -> list[str]:
    """(time, logger, template, args) through a RepeatedLines: the messages it lets through."""
    clock = Clock()
    kept = RepeatedLines(window_s, clock)
    out = []
    for at, name, template, args in lines:
        clock.now = 1000.0 + at
        line = record(name, template, args)
        if kept.filter(line):
            out.append(line.getMessage())
    return out


def test_a_repeated_line_is_written_once_a_window_with_the_count_held_back() -> None:
    failing = [(i / 10, "aiokafka", "Unable connect to node with id %s: %s", (1, "[Errno 111]"))
               for i in range(1201)]  # 10 a second for two minutes
    assert written(60, failing) == [
        "Unable connect to node with id 1: [Errno 111]",
        "Unable connect to node with id 1: [Errno 111] (599 more like it held back in the last 60 s)",
        "Unable connect to node with id 1: [Errno 111] (599 more like it held back in the last 60 s)"]


def test_a_line_that_differs_passes_at_once_and_a_window_of_0_keeps_every_line() -> None:
    lines = [(0, "areal.sink", "dead-lettered %s/%d", ("steps", 5)), (1, "areal.sink", "dead-lettered %s/%d", ("steps", 6)),
             (2, "areal.other", "dead-lettered %s/%d", ("steps", 5)), (3, "areal.sink", "dead-lettered %s/%d", ("steps", 5))]
    assert written(60, lines) == ["dead-lettered steps/5", "dead-lettered steps/6", "dead-lettered steps/5"]
    assert written(0, lines) == ["dead-lettered steps/5", "dead-lettered steps/6", "dead-lettered steps/5",
                                 "dead-lettered steps/5"]


def test_a_librarys_line_is_its_template_and_ours_its_text() -> None:
    # kafka-python's bootstrap retries: the backoff changes every line, the line is the same
    retries = [(i, "kafka.net.manager", "Bootstrap connection to %s failed: %s (backoff %.2f secs)",
                ("bootstrap-0", "KafkaConnectionError: 111 ECONNREFUSED", 0.1 * 1.7 ** (i % 5))) for i in range(61)]
    out = written(60, retries)
    assert len(out) == 2 and out[1].endswith("(59 more like it held back in the last 60 s)")
    # another node, another error: another line, at once
    nodes = written(60, [(0, "aiokafka", "Unable connect to node with id %s: %s", (1, "[Errno 111]")),
                         (1, "aiokafka", "Unable connect to node with id %s: %s", (2, "[Errno 111]")),
                         (2, "aiokafka", "Unable connect to node with id %s: %s", (1, "SASL authentication failed")),
                         (3, "aiokafka", "Unable connect to node with id %s: %s", (1, "[Errno 111]"))])
    assert nodes == ["Unable connect to node with id 1: [Errno 111]", "Unable connect to node with id 2: [Errno 111]",
                     "Unable connect to node with id 1: SASL authentication failed"]
    # the same with our own logger: each text is its own line (five backoffs), the first again at 60 s
    ours = written(60, [(at, "areal.sink", template, args) for at, _, template, args in retries])
    assert len(ours) == 6 and ours[5].endswith("(backoff 0.10 secs) (11 more like it held back in the last 60 s)")


def test_arguments_that_do_not_fit_never_raise_into_the_caller() -> None:
    clock = Clock()
    kept = RepeatedLines(60, clock)
    let_through = []
    for at in (0, 1, 61):
        clock.now = at
        let_through.append(kept.filter(record("x", "%d items", ("many",))))
    assert let_through == [True, True, True]  # logging itself reports the line it cannot format


def test_the_lines_remembered_are_bounded() -> None:
    kept = RepeatedLines(60, Clock())
    for i in range(MAX_LINES + 500):
        kept.filter(record("areal.x", "run %s failed", (i,)))
    assert len(kept._seen) == MAX_LINES
    # the oldest were forgotten: their line passes again; the newest is still held
    assert kept.filter(record("areal.x", "run %s failed", (0,)))
    assert not kept.filter(record("areal.x", "run %s failed", (MAX_LINES + 499,)))


def test_threads_logging_the_same_line_are_counted_exactly() -> None:
    clock = Clock()
    kept = RepeatedLines(60, clock)
    threads, each = 8, 20_000
    passed: list[bool] = []

    def log_many() -> None:
        passed.extend(kept.filter(record("aiokafka", "Unable connect")) for _ in range(each))

    workers = [threading.Thread(target=log_many) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert passed.count(True) == 1
    clock.now += 60
    line = record("aiokafka", "Unable connect")
    assert kept.filter(line) and line.getMessage() == (
        f"Unable connect ({threads * each - 1} more like it held back in the last 60 s)")

"""The skipped-input guard: a jump in offsets makes the worker seek back and re-read."""

from __future__ import annotations

from areal_metrics.streams.shell.resync import InputGuard

TP = ("areal.steps", 2)


def read_fetch(g: InputGuard, fetch: list[int], now: float, processed: list[int], position: int) -> int:
    """One fetch through the guard as InputFeed.deliver hands it over (every message, seek or not); the
    position of the next fetch (a seek takes effect there)."""
    next_position = fetch[-1] + 1 if fetch else position
    for o in fetch:
        verdict, target = g.on_message(TP, o, now)
        if verdict == "process":
            processed.append(o)
        elif verdict == "seek":
            assert target is not None
            next_position = target
    return next_position


def unstick(g: InputGuard, position: int, now: float) -> int:
    """The shell's stuck-partition timer (InputFeed.unstick): the position after its seek, if any."""
    target = g.stuck(TP, position, now, committed=0)
    return position if target is None else target


def test_contiguous_input_is_processed() -> None:
    g = InputGuard()
    assert [g.on_message(TP, o, 0.0) for o in range(4)] == [("process", None)] * 4
    assert g.seeks == 0


def test_jump_seeks_back_drops_until_the_hole_is_filled_then_goes_on() -> None:
    g = InputGuard()
    for o in range(11):
        g.on_message(TP, o, 0.0)
    assert g.on_message(TP, 150, 1.0) == ("seek", 11)
    assert g.on_message(TP, 151, 1.0) == ("drop", None)  # still buffered after the jump
    assert g.on_message(TP, 11, 1.5) == ("process", None)  # the seek worked
    assert [g.on_message(TP, o, 1.5)[0] for o in range(12, 152)] == ["process"] * 140
    assert g.last[TP] == 151 and g.seeks == 1


def test_a_hole_that_cannot_be_filled_is_accepted_after_a_while() -> None:
    g = InputGuard(give_up_s=30)
    g.on_message(TP, 5, 0.0)
    assert g.on_message(TP, 9, 0.0) == ("seek", 6)
    assert g.on_message(TP, 9, 10.0) == ("drop", None)
    assert g.on_message(TP, 9, 31.0) == ("seek", 6)  # given up: read once more from the hole...
    assert g.on_message(TP, 8, 31.5) == ("process", None)  # ... and take what comes first
    assert g.accepted_gaps == 1
    assert [g.on_message(TP, o, 31.5) for o in (9, 10)] == [("process", None)] * 2


def test_a_hole_no_seek_fills_is_given_up_on_while_the_timer_keeps_seeking_and_nothing_after_it_is_lost() -> None:
    """A transaction's commit marker (offset 10) is never delivered. The unstick timer's seeks every 5 s
    used to restart the hole's clock, so it was never given up on: the partition dropped (and acked)
    every later message for good. Simulated as the shell drives the guard: one message every 0.5 s."""
    g = InputGuard()
    marker, log_end, position, processed = 10, 0, 0, []
    t = 0.0
    while t < 120.0:
        log_end += 1
        position = read_fetch(g, [o for o in range(position, log_end) if o != marker], t, processed, position)
        if t % 5 == 0:
            position = unstick(g, position, t)
        t += 0.5
    assert g.accepted_gaps == 1 and TP not in g.seeking
    assert set(processed) == set(range(log_end)) - {marker}  # every message but the marker, none lost
    assert g.seeks < 10


def test_older_messages_after_a_seek_are_processed_again() -> None:
    g = InputGuard()
    for o in range(5):
        g.on_message(TP, o, 0.0)
    assert g.on_message(TP, 3, 0.0) == ("process", None)  # redelivery: the core deduplicates
    assert g.last[TP] == 4


def test_stuck_partition_is_noticed_after_a_quiet_spell() -> None:
    g = InputGuard(stuck_after_s=10)
    g.on_message(TP, 9, 100.0)
    assert g.stuck(TP, position=10, now=200.0) is None  # everything fetched was delivered
    assert g.stuck(TP, position=22, now=105.0) is None  # not quiet for long enough
    assert g.stuck(TP, position=22, now=111.0) == 10
    assert g.stuck(TP, position=22, now=112.0) is None  # a seek is under way
    assert g.stuck(TP, position=22, now=122.0) == 10  # ... and it did not help: again
    g.forget()
    assert g.stuck(TP, position=22, now=500.0) is None


def test_partition_that_never_delivered_uses_the_committed_offset() -> None:
    g = InputGuard(stuck_after_s=10)
    assert g.stuck(TP, position=30, now=0.0, committed=0) is None  # starts the quiet clock
    assert g.stuck(TP, position=30, now=11.0, committed=0) == 0
    assert g.stuck(TP, position=0, now=50.0, committed=0) is None  # nothing fetched yet


def test_the_shell_goes_on_through_a_fetch_after_a_seek_and_still_processes_in_order_and_loses_nothing() -> None:
    """InputFeed.deliver hands every message of a fetch to the guard, seek or not: after giving up, the next
    message of that fetch (newer than the re-read's) was taken first, and 61 came before 11 to 60."""
    g = InputGuard()
    marker, log_end, position, processed = 10, 0, 0, []
    t = 0.0
    while t < 120:
        log_end += 2
        position = read_fetch(g, [o for o in range(position, log_end) if o != marker][:8], t, processed, position)
        if t % 5 == 0:
            position = unstick(g, position, t)
        if 40 <= t < 60:
            g.touch(t)  # the reader paused on purpose meanwhile: the hole keeps its age
        t += 1.0
    assert g.accepted_gaps == 1
    assert processed == sorted(processed)  # in offset order
    assert set(processed) == set(range(log_end)) - {marker}  # none lost


def test_a_pause_does_not_restart_a_holes_age() -> None:
    g = InputGuard(give_up_s=30)
    g.on_message(TP, 5, 0.0)
    assert g.on_message(TP, 9, 0.0) == ("seek", 6)
    g.touch(20.0)
    assert g.on_message(TP, 9, 31.0) == ("seek", 6)  # 31 s after the hole was first seen


def test_a_hole_whose_re_read_brings_nothing_at_or_below_the_give_up_offset_is_given_up_afresh() -> None:
    """Retention moved the log's start past the offset a hole was given up at (the consumer resets to the
    earliest): the re-read brings only newer messages. They were dropped for good; now the next seek back
    gives up afresh and the partition goes on."""
    g = InputGuard()
    log_start, end, position, processed, gave_up_at = 0, 10, 0, [], None
    t = 0.0
    while t < 300:
        end += 4
        if t == 1:
            end, log_start = 400, 15  # a backlog, and retention deleted 10-14 before they were read
        if gave_up_at is not None and log_start <= gave_up_at:
            log_start = gave_up_at + 1  # retention's next deletion lands between the give-up and the re-read
        position = max(position, log_start)
        position = read_fetch(g, list(range(position, end))[:8], t, processed, position)
        hole = g.seeking.get(TP)
        if gave_up_at is None and hole is not None and hole.final is not None:
            gave_up_at = hole.final
        if t % 5 == 0:
            position = unstick(g, position, t)
        t += 1.0
    assert gave_up_at is not None and max(processed) == end - 1 and processed == sorted(processed)

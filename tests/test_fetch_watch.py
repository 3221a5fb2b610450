"""The sink's watch for a consumer that stopped fetching (sinks/fetch_watch.py): pure, no broker."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_metrics.sinks.fetch_watch import FetchWatch


def watch_at(stall_s: float = 30.0, min_poll_s: float = 5.0) -> FetchWatch[str]:
    w: FetchWatch[str] = FetchWatch(stall_s, min_poll_s)
    assert not w.due(0.0)  # the first call starts the clock
    return w


def test_a_partition_behind_its_end_at_the_same_position_twice_is_stalled() -> None:
    w = watch_at()
    assert not w.due(29.9)
    assert w.due(30.0)
    w.polled(30.0)
    assert w.check(30.0, {"a": 5, "b": 9}, {"a": 10, "b": 9}) == set()  # once is not enough
    w.polled(30.0)
    assert w.check(60.0, {"a": 5, "b": 9}, {"a": 10, "b": 9}) == {"a"}  # b has nothing to read


def test_a_partition_that_moved_or_caught_up_is_not_stalled() -> None:
    w = watch_at()
    w.polled(30.0)
    w.check(30.0, {"a": 5, "b": 5}, {"a": 10, "b": 10})
    w.polled(30.0)
    assert w.check(60.0, {"a": 6, "b": 10}, {"a": 12, "b": 12}) == set()  # a moved, b caught up (then fell behind)
    w.polled(30.0)
    assert w.check(90.0, {"a": 6, "b": 10}, {"a": 12, "b": 12}) == {"a", "b"}


def test_a_loop_held_by_a_store_outage_is_not_a_stalled_fetcher() -> None:
    """Between the checks the sink polled 1 s in all (it was retrying its insert): its positions did
    not move because it did not poll, and nothing is judged."""
    w = watch_at()
    w.polled(30.0)
    w.check(30.0, {"a": 5}, {"a": 10})
    w.polled(1.0)
    assert w.check(90.0, {"a": 5}, {"a": 10}) == set()
    w.polled(5.0)
    assert w.check(120.0, {"a": 5}, {"a": 10}) == {"a"}  # the polling it needs, from that check on


def test_a_partition_without_an_end_offset_is_not_judged_and_reset_forgets() -> None:
    w = watch_at()
    w.polled(30.0)
    w.check(30.0, {"a": 5}, {"a": 10})
    w.polled(30.0)
    assert w.check(60.0, {"a": 5}, {}) == set()
    w.polled(30.0)
    w.check(90.0, {"a": 5}, {"a": 10})
    w.reset(91.0)
    assert not w.due(120.0) and w.due(121.0)
    w.polled(30.0)
    assert w.check(121.0, {"a": 5}, {"a": 10}) == set()  # the reset forgot the sighting before it


def test_a_partition_resumed_after_a_pause_is_judged_afresh() -> None:
    """The sink paused it on purpose: standing still until its resume is no stall."""
    w = watch_at()
    w.polled(30.0)
    w.check(30.0, {"a": 5, "b": 5}, {"a": 10, "b": 10})
    w.forget({"a"})
    w.polled(30.0)
    assert w.check(60.0, {"a": 5, "b": 5}, {"a": 10, "b": 10}) == {"b"}


def test_a_rebalance_is_not_judged_until_it_outlasts_the_groups_rebalance_timeout() -> None:
    """Positions stand still in a rebalance: nothing is judged, and the sightings before it are forgotten;
    one that lasts past the bound (the coordinator completes it by then without whoever did not join) is
    a join that does not complete."""
    w = watch_at()
    w.polled(30.0)
    w.check(30.0, {"a": 5}, {"a": 10})
    assert not w.rebalance_stuck(60.0, since=40.0, bound_s=630.0)
    w.polled(30.0)
    assert w.check(90.0, {"a": 5}, {"a": 10}) == set()  # the sighting before the rebalance was forgotten
    assert not w.rebalance_stuck(670.0, since=40.0, bound_s=630.0)
    assert w.rebalance_stuck(671.0, since=40.0, bound_s=630.0)
    assert not FetchWatch(0.0).rebalance_stuck(1e6, since=0.0, bound_s=630.0)  # 0: never


def test_stall_zero_never_watches_and_negative_bounds_are_refused() -> None:
    w: FetchWatch[str] = FetchWatch(0.0)
    assert not any(w.due(t) for t in (0.0, 1e6, 1e9))
    with pytest.raises(ValueError):
        FetchWatch(-1.0)
    with pytest.raises(ValueError):
        FetchWatch(30.0, -1.0)


@given(st.lists(st.tuples(st.dictionaries(st.sampled_from("abcd"), st.integers(0, 5), max_size=4),
                          st.dictionaries(st.sampled_from("abcd"), st.integers(0, 5), max_size=4),
                          st.floats(0, 10)), min_size=1, max_size=8))
def test_stalled_means_behind_now_and_at_the_last_check_at_the_same_position_with_polling_between(
        checks: list[tuple[dict[str, int], dict[str, int], float]]) -> None:
    w = watch_at(stall_s=20.0, min_poll_s=5.0)
    before: dict[str, int] = {}
    for i, (positions, ends, polled) in enumerate(checks):
        w.polled(polled)
        stalled = w.check(20.0 * (i + 1), positions, ends)
        behind = {p: pos for p, pos in positions.items() if p in ends and pos < ends[p]}
        expected = {p for p, pos in behind.items() if polled >= 5.0 and before.get(p) == pos}
        assert stalled == expected
        before = behind


def test_a_short_stall_needs_half_of_it_polled() -> None:
    w = watch_at(stall_s=2.0)
    w.polled(2.0)
    w.check(2.0, {"a": 5}, {"a": 10})
    w.polled(0.9)
    assert w.check(4.0, {"a": 5}, {"a": 10}) == set()
    w.polled(1.0)
    assert w.check(6.0, {"a": 5}, {"a": 10}) == {"a"}

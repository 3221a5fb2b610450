"""No poison pill: a row that no insert can store is dead-lettered, the rest of its batch is
stored, and the events after it on its partition become visible.

The bisection (`sinks.isolate`) on its own, then the sink on the real broker with the
embedded engine: once through the reader's validation (a lone-surrogate metric key), once
with a row that validation let through and the store refuses (the hole the validation closed,
reopened for the test by a decoder that keeps the surrogate).
"""

from __future__ import annotations

import json
import types
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest

from areal_metrics.producers.contract.events import StepEvent
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.sinks.batching import BatchPolicy
from areal_metrics.sinks.isolate import DataError, is_data_error, isolate, part_token
from areal_metrics.sinks.rows import Located
from tests.support import wait_for
from tests.test_sink_broker import Producer, lag, sink_in_a_thread


def located(n: int) -> list[Located]:
    return [Located(StepEvent(run_id="r", step=i, epoch=0, event_id=f"e{i}"), "areal.steps", 0, 100 + i)
            for i in range(n)]


class Store:
    """Blocks as an insert would store them: all rows, or none when one of them is bad."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad
        self.blocks: list[tuple[str, list[int]]] = []

    def insert(self, rows: Sequence[Located], token: str) -> int:
        if any(r.offset in self.bad for r in rows):
            raise DataError(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"))
        self.blocks.append((token, [r.offset for r in rows]))
        return len(rows)


@pytest.mark.parametrize("n,bad", [(1, set()), (1, {100}), (8, {103}), (9, {100, 108}), (16, set(range(100, 116))),
                                   (33, {101, 117, 118, 132})])
def test_bisection_stores_every_good_row_once_and_returns_the_bad_ones(n: int, bad: set[int]) -> None:
    rows, store = located(n), Store(bad)
    stored, failed = isolate(rows, "t", store.insert)
    offsets = [o for _, block in store.blocks for o in block]
    assert sorted(offsets) == [r.offset for r in rows if r.offset not in bad]  # each good row once
    assert stored == n - len(bad)
    assert [loc.offset for loc, _ in failed] == sorted(bad)
    assert all("surrogates not allowed" in str(exc) for _, exc in failed)
    # the same chunk bisected again (after a crash) gives the same blocks: they deduplicate
    again = Store(bad)
    isolate(rows, "t", again.insert)
    assert again.blocks == store.blocks
    assert len({token for token, _ in store.blocks}) == len(store.blocks)


def test_a_part_token_names_its_first_and_last_log_positions() -> None:
    rows = located(4)
    assert part_token("areal.steps:0:100-103", rows[2:]) == "areal.steps:0:100-103:0.102-0.103"


def test_only_errors_no_retry_can_pass_are_data_errors() -> None:
    from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

    assert is_data_error(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"))
    assert is_data_error(TypeError("bad value"))
    assert is_data_error(DatabaseError("Code: 131. DB::Exception: String is too long. (TOO_LARGE_STRING_SIZE)"))
    # the store away, a timeout, a detached table, memory: retried, never dead-lettered
    assert not is_data_error(ConnectionRefusedError(111, "Connection refused"))
    assert not is_data_error(TimeoutError())
    assert not is_data_error(OperationalError("Error HTTPConnectionPool: Max retries exceeded"))
    assert not is_data_error(DatabaseError("Code: 60. DB::Exception: Table areal.steps does not exist. (UNKNOWN_TABLE)"))
    assert not is_data_error(DatabaseError("Code: 241. DB::Exception: Memory limit exceeded (MEMORY_LIMIT_EXCEEDED)"))
    assert not is_data_error(RuntimeError("something unknown"))


# ------------------------------------------------------------------ on the broker

SURROGATE_STEP = (b'{"type":"step","schema":1,"event_id":"bad-1","run_id":"r1","node":"n0","rank":0,'
                  b'"ts":1700000000.0,"step":1,"epoch":0,"metrics":{"\\ud800":1.0}}')


@pytest.fixture
def settings(kafka_bootstrap: str, topics: Topics, tmp_path: Path) -> Settings:
    return Settings(kafka_bootstrap=kafka_bootstrap, topic_prefix=topics.prefix,
                    clickhouse_url=f"chdb://{tmp_path / 'clickhouse'}")


def rows(client, sql: str) -> list[tuple]:
    return list(client.query(sql).result_rows)


@pytest.mark.broker
@pytest.mark.timeout(180)
def test_a_lone_surrogate_metric_key_is_dead_lettered_and_the_next_step_is_stored(
        settings: Settings, kafka_bootstrap: str, topics: Topics) -> None:
    with sink_in_a_thread(settings, BatchPolicy(max_rows=500, max_wait_s=0.1)) as sink:
        producer = Producer(kafka_bootstrap, topics)
        producer.send_raw(topics.steps, SURROGATE_STEP)  # key r1: the same partition as the good one
        producer.send(StepEvent(run_id="r1", step=2, epoch=0, reward=0.5, event_id="good-2"))
        producer.close()
        wait_for(lambda: rows(sink.client, "SELECT event_id FROM areal.steps FINAL") == [("good-2",)], 60,
                 "the good step after the bad one")
        wait_for(lambda: len(rows(sink.client, "SELECT 1 FROM areal.deadletter FINAL")) == 1, 60, "the dead letter")
        (reason, raw, source), = rows(sink.client, "SELECT reason, raw, source_topic FROM areal.deadletter FINAL")
        assert reason.startswith("steps.metrics key: holds a lone surrogate U+D800")
        assert json.loads(raw)["event_id"] == "bad-1" and source == topics.steps
        wait_for(lambda: lag(kafka_bootstrap, topics, sink.group) == 0, 60, "every offset committed")


@pytest.mark.broker
@pytest.mark.timeout(180)
def test_a_row_the_store_refuses_is_dead_lettered_and_the_rest_of_its_batch_is_stored(
        settings: Settings, kafka_bootstrap: str, topics: Topics, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation let the row through (the decoder below puts the surrogate back after it);
    the real insert fails on every try; the sink bisects its batch down to that row."""
    import areal_metrics.sinks.decode as decode_module

    real_parse = decode_module.parse_event

    def parse_keeping_surrogates(raw: bytes, expected=None):
        if expected is not StepEvent or b"\\ud800" not in raw:
            return real_parse(raw, expected)
        event = real_parse(raw.replace(b"\\ud800", b"ok"), expected)
        msgspec.structs.force_setattr(event, "metrics", {"\ud800": 1.0})
        return event

    monkeypatch.setattr(decode_module, "parse_event", parse_keeping_surrogates)
    producer = Producer(kafka_bootstrap, topics)
    good = [StepEvent(run_id="r1", step=i, epoch=0, reward=0.1, event_id=f"good-{i}") for i in range(40)]
    for e in good[:25]:
        producer.send(e)
    producer.send_raw(topics.steps, SURROGATE_STEP)
    for e in good[25:]:
        producer.send(e)
    producer.close()  # all 41 before the sink starts: one batch holds the bad row among good ones
    with sink_in_a_thread(settings, BatchPolicy(max_rows=500, max_wait_s=0.5)) as sink:
        wait_for(lambda: lag(kafka_bootstrap, topics, sink.group) == 0, 90, "every offset committed")
        wait_for(lambda: len(rows(sink.client, "SELECT 1 FROM areal.deadletter FINAL")) == 1, 60, "the dead letter")
        stored = rows(sink.client, "SELECT event_id FROM areal.steps FINAL ORDER BY step")
        assert stored == [(e.event_id,) for e in good]
        (reason, raw), = rows(sink.client, "SELECT reason, raw FROM areal.deadletter FINAL")
        assert reason.startswith("steps: could not be stored (UnicodeEncodeError")
        assert json.loads(raw)["event_id"] == "bad-1"
        assert sink.stats["unstorable"] == 1

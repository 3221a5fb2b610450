"""The client never raises into training because of a value (CONTRACT.md, 'No input stops the pipeline').

`init(config=...)` and `run.log(...)` with values too deep, too big or that cannot be read:
never an exception from init/log or from the sender thread; one warning per kind; a truncated
value (or a dead letter) instead; the run's other events still arrive, and every record the
client sends is one every reader accepts. The client's readers (its control feed) and
`alerts --follow` take a 5,000-deep message and go on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from areal_metrics.producers.client import coerce
from areal_metrics.producers.client import run as run_module
from areal_metrics.producers.contract.events import AlertEvent, CommandEvent, RejectedEvent, RunEvent, StepEvent, parse_event
from areal_metrics.producers.contract.limits import default_limits
from areal_metrics.producers.contract.topics import Topics
from tests.support import cli, logger_warnings, wait_for


def deep(n: int, kind: str = "dict") -> Any:
    v: Any = 1
    for _ in range(n):
        v = {"a": v} if kind == "dict" else [v]
    return v


class Unprintable:
    """A value whose str(), repr() and float() raise."""

    def __str__(self) -> str:
        raise RuntimeError("no str")

    __repr__ = __str__

    def __float__(self) -> float:
        raise RuntimeError("no float")


class BrokenInt(int):
    """An int whose conversion raises (read on the sender thread)."""

    def __int__(self) -> int:
        raise RuntimeError("no int")


class BrokenMapping(dict):
    def items(self) -> Any:
        raise RuntimeError("no items")


def depth_of(v: Any) -> int:
    if isinstance(v, dict):
        return 1 + max(map(depth_of, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(depth_of, v), default=0)
    return 0


# ------------------------------------------------------------------ pure: the config


def test_a_config_too_deep_too_wide_too_long_or_unreadable_is_cut_with_its_kind_named() -> None:
    lim = default_limits()
    cases = {
        "deep": {"deep": deep(3000)},
        "deep_list": {"deep": deep(3000, "list")},
        "keys": {"wide": {f"k{i}": i for i in range(lim.max_keys + 5)}},
        "items": {"long": [0] * (lim.max_items + 5)},
        "unreadable": {"bad": BrokenMapping(a=1), Unprintable(): Unprintable()},
        "big": {"big": "x" * 300_000, "small": 1},
    }
    for label, config in cases.items():
        out, notes = coerce.config_with_notes(config)
        want = label.split("_")[0]
        if label == "unreadable":  # the mapping is unreadable; the unprintable key and value become notes
            assert notes == ("unreadable",) and out["bad"].startswith("<unreadable BrokenMapping")
            assert out["<unprintable Unprintable>"] == "<unprintable Unprintable>"
        else:
            assert notes == (want,), (label, notes)
        event = RunEvent(run_id="r", status="running", config=out)  # what readers accept
        assert parse_event(event.to_json(), expected=RunEvent).config == out
    assert depth_of(coerce.config(cases["deep"])) == coerce.CONFIG_DEPTH_MAX + 1  # the config, 30 levels in it
    assert len(coerce.config(cases["keys"])["wide"]) == lim.max_keys
    assert len(coerce.config(cases["items"])["long"]) == lim.max_items
    assert coerce.config(cases["big"]) == {"big": "<300002 bytes, not stored>", "small": 1}
    assert coerce.config_with_notes({"lr": 0.1, "layers": [1, 2]}) == ({"lr": 0.1, "layers": [1, 2]}, ())


# ------------------------------------------------------------------ pure: a step on the sender thread


class _Run:
    """What `_Step.encode` reads of a Run, with the warnings it gives."""

    run_id, node, rank, world_size, attempt, _epoch, _key = "r1", "h:0", 0, 1, 0, 0.0, b"r1"
    _sampler = None  # no system metrics
    _max_metrics = 1024

    def __init__(self) -> None:
        self.warned: dict[Any, str] = {}
        self.skipped: list[Any] = []

    def _note_skipped(self, names: tuple) -> None:
        self.skipped.extend(names)

    def _note_dropped(self, count: int) -> None:
        self.skipped.extend([None] * count)

    def _warn_once(self, key: Any, message: str) -> None:
        self.warned.setdefault(key, message)


def encode(run: _Run, values: dict, step: int = 1) -> tuple[str, bytes]:
    from areal_metrics.producers.client.run import _Step

    topic, key, raw = _Step(run, step, coerce.snapshot(values), 1.7e9).encode(Topics("t."))  # type: ignore[arg-type]
    assert key == b"r1"
    return topic, raw


def test_a_step_the_sender_cannot_encode_is_a_dead_letter_never_an_exception() -> None:
    run = _Run()
    topic, raw = encode(run, {"x": BrokenInt(3), Unprintable(): BrokenInt(4)})
    assert topic == "t.deadletter"
    letter = parse_event(raw, expected=RejectedEvent)
    assert letter.reason.startswith("client: step 1 could not be encoded: no int")  # type: ignore[attr-defined]
    assert list(run.warned) == [("encode", "RuntimeError")]
    encode(run, {"x": BrokenInt(3)}, step=2)
    assert len(run.warned) == 1  # once per kind


def test_values_too_big_too_many_too_deep_or_unreadable_give_a_valid_step_and_one_warning_each() -> None:
    run = _Run()
    values = {"reward": 1e200, "loss": 0.5, "deep": deep(3000), "odd": Unprintable(), Unprintable(): 1.0,
              "tensorish": [1.0] * 10, **{f"m{i}": float(i) for i in range(2000)}}
    for step in (1, 2):
        topic, raw = encode(run, values, step)
        assert topic == "t.steps"
        event = parse_event(raw, expected=StepEvent)
        assert isinstance(event, StepEvent)
        assert event.reward is None and "reward" in event.non_finite and event.loss == 0.5
        assert len(event.metrics) == 1024
    assert set(run.warned) == {"beyond"}  # the metrics cap's own warning is the run's (test_client_wandb.py)
    assert set(run.skipped) >= {"deep/a/a/a", "odd", "tensorish"}  # a dict is flattened 4 levels deep (coerce.NESTED_MAX)
    assert run.skipped.count(None) >= 2 * (2000 - 1024)  # the names past the cap, counted as skipped


# ------------------------------------------------------------------ through the broker


@pytest.mark.broker
@pytest.mark.timeout(300)
def test_init_and_log_with_hostile_values_never_raise_and_the_runs_events_arrive(
        stack_env: dict[str, str], topics: Topics, kafka_bootstrap: str) -> None:
    from kafka import KafkaProducer

    from areal_metrics.producers.client.run import init
    from tests.kafka_reading import read_to_end

    settings = dict(kafka_bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, git=False, rank=0, world_size=1,
                    journal_dir=str(Path(stack_env["AREAL_HOME"]) / "j"), node="me:0")
    config = {"deep": deep(3000), "wide": {f"k{i}": i for i in range(default_limits().max_keys + 1)},
              "bad": Unprintable(), "lr": 0.1}
    with logger_warnings(run_module._log) as logged:
        run = init(run_id="hostile-values", config=config, **settings)
        try:
            assert run.commands() == []
            wait_for(lambda: run._feed is not None and run._feed.ready.is_set(), 60, "the control consumer")
            for step in range(5):
                run.log({"reward": 0.1 * step, "loss": 1e300, "deep": deep(3000), "odd": Unprintable(),
                         "x": BrokenInt(1) if step == 2 else 1}, step=step)
            # the control feed: a 5,000-deep message, then a command for this run
            producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
            producer.send(topics.control, key=b"hostile-values", value=b"[" * 5000 + b"1" + b"]" * 5000)
            good = CommandEvent(run_id="hostile-values", command="evaluate_now", reason="after a deep one")
            producer.send(topics.control, key=b"hostile-values", value=good.to_json())
            producer.flush(30)
            producer.close()
            got: list[CommandEvent] = []
            wait_for(lambda: got.extend(run.commands()) or got, 60, "the command after the deep message")
            assert [c.event_id for c in got] == [good.event_id]
            assert run._feed is not None and run._feed._thread.is_alive()
        finally:
            run.finish()
    assert run.stats().sent == 1 + 5 + 1 and run.stats().failed == 0  # running, 5 steps (one a dead letter), finished

    records = read_to_end(kafka_bootstrap, topics.runs, topics.steps, topics.deadletter)
    by_topic: dict[str, list[Any]] = {}
    for r in records:  # every record the client sent is one every reader accepts
        by_topic.setdefault(r.topic, []).append(parse_event(r.value, expected=topics.event_type(r.topic)))
    runs = by_topic[topics.runs]
    assert [e.status for e in runs] == ["running", "finished"]
    assert runs[0].config["lr"] == 0.1 and depth_of(runs[0].config["deep"]) == coerce.CONFIG_DEPTH_MAX
    assert len(runs[0].config["wide"]) == default_limits().max_keys
    steps = by_topic[topics.steps]
    assert sorted(e.step for e in steps) == [0, 1, 3, 4]
    assert all(e.loss is None and "loss" in e.non_finite for e in steps)
    [letter] = by_topic[topics.deadletter]
    assert "step 2 could not be encoded" in letter.reason
    warnings = [r.getMessage() for r in logged]
    for words in ("config: nested deeper", "config: an object with more names", "beyond +-1e+100",
                  "step 2 could not be encoded"):
        assert sum(words in w for w in warnings) == 1, (words, warnings)


@pytest.mark.broker
@pytest.mark.timeout(300)
def test_alerts_follow_skips_a_5000_deep_message_and_prints_the_next(stack_env: dict[str, str], topics: Topics,
                                                                   kafka_bootstrap: str) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    alert = AlertEvent(run_id="deep-alerts", kind="stalled", message="after a deep one")
    producer.send(topics.alerts, key=b"deep-alerts", value=b'{"type":"alert","x":' + b'{"a":' * 5000 + b"1" + b"}" * 5001)
    producer.send(topics.alerts, key=b"deep-alerts", value=alert.to_json())
    producer.flush(30)
    producer.close()
    result = cli("alerts", "--follow", "--timeout", "15", env=stack_env)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert [json.loads(line)["alert_id"] for line in result.stdout.splitlines()] == [alert.alert_id]
    assert "alerts.x: nested too deeply (more than 64 levels)" in result.stderr

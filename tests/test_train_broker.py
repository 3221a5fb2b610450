"""Training runs on the real broker: steps, evals, commands end to end, and a resumed run stored once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict

import pytest
from kafka import KafkaConsumer, KafkaProducer

from areal_metrics.areal_train.config import TrainConfig
from areal_metrics.areal_train.launch import start
from areal_metrics.producers.contract.events import (
    CommandEvent,
    EvalEvent,
    RunEvent,
    StepEvent,
    parse_event,
)

pytestmark = pytest.mark.broker

TINY = dict(d_model=32, layers=2, heads=2, warmstart_steps=0, batch_prompts=4, eval_size=16, quick_size=4,
            eval_samples=2, max_response_len=8, checkpoint_every_steps=None)


class Collector:
    """Everything the run published, read back with a plain kafka-python consumer."""

    def __init__(self, bootstrap: str, topic_names: list[str]) -> None:
        self.consumer = KafkaConsumer(*topic_names, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                      group_id=None, enable_auto_commit=False)
        self.events: list = []

    def poll(self) -> None:
        for records in self.consumer.poll(timeout_ms=200).values():
            self.events += [parse_event(r.value) for r in records]

    def until(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.poll()

    def of(self, cls) -> list:
        return [e for e in self.events if isinstance(e, cls)]

    def steps_by_rank(self) -> dict[int, list[StepEvent]]:
        out: dict[int, list[StepEvent]] = defaultdict(list)
        for e in sorted(self.of(StepEvent), key=lambda e: (e.attempt, e.step)):
            out[e.rank].append(e)
        return out


def first_step_where(steps: list[StepEvent], condition) -> int:
    return next(e.step for e in steps if condition(e))


def test_two_ranks_publish_steps_and_evals_and_obey_commands(kafka_bootstrap, topics, stack_env, tmp_path) -> None:
    run_id = "broker-run"
    cfg = TrainConfig(**TINY, seed=3, eval_every_steps=None, eval_at_start=True, checkpoint_dir=str(tmp_path / "c"))
    collector = Collector(kafka_bootstrap, [topics.steps, topics.evals, topics.runs])
    run = start(run_id, nproc=2, steps=100_000, config=cfg, env=stack_env, log_dir=tmp_path / "logs",
                summary_dir=tmp_path / "summary")
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")

    def command(name: str, **args) -> None:
        event = CommandEvent(run_id=run_id, node="test", command=name, args=args, reason="test")
        producer.send(topics.control, key=run_id.encode(), value=event.to_json()).get(timeout=30)

    try:
        collector.until(lambda: {e.rank for e in collector.of(StepEvent) if e.step >= 10} == {0, 1}, 120,
                        "step 10 from both ranks")
        producer.send(topics.control, key=run_id.encode(),
                      value=b'{"type":"command","command":"explode","run_id":"broker-run","event_id":"bad-1","ts":1.0}'
                      ).get(timeout=30)  # an invalid command: the client's feed skips it, training goes on
        newest = max(e.step for e in collector.of(StepEvent))
        command("set_eval_interval", steps=7)
        # the closed loop's form: from a step boundary on, far enough ahead that the command
        # (sent after the collector saw `newest`, which lags the ranks) arrives before it
        boundary = newest + 100
        command("scale_lr", factor=0.5, from_step=boundary)
        command("evaluate_now")
        collector.until(lambda: all(s and s[-1].metrics["lr_scale"] == 0.5 for s in
                                    (collector.steps_by_rank()[0], collector.steps_by_rank()[1])), 120,
                        "the lr change on both ranks")
        collector.until(lambda: len({e.step for e in collector.of(EvalEvent)}) >= 3, 120, "an interval eval")
        command("stop")
        assert run.wait(timeout=120) == 0
    finally:
        run.terminate()
        producer.close()
    collector.until(lambda: len([e for e in collector.of(RunEvent) if e.status == "finished"]) == 2, 30, "the ends")
    collector.poll()

    by_rank = collector.steps_by_rank()
    assert set(by_rank) == {0, 1} and by_rank[0][0].node != by_rank[1][0].node
    for rank, steps in by_rank.items():
        assert [e.step for e in steps] == list(range(1, len(steps) + 1)), rank
        assert all(e.world_size == 2 and e.n_samples == 4 * cfg.group_size and e.attempt == 0 for e in steps)
    last_step = by_rank[0][-1].step
    assert by_rank[1][-1].step == last_step
    summaries = [json.loads((tmp_path / "summary" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(s["stopped_by_command"] and s["steps"] == last_step for s in summaries)

    # every command took effect at the same step on both ranks; scale_lr exactly after its boundary
    history = {r: [(e.step, e.lr, e.metrics["commands_applied"], e.metrics["eval_interval"]) for e in by_rank[r]]
               for r in (0, 1)}
    assert history[0] == history[1]
    lr_step = first_step_where(by_rank[0], lambda e: e.metrics["lr_scale"] == 0.5)
    assert lr_step == boundary + 1 and by_rank[0][lr_step - 1].lr == pytest.approx(by_rank[0][0].lr / 2)
    interval_at = first_step_where(by_rank[0], lambda e: e.metrics["eval_interval"] == 7) - 1
    evaluate_now_at = first_step_where(by_rank[0], lambda e: e.metrics["commands_applied"] == 2) - 1

    evals = collector.of(EvalEvent)
    eval_steps = sorted({e.step for e in evals})
    assert eval_steps[0] == 0 and evaluate_now_at in eval_steps
    assert set(range(interval_at, last_step, 7)) <= set(eval_steps)
    rounds: dict[tuple[str, str], list[EvalEvent]] = defaultdict(list)
    for e in evals:
        rounds[(e.eval_id, e.stage)].append(e)
    for key, results in rounds.items():
        assert sorted(e.rank for e in results) == [0, 1], key
        a, b = results
        assert a.status == b.status and a.replicas == b.replicas == 2 and a.dataset_fingerprint == b.dataset_fingerprint
        if a.status == "ok":  # two ranks, redundancy 2: both evaluate every sample, the same way
            assert a.verdicts == b.verdicts and a.n_samples == (8 if a.stage == "quick" else 32), key
            assert {"pass@2", "maj@2"} <= set(a.metrics)
        else:
            assert a.status == "skipped" and a.stage == "full" and "quick stage" in a.error
    run_events = collector.of(RunEvent)
    assert {(e.rank, e.status) for e in run_events} == {(0, "running"), (1, "running"), (0, "finished"), (1, "finished")}
    assert "eval_interval_steps" not in run_events[0].config  # no step trigger: nothing to publish


def test_async_evaluation_and_a_failing_round_do_not_stop_training(kafka_bootstrap, topics, stack_env, tmp_path) -> None:
    run_id = "async-run"
    cfg = TrainConfig(**TINY, seed=4, eval_mode="async", two_stage=False, eval_every_steps=5, fail_eval_at_steps=(5,),
                      eval_cpu_share=0.5, checkpoint_dir=str(tmp_path / "c"))
    collector = Collector(kafka_bootstrap, [topics.steps, topics.evals])
    assert start(run_id, nproc=2, steps=15, config=cfg, env=stack_env, log_dir=tmp_path).wait(timeout=300) == 0
    collector.until(lambda: len(collector.of(StepEvent)) >= 30, 60, "all step events")
    collector.until(lambda: {e.step for e in collector.of(EvalEvent)} >= {0, 15}, 60, "the first and last rounds")
    collector.poll()
    evals = collector.of(EvalEvent)
    by_step = defaultdict(set)
    for e in evals:
        by_step[e.step].add(e.status)
    assert by_step[0] == {"ok"} and by_step[15] == {"ok"}  # the first and the last round wait for the evaluator
    assert by_step[5] <= {"failed", "skipped"} and by_step[10] <= {"ok", "skipped"}
    failed = [e for e in evals if e.status == "failed"]
    assert all("injected evaluation failure at step 5" in e.error for e in failed)
    skipped = [e for e in evals if e.status == "skipped"]
    assert all("evaluator is busy" in e.error for e in skipped)
    assert max(e.step for e in collector.of(StepEvent)) == 15  # training went on


@pytest.mark.timeout(900)
def test_train_then_resume_stores_every_step_once(kafka_bootstrap, topics, stack_env, tmp_path) -> None:
    """`train --steps 30` then `train --steps 60 --resume` (2 ranks): 120 step rows, none twice."""
    from areal_metrics.producers.contract.settings import Settings
    from areal_metrics.sinks.query import connect

    config = tmp_path / "train.json"
    config.write_text(json.dumps({**TINY, "checkpoint_every_steps": 10, "eval_every_steps": 10}))
    env = dict(stack_env, AREAL_HOME=str(tmp_path / "home"))
    sink = subprocess.Popen([sys.executable, "-m", "areal_metrics.sinks"], env=env, stdout=open(tmp_path / "sink.log", "wb"),
                            stderr=subprocess.STDOUT)
    base = [sys.executable, "-m", "areal_metrics", "train", "--run-id", "resumed", "--nproc", "2", "--config",
            str(config), "--log-dir", str(tmp_path / "logs")]
    try:
        first = subprocess.run([*base, "--steps", "30"], env=env, capture_output=True, text=True, timeout=600)
        assert first.returncode == 0, first.stderr[-2000:]
        second = subprocess.run([*base, "--steps", "60", "--resume"], env=env, capture_output=True, text=True,
                                timeout=600)
        assert second.returncode == 0, second.stderr[-2000:]
        assert "(attempt 1, resumed at step 30)" in second.stdout
        collector = Collector(kafka_bootstrap, [topics.steps])
        collector.until(lambda: len(collector.of(StepEvent)) >= 120, 60, "every step event")
        collector.poll()
        steps = collector.of(StepEvent)
        keys = [(e.rank, e.step, e.attempt) for e in steps]
        assert len(keys) == len(set(keys)) == 120  # in the Kafka log: each (rank, step) once
        assert {(r, s) for r, s, _ in keys} == {(r, s) for r in (0, 1) for s in range(1, 61)}
        assert {a for _, s, a in keys if s <= 30} == {0} and {a for _, s, a in keys if s > 30} == {1}

        settings = Settings(clickhouse_url=env["AREAL_CLICKHOUSE_URL"])
        deadline = time.monotonic() + 120
        stored = 0
        while stored < 120 and time.monotonic() < deadline:
            time.sleep(1)
            with connect(settings) as store:
                stored = int(store.command("SELECT count() FROM v_steps WHERE run_id = 'resumed'"))
        with connect(settings) as store:
            rows = store.query("SELECT rank, step, count() FROM v_steps WHERE run_id = 'resumed' GROUP BY rank, step "
                               "HAVING count() > 1").rows
            attempts = store.query("SELECT attempt, count() FROM v_steps WHERE run_id = 'resumed' GROUP BY attempt "
                                   "ORDER BY attempt").rows
        assert stored == 120 and rows == []  # 120 step rows in ClickHouse, none twice
        assert [tuple(r) for r in attempts] == [(0, 60), (1, 60)]
    finally:
        sink.terminate()
        sink.wait(30)

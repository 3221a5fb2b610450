"""A 2-rank training run on the real broker: steps, evals and commands end to end."""

from __future__ import annotations

import json
import time
from collections import defaultdict

import pytest
from kafka import KafkaConsumer, KafkaProducer

from areal_train.config import TrainConfig
from areal_train.launch import start
from producers.events import CommandEvent, EvalEvent, RejectedEvent, StepEvent, parse_event

pytestmark = pytest.mark.broker


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
        for e in sorted(self.of(StepEvent), key=lambda e: e.step):
            out[e.rank].append(e)
        return out


def first_step_where(steps: list[StepEvent], condition) -> int:
    return next(e.step for e in steps if condition(e))


def test_two_ranks_publish_steps_and_evals_and_obey_commands(kafka_bootstrap, topics, stack_env, tmp_path) -> None:
    run_id = "broker-run"
    cfg = TrainConfig(seed=3, eval_every_steps=None, eval_at_start=True, two_stage=True, quick_size=8, eval_size=32)
    collector = Collector(kafka_bootstrap, [topics.steps, topics.evals, topics.deadletter])
    run = start(run_id, nproc=2, steps=100_000, config=cfg, env=stack_env, log_dir=tmp_path / "logs",
                summary_dir=tmp_path / "summary")
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")

    def command(name: str, **args) -> None:
        event = CommandEvent(run_id=run_id, node="test", command=name, args=args, reason="test")
        producer.send(topics.control, key=run_id.encode(), value=event.to_json()).get(timeout=30)

    try:
        collector.until(lambda: {e.rank for e in collector.of(StepEvent) if e.step >= 10} == {0, 1}, 90,
                        "step 10 from both ranks")
        producer.send(topics.control, key=run_id.encode(),
                      value=b'{"type":"command","command":"explode","run_id":"broker-run","event_id":"bad-1","ts":1.0}').get(timeout=30)
        command("set_eval_interval", steps=7)
        command("scale_lr", factor=0.5)
        command("evaluate_now")
        collector.until(lambda: all(s and s[-1].metrics["lr_scale"] == 0.5 for s in
                                    (collector.steps_by_rank()[0], collector.steps_by_rank()[1])), 60,
                        "the lr change on both ranks")
        collector.until(lambda: len({e.step for e in collector.of(EvalEvent)}) >= 3, 60, "an interval eval")
        command("stop")
        assert run.wait(timeout=90) == 0
    finally:
        run.terminate()
        producer.close()
    collector.until(lambda: len(collector.of(RejectedEvent)) >= 1, 20, "the dead-lettered command")
    collector.poll()

    # step events from both ranks, every step once, both stopping at the same step
    by_rank = collector.steps_by_rank()
    assert set(by_rank) == {0, 1}
    assert by_rank[0][0].node != by_rank[1][0].node
    for rank, steps in by_rank.items():
        assert [e.step for e in steps] == list(range(1, len(steps) + 1)), rank
    last_step = by_rank[0][-1].step
    assert by_rank[1][-1].step == last_step
    summaries = [json.loads((tmp_path / "summary" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(s["stopped_by_command"] and s["steps"] == last_step for s in summaries)

    # the commands took effect at the same step on both ranks (they show in the next step's event)
    history = {r: [(e.step, e.lr, e.metrics["commands_applied"], e.metrics["eval_interval"]) for e in by_rank[r]]
               for r in (0, 1)}
    assert history[0] == history[1]
    lr_step = first_step_where(by_rank[0], lambda e: e.metrics["lr_scale"] == 0.5)
    assert by_rank[0][lr_step - 1].lr == pytest.approx(by_rank[0][0].lr / 2)
    interval_at = first_step_where(by_rank[0], lambda e: e.metrics["eval_interval"] == 7) - 1
    evaluate_now_at = first_step_where(by_rank[0], lambda e: e.metrics["commands_applied"] == 3) - 1

    # evaluations: before training, at the evaluate_now step, then every 7 steps; from both nodes
    evals = collector.of(EvalEvent)
    eval_steps = sorted({e.step for e in evals})
    assert eval_steps[0] == 0 and evaluate_now_at in eval_steps
    assert set(range(interval_at, last_step, 7)) <= set(eval_steps)
    assert set(eval_steps) <= {0, evaluate_now_at, last_step} | set(range(interval_at, last_step + 1, 7))
    rounds: dict[str, list[EvalEvent]] = defaultdict(list)
    for e in evals:
        rounds[e.eval_id].append(e)
    assert len(rounds) == len(eval_steps) * 4  # 2 datasets x (quick, full)
    for eval_id, results in rounds.items():
        assert sorted(e.rank for e in results) == [0, 1], eval_id
        a, b = results
        assert a.status == b.status == "ok" and a.replicas == b.replicas == 2
        assert a.n_samples == b.n_samples == (8 if a.stage == "quick" else 32)
        assert a.verdicts == b.verdicts, eval_id  # the same samples in the same order, and the same weights
    pre = [e for e in evals if e.step == 0 and e.dataset == "add_1digit" and e.stage == "full"]
    assert len(pre) == 2

    # the malformed command went to the dead-letter topic, naming the field
    rejected = collector.of(RejectedEvent)
    assert len(rejected) == 1 and rejected[0].reason.startswith("commands.command")
    assert rejected[0].run_id == run_id


def test_async_evaluation_and_a_failing_round_do_not_stop_training(kafka_bootstrap, topics, stack_env, tmp_path) -> None:
    run_id = "async-run"
    cfg = TrainConfig(seed=4, eval_mode="async", two_stage=False, eval_every_steps=5, fail_eval_at_steps=(5,),
                      eval_size=16)
    collector = Collector(kafka_bootstrap, [topics.steps, topics.evals])
    assert start(run_id, nproc=2, steps=15, config=cfg, env=stack_env, log_dir=tmp_path).wait(timeout=120) == 0
    collector.until(lambda: len(collector.of(EvalEvent)) >= 4 * 2 * 2, 30, "all eval results")
    collector.until(lambda: len(collector.of(StepEvent)) >= 30, 30, "all step events")

    evals = collector.of(EvalEvent)
    assert sorted({e.step for e in evals}) == [0, 5, 10, 15]
    failed = [e for e in evals if e.status == "failed"]
    assert {(e.step, e.rank) for e in failed} == {(5, 0), (5, 1)}
    assert all("injected evaluation failure at step 5" in e.error for e in failed)
    assert all(e.status == "ok" for e in evals if e.step != 5)
    assert max(e.step for e in collector.of(StepEvent)) == 15  # training went on after the failed round

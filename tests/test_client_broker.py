"""The client against the real broker, with the real stream worker and sink as processes.

- Two ranks on one host (RANK=0/1, WORLD_SIZE=2, default settings) log numpy,
  torch, NaN, None and fractional epochs for 20 steps and one evaluation; rank 0
  calls finish(), rank 1 just exits: 40 step rows from 2 ranks, the NaN null and
  named, one consensus with 2 votes, a finished run with its config in v_runs.
- A run SIGKILLed after logging (one rank reaching the broker, one only its
  journal) and restarted with resume=True: every event that had reached the
  broker or the journal is stored once; the new attempt's steps are attempt 1.
- commands(): a command for the run (and one for another node) on the control topic.
- A Publisher never closed: its 100 events are delivered at exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kafka import KafkaProducer

from areal_metrics.stack.kafka_broker import free_port
from areal_metrics.producers.contract.events import CommandEvent, parse_event
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.contract.topics import Topics
from tests.kafka_reading import read_to_end
from tests.support import ROOT, child_env, start_service, stop_process, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.timeout(400)]


def start(code: str, env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True, cwd=ROOT)


@pytest.fixture
def sink(stack_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[[str], list[tuple]]]:
    """The real sink as a process; yields `query(sql) -> rows` through its endpoint."""
    from areal_metrics.sinks.query import Target, connect, read_owner

    proc = start_service("areal_metrics.sinks", stack_env, tmp_path / "sink.log")
    settings = Settings(kafka_bootstrap=stack_env["AREAL_KAFKA_BOOTSTRAP"], topic_prefix=stack_env["AREAL_TOPIC_PREFIX"],
                        clickhouse_url=stack_env["AREAL_CLICKHOUSE_URL"])
    store_path = Target.parse(settings.clickhouse_url).path
    wait_for(lambda: read_owner(store_path) is not None or proc.poll() is not None, 90, "the sink to start")
    assert proc.poll() is None, (tmp_path / "sink.log").read_text()[-3000:]

    def query(sql: str) -> list[tuple]:
        with connect(settings, wait_s=30) as store:
            return store.query(sql).rows

    try:
        yield query
    finally:
        stop_process(proc)


RANK_SCRIPT = """
    import sys
    import numpy as np
    import torch
    import areal_metrics as am

    run = am.init(run_id="two-ranks", config={"lr": 1e-3, "group_size": np.int64(4), "model": {"layers": 2}},
                  tags=["grpo", "test"], group="client-e2e")
    for step in range(20):
        run.log({"reward": np.float32(0.5 + step / 100), "kl": torch.tensor(0.01), "entropy": float("nan") if step == 7 else 1.2,
                 "grad_norm": None, "epoch": step / 8, "critic/score/mean": np.float64(0.4), "my/extra": torch.tensor([2.0])},
                step=step)
    run.log_eval("math500", 19, verdicts=np.array([1, 0, 1, 1]), samples=[{"prompt": "1+1=", "response": "2", "verdict": 1}])
    if run.rank == 0:
        run.finish()
    print("logged", run.node, flush=True)
"""


def test_two_ranks_on_one_host_reach_clickhouse(stack_env: dict[str, str], topics: Topics, tmp_path: Path, sink) -> None:
    worker = start_service("areal_metrics.streams", stack_env, tmp_path / "worker.log")
    try:
        ranks = [start(RANK_SCRIPT, child_env(stack_env, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r)),
                       tmp_path / f"rank{r}.log") for r in range(2)]
        outs = [p.communicate(timeout=120)[0] for p in ranks]
        assert [p.returncode for p in ranks] == [0, 0], [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
        assert len({o.split()[1] for o in outs}) == 2  # one node name per rank
        steps = wait_for(lambda: sink("SELECT count() FROM v_steps WHERE run_id = 'two-ranks'")[0][0] == 40, 120,
                         "40 step rows")
        assert steps
        rows = sink("SELECT rank, step, epoch, reward, kl, entropy, grad_norm, non_finite, metrics FROM v_steps "
                    "WHERE run_id = 'two-ranks' ORDER BY rank, step")
        assert {r[0] for r in rows} == {0, 1} and len(rows) == 40
        by = {(r[0], r[1]): r for r in rows}
        rank, step, epoch, reward, kl, entropy, grad_norm, non_finite, metrics = by[(1, 7)]
        assert entropy is None and non_finite == ["entropy"] and grad_norm is None
        assert epoch == 7 / 8 and reward == pytest.approx(0.57) and kl == pytest.approx(0.01)
        assert metrics == {"critic/score/mean": 0.4, "my/extra": 2.0}
        assert by[(0, 6)][5] == 1.2 and by[(0, 6)][7] == []
        consensus = wait_for(lambda: sink("SELECT votes, replicas, accuracy FROM v_eval_consensus "
                                          "WHERE run_id = 'two-ranks'"), 120, "the consensus")
        assert consensus == [(2, 2, 0.75)]
        assert sink("SELECT count() FROM v_generations WHERE run_id = 'two-ranks'") == [(2,)]
        runs = wait_for(lambda: sink("SELECT status, config, tags, `group`, ranks, world_size FROM v_runs "
                                     "WHERE run_id = 'two-ranks' AND status != 'running'"), 60, "the run to finish")
        status, config, tags, group, n_ranks, world = runs[0]
        assert (status, tags, group, n_ranks, world) == ("finished", ["grpo", "test"], "client-e2e", 2, 2)
        assert json.loads(config) == {"lr": 1e-3, "group_size": 4, "model": {"layers": 2}}
    finally:
        stop_process(worker)


KILLED_SCRIPT = """
    import sys, time
    import areal_metrics as am

    rank = int(sys.argv[1])
    run = am.init(run_id="killed-run", resume=bool(int(sys.argv[2])))
    first = 0 if run.attempt == 0 else 35  # the resumed attempt restarts from a checkpoint at step 35
    for step in range(first, first + 30):
        run.log({"reward": step / 100, "loss": 1.0 - step / 100}, step=step)
    if run.attempt == 0:
        want = 31  # the running event and 30 steps: sent (rank 0) or journaled (rank 1, no broker)
        while run.stats().sent + run.stats().journaled < want:
            time.sleep(0.05)
        for step in range(30, 40):  # logged right before the kill: these may or may not get out
            run.log({"reward": 0.0}, step=step)
        print("ready", run.attempt, flush=True)
        time.sleep(600)
    print("done", run.attempt, flush=True)
"""


def journal_ids(home: Path) -> dict[str, int]:
    """event_id -> step of the steps still in the journals (not yet acknowledged)."""
    out = {}
    for path in (home / "journal" / "killed-run").glob("rank-*/journal.log"):
        cursor = int((path.parent / "journal.cursor").read_text() or 0) if (path.parent / "journal.cursor").exists() else 0
        for line in path.read_bytes()[cursor:].splitlines():
            value = json.loads(line.split(b"\t", 2)[2])
            if value["type"] == "step":
                out[value["event_id"]] = value["step"]
    return out


def topic_ids(bootstrap: str, topic: str) -> dict[str, int]:
    """event_id -> step of the steps on the topic."""
    events = [parse_event(m.value) for m in read_to_end(bootstrap, topic)]
    return {e.event_id: e.step for e in events if e.run_id == "killed-run"}


def test_a_killed_run_resumed_stores_every_event_that_got_out_once(stack_env: dict[str, str], topics: Topics,
                                                                   tmp_path: Path, sink) -> None:
    home = Path(stack_env["AREAL_HOME"])
    dead = f"127.0.0.1:{free_port()}"
    envs = [child_env(stack_env, RANK="0", WORLD_SIZE="2"),
            child_env(stack_env, RANK="1", WORLD_SIZE="2", AREAL_KAFKA_BOOTSTRAP=dead)]  # rank 1: broker unreachable
    first = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_SCRIPT), str(r), "0"], env=envs[r],
                              stdout=subprocess.PIPE, stderr=(tmp_path / f"a0-r{r}.log").open("w"), text=True, cwd=ROOT)
             for r in range(2)]
    try:
        for p in first:
            assert p.stdout.readline().split() == ["ready", "0"]
    finally:
        for p in first:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    in_journal, on_topic = journal_ids(home), topic_ids(stack_env["AREAL_KAFKA_BOOTSTRAP"], topics.steps)
    assert len(in_journal) >= 30 and len(on_topic) >= 30  # rank 1's only in its journal, rank 0's on the broker
    reached = in_journal | on_topic
    before_checkpoint = {i for i, step in reached.items() if step < 35}

    resumed = [subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_SCRIPT), str(r), "1"], cwd=ROOT,
                              env=child_env(stack_env, RANK=str(r), WORLD_SIZE="2"), capture_output=True, text=True,
                              timeout=120) for r in range(2)]
    assert [r.stdout.split() for r in resumed] == [["done", "1"], ["done", "1"]], [r.stderr for r in resumed]

    wait_for(lambda: sink("SELECT count() FROM v_steps WHERE run_id = 'killed-run' AND attempt = 1")[0][0] == 60, 120,
             "the resumed attempt's steps")
    # what got out before the kill is stored, once; from the checkpoint on the new attempt replaced it
    wait_for(lambda: before_checkpoint <= {r[0] for r in sink("SELECT event_id FROM v_steps WHERE run_id = 'killed-run'")},
             60, "every event that got out before the kill")
    rows = sink("SELECT event_id, rank, step, attempt FROM v_steps WHERE run_id = 'killed-run'")
    assert len(rows) == len({r[0] for r in rows}) == len({(r[1], r[2]) for r in rows}) == len(before_checkpoint) + 60
    assert all(attempt == (1 if step >= 35 else 0) for _, _, step, attempt in rows)
    # the run's `finished` record may be stored in a later flush than its last steps
    wait_for(lambda: sink("SELECT status, attempt, attempts FROM v_runs WHERE run_id = 'killed-run'")
             == [("finished", 1, 2)], 60, "the resumed run finished, attempt 1 of 2")


def test_commands_arrive_for_this_run_and_node(stack_env: dict[str, str], topics: Topics, kafka_bootstrap: str) -> None:
    from areal_metrics.producers.client.run import init

    settings = dict(kafka_bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, journal_dir=str(Path(stack_env["AREAL_HOME"]) / "j"),
                    git=False, node="me:0", rank=0, world_size=1)
    run = init(run_id="cmd-run", **settings)
    try:
        assert run.commands() == []  # starts the background consumer, returns at once
        wait_for(lambda: run._feed is not None and run._feed.ready.is_set(), 60, "the control consumer")
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        for cmd in (CommandEvent(run_id="cmd-run", command="evaluate_now", reason="test"),
                    CommandEvent(run_id="cmd-run", command="stop", target_node="other:0"),
                    CommandEvent(run_id="other-run", command="stop"),
                    CommandEvent(run_id="cmd-run", command="scale_lr", args={"factor": 0.5}, target_node="me:0")):
            producer.send(topics.control, key=cmd.run_id.encode(), value=cmd.to_json())
        producer.send(topics.control, key=b"cmd-run", value=b"not json")
        producer.flush(30)
        producer.close()
        got: list[CommandEvent] = []
        wait_for(lambda: got.extend(run.commands()) or len(got) >= 2, 60, "two commands")
        assert [c.command for c in got] == ["evaluate_now", "scale_lr"]
        # the lead rank of a distributed loop reads every node's (CommandApplier): another node's too
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        for cmd in (CommandEvent(run_id="cmd-run", command="stop", target_node="other:1"),
                    CommandEvent(run_id="other-run", command="stop"),
                    CommandEvent(run_id="cmd-run", command="evaluate_now")):
            producer.send(topics.control, key=cmd.run_id.encode(), value=cmd.to_json())
        producer.flush(30)
        producer.close()
        every: list[CommandEvent] = []
        wait_for(lambda: every.extend(run.commands(every_node=True)) or len(every) >= 2, 60, "two more commands")
        assert [(c.command, c.target_node) for c in every] == [("stop", "other:1"), ("evaluate_now", None)]
    finally:
        run.finish()


def test_a_resumed_attempt_applies_the_commands_that_came_after_its_checkpoint(
        stack_env: dict[str, str], topics: Topics, kafka_bootstrap: str) -> None:
    """Attempt 0 saves a checkpoint (one command waiting), then gets another command and a `stop`, and dies.
    Attempt 1, resumed from that checkpoint in a new process's run, reads the control topic again from the
    first attempt's start (the applier's `commands_since`): it applies the waiting command and the one that
    came after the checkpoint (whose lr went with the crash), and not the stop sent to the attempt before it.
    Before, its feed read from its own start: the later command was lost and the worker never told."""
    import torch

    from areal_metrics.producers.client.run import init
    from areal_metrics.producers.client.trainer_control import CommandApplier

    settings = dict(kafka_bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, git=False, node="me:0", rank=0,
                    world_size=1, journal_dir=str(Path(stack_env["AREAL_HOME"]) / "j"))

    def send(*commands: CommandEvent) -> None:
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        for c in commands:
            producer.send(topics.control, key=b"resumed-cmds", value=c.to_json())
        producer.flush(30)
        producer.close()

    def applier(run: object) -> tuple[CommandApplier, torch.optim.Optimizer]:
        optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        return CommandApplier(run, optimizer), optimizer

    waiting = CommandEvent(run_id="resumed-cmds", command="scale_lr", args={"factor": 0.5, "from_step": 3})
    later = CommandEvent(run_id="resumed-cmds", command="scale_lr", args={"factor": 0.5, "from_step": 4})
    stop = CommandEvent(run_id="resumed-cmds", command="stop")
    run = init(run_id="resumed-cmds", **settings)
    control, _ = applier(run)
    control.at_step(1)
    wait_for(lambda: run._feed is not None and run._feed.ready.is_set(), 60, "the control consumer")
    send(waiting)
    wait_for(lambda: control.at_step(2) is not None and control.waiting, 60, "the first command, waiting")
    checkpoint = control.state_dict()  # saved after update 2: the lr is the schedule's, the command waits
    send(later, stop)
    wait_for(lambda: control.at_step(3).stop, 60, "attempt 0's stop")
    run.finish("failed")  # attempt 0 dies before its next checkpoint
    time.sleep(0.05)  # attempt 1 starts after every command was sent

    resumed = init(run_id="resumed-cmds", resume=True, **settings)
    try:
        assert resumed.attempt == 1 and resumed.started > stop.ts
        control, optimizer = applier(resumed)
        control.load_state_dict(checkpoint)
        assert control.at_step(3).lr_factor == 0.5  # the command the checkpoint had waiting
        wait_for(lambda: control.at_step(4).lr_factor == 0.25, 60, "the command that came after the checkpoint")
        assert optimizer.param_groups[0]["lr"] == 0.25 and not control.stopped
        assert control.state_dict()["commands_since"] == checkpoint["commands_since"] == run.started
    finally:
        resumed.finish()
    acks = [parse_event(m.value) for m in read_to_end(kafka_bootstrap, topics.acks)]
    assert sorted((a.attempt, a.command, a.status) for a in acks if a.run_id == "resumed-cmds") == [
        (0, "scale_lr", "applied"), (0, "stop", "applied"),
        (1, "scale_lr", "applied"), (1, "scale_lr", "applied"), (1, "stop", "ignored")]


def test_a_command_sent_while_the_feed_positions_itself_is_not_skipped(topics: Topics, kafka_bootstrap: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The command lands between the feed's lookup by time (nothing newer yet) and its seek.

    The feed once sought "to the end" there, past the command: a trainer starting up
    as its operator sent `stop` never stopped."""
    import kafka

    from areal_metrics.producers.client.control_feed import ControlFeed

    lookup = kafka.KafkaConsumer.offsets_for_times

    def lookup_then_command(self, timestamps):
        found = lookup(self, timestamps)
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        producer.send(topics.control, key=b"feed-run", value=CommandEvent(run_id="feed-run", command="stop").to_json())
        producer.flush(30)
        producer.close()
        return found

    monkeypatch.setattr(kafka.KafkaConsumer, "offsets_for_times", lookup_then_command)
    feed = ControlFeed({"bootstrap_servers": [kafka_bootstrap]}, topics.control, "feed-run", "me:0", since=time.time())
    try:
        assert feed.ready.wait(60)
        got: list[CommandEvent] = []
        wait_for(lambda: got.extend(feed.drain()) or got, 30, "the command sent during the lookup")
        assert [c.command for c in got] == ["stop"]
    finally:
        feed.close()


def test_the_control_feed_waits_for_a_control_topic_made_after_it_started(kafka_bootstrap: str) -> None:
    """A broker that does not create topics on demand, a trainer started before the stack made them:
    the feed waits for the topic instead of settling on no partitions (and never reading a command)."""
    import uuid

    from areal_metrics.stack.kafka_broker import create_topics
    from areal_metrics.producers.client.control_feed import ControlFeed

    topic = f"late-{uuid.uuid4().hex[:8]}.control"
    config = {"bootstrap_servers": [kafka_bootstrap], "allow_auto_create_topics": False}
    feed = ControlFeed(config, topic, "late-run", "me:0", since=time.time())
    try:
        time.sleep(2)  # the feed is looking for the topic meanwhile
        assert not feed.ready.is_set()
        create_topics(kafka_bootstrap, [topic])
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        producer.send(topic, key=b"late-run", value=CommandEvent(run_id="late-run", command="stop").to_json()).get(30)
        producer.close()
        got: list[CommandEvent] = []
        wait_for(lambda: got.extend(feed.drain()) or got, 60, "the command on the topic made late")
        assert [c.command for c in got] == ["stop"]
    finally:
        feed.close()


def test_a_publisher_never_closed_delivers_at_exit(kafka_bootstrap: str, topics: Topics, tmp_path: Path) -> None:
    code = f"""
        from areal_metrics.producers.contract.events import StepEvent
        from areal_metrics.producers.delivery.publisher import Publisher
        from areal_metrics.producers.contract.topics import Topics
        p = Publisher({kafka_bootstrap!r}, Topics({topics.prefix!r}))
        for i in range(100):
            p.publish(StepEvent(run_id="no-close", step=i, epoch=0))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), "AREAL_HOME": str(tmp_path / "h")})
    assert out.returncode == 0, out.stderr
    steps = sorted(parse_event(m.value).step for m in read_to_end(kafka_bootstrap, topics.steps))
    assert steps == list(range(100))


def test_a_resume_on_another_host_finds_its_attempt_on_the_runs_topic(kafka_bootstrap: str, topics: Topics,
                                                                       tmp_path: Path, monkeypatch) -> None:
    """No local record (another host's AREAL_HOME): the attempt comes from the run's events on the broker."""
    from areal_metrics.producers.client.run import init

    common = dict(kafka_bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, git=False, rank=0, world_size=1)
    monkeypatch.setenv("AREAL_HOME", str(tmp_path / "host-a"))
    first = init(run_id="xhost-run", **common)
    first.log({"reward": 0.1}, step=0)
    first.finish()
    assert first.stats().sent >= 3 and first.stats().journaled == 0
    monkeypatch.setenv("AREAL_HOME", str(tmp_path / "host-b"))
    resumed = init(run_id="xhost-run", resume=True, **common)
    try:
        assert resumed.attempt == 1
    finally:
        resumed.finish()

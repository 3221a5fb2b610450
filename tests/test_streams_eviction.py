"""The bound on the worker's live runs (areal_metrics.streams.shell.batch, StateStore.evict), no broker.

- a run that ended leaves the state (memory and table) after `ended_run_idle_s` without input,
  any other run after `run_idle_s`; never while a step waits for ranks, a vote round is open
  or a stall alert is due (those go out first);
- past `max_runs` live runs the one whose last input is oldest leaves, whatever it holds;
- a run that comes back after leaving starts over: the outputs and state a new run's events
  give in a fresh worker;
- a worker started over the table counts a run's idleness from its first tick.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.events import EvalEvent, RunEvent, StepEvent
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.streams.core.config import RunConfig, StreamsConfig
from areal_metrics.streams.shell.batch import Input, StreamCore
from areal_metrics.streams.state.state_store import _parse_key
from tests.support import replay_changelog

TOPICS = Topics("evict.")
CFG = RunConfig(window=3, vote_timeout_s=50.0, stall_seconds=300.0, step_wait_s=30.0)
IDLE, ENDED_IDLE = 1000.0, 100.0


class Clock:
    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def send(self, topic: str, key: bytes, value: bytes) -> Any:
        self.sent.append((topic, json.loads(value)))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def make_core(table: dict | None = None, max_runs: int = 100, cfg: RunConfig = CFG,
              clock: Clock | None = None) -> tuple[StreamCore, Recorder, Clock, dict]:
    rec, clock, table = Recorder(), clock or Clock(), {} if table is None else table
    core = StreamCore(topics=TOPICS, config=StreamsConfig(defaults=cfg), table=table, send=rec.send, clock=clock,
                      run_idle_s=IDLE, ended_run_idle_s=ENDED_IDLE, max_runs=max_runs)
    return core, rec, clock, table


def step(run: str, n: int, rank: int = 0, world: int = 1, attempt: int = 0, reward: float = 0.5) -> tuple[str, bytes]:
    return TOPICS.steps, StepEvent(run_id=run, node=f"n{rank}", rank=rank, step=n, epoch=0, reward=reward,
                                   world_size=world, attempt=attempt, throughput=1000.0 + n, ts=1.0 + n,
                                   event_id=f"{run}-{attempt}-{rank}-{n}").to_json()


def status(run: str, what: str, attempt: int = 0) -> tuple[str, bytes]:
    return TOPICS.runs, RunEvent(run_id=run, node="n0", rank=0, status=what, attempt=attempt, ts=1.0,
                                 event_id=f"{run}-{what}-{attempt}").to_json()


def result(run: str, node: str, replicas: int = 3) -> tuple[str, bytes]:
    return TOPICS.evals, EvalEvent(run_id=run, node=node, eval_id="e1", step=1, dataset="math|500", stage="full",
                                   accuracy=0.5, replicas=replicas, ts=2.0, event_id=f"{run}-e1-{node}").to_json()


def feed(core: StreamCore, *messages: tuple[str, bytes]) -> None:
    async def go() -> None:
        await core.on_batch([Input(topic, 0, i, None, value, 1.0) for i, (topic, value) in enumerate(messages)])
    asyncio.run(go())


def tick(core: StreamCore) -> None:
    asyncio.run(core.on_tick(0))


def runs_in(table: dict) -> set[str]:
    return {_parse_key(k)[0] for k in table}


def test_an_ended_run_leaves_after_its_idle_time_and_a_live_one_after_its_own() -> None:
    core, _, clock, table = make_core()
    feed(core, *(step("done", n) for n in range(3)), status("done", "finished"), *(step("live", n) for n in range(3)))
    assert runs_in(table) == {"done", "live"} and core.live_runs == 2
    clock.now += ENDED_IDLE - 1
    tick(core)
    assert runs_in(table) == {"done", "live"}
    clock.now += 1
    tick(core)
    assert runs_in(table) == {"live"} and set(core.cache) == {"live"} and core.stats["evicted"] == 1
    clock.now += IDLE - ENDED_IDLE  # `live` stalled at 300 s (its alert went out then); a day on it leaves
    tick(core)
    assert table == {} and core.cache == {} and core.live_runs == 0 and core.stats["evicted"] == 2


def test_a_run_does_not_leave_while_a_step_round_or_stall_alert_waits_on_the_clock() -> None:
    cfg = RunConfig(window=3, vote_timeout_s=5000.0, stall_seconds=3000.0, step_wait_s=2000.0)
    core, rec, clock, table = make_core(cfg=cfg)
    # `steps` ended (no stall watch) with a step waiting for its second rank; `votes` has had no
    # step (no stall watch either) and an open round
    feed(core, step("steps", 1, rank=0, world=2), status("steps", "finished"), result("votes", "a"),
         step("stalls", 1), step("stalls", 2))
    clock.now += IDLE  # idle long enough, but each waits: a rank, a round's other nodes, the stall watch
    tick(core)
    assert runs_in(table) == {"steps", "votes", "stalls"} and core.stats["evicted"] == 0
    clock.now += 1000  # 2,000 s: the step's wait is over; its point goes out, then the run leaves
    tick(core)
    assert [e["step"] for t, e in rec.sent if e["run_id"] == "steps" and t == TOPICS.smoothed] == [1]
    assert runs_in(table) == {"votes", "stalls"}
    clock.now += 1000  # 3,000 s: `stalled` is raised, then the run leaves
    tick(core)
    assert [e["kind"] for t, e in rec.sent if e["run_id"] == "stalls" and t == TOPICS.alerts] == ["stalled"]
    assert runs_in(table) == {"votes"}
    clock.now += 2000  # 5,000 s: the round times out (1 of 3 nodes: `eval_failed`), then the run leaves
    tick(core)
    assert [e["kind"] for t, e in rec.sent if e["run_id"] == "votes" and t == TOPICS.alerts] == ["eval_failed"]
    assert table == {} and core.live_runs == 0


def test_a_run_that_comes_back_after_leaving_starts_over_as_a_new_run() -> None:
    core, rec, clock, table = make_core()
    feed(core, *(step("r", n) for n in range(6)), status("r", "finished"))
    clock.now += ENDED_IDLE
    tick(core)
    assert table == {} and core.live_runs == 0
    back = [status("r", "running", attempt=1), *(step("r", n, attempt=1, reward=0.1 * n) for n in range(4, 9))]
    before = len(rec.sent)
    feed(core, *back)
    fresh, fresh_rec, fresh_clock, fresh_table = make_core()
    fresh_clock.now = clock.now
    feed(fresh, *back)
    assert rec.sent[before:] == fresh_rec.sent and fresh_rec.sent  # the same events, ids included
    assert core.cache["r"] == fresh.cache["r"] and table == fresh_table


def test_past_max_runs_the_run_with_the_oldest_input_leaves() -> None:
    core, _, clock, table = make_core(max_runs=3)
    for name in ("a", "b", "c"):
        feed(core, step(name, 1, rank=0, world=2))  # each with a step waiting: the cap takes it anyway
        clock.now += 1
    feed(core, step("a", 2))  # `a` had input last now
    feed(core, step("d", 1), step("e", 1))
    assert runs_in(table) == {"a", "d", "e"} == set(core.cache) and core.live_runs == 3
    assert core.stats["evicted_over_cap"] == 2


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6), min_size=1, max_size=12), st.integers(1, 5))
def test_the_live_runs_are_the_ones_with_the_newest_input_never_more_than_max_runs(batches, cap) -> None:
    core, _, clock, table = make_core(max_runs=cap)
    order: dict[str, None] = {}  # the model: runs by last input, oldest first
    for i, batch in enumerate(batches):
        clock.now += 1
        feed(core, *(step(f"r{r}", i) for r in batch))
        for r in dict.fromkeys(batch):  # a batch takes its runs in their first arrival
            order.pop(f"r{r}", None)
            order[f"r{r}"] = None
        while len(order) > cap:
            order.pop(next(iter(order)))
        assert runs_in(table) == set(order) == set(core.cache) and core.live_runs <= cap


def test_a_restarted_worker_counts_idleness_from_its_first_tick() -> None:
    core, _, clock, table = make_core()
    feed(core, step("r", 1), status("r", "finished"))
    clock.now += ENDED_IDLE - 10
    again, _, _, _ = make_core(table=table, clock=clock)  # a new process over the same table
    tick(again)
    clock.now += 20  # the run's input is ENDED_IDLE + 10 old, but this worker saw it 20 s ago
    tick(again)
    assert runs_in(table) == {"r"}
    clock.now += ENDED_IDLE
    tick(again)
    assert table == {} and again.stats["evicted"] == 1


def test_a_bound_the_worker_cannot_use_stops_it_with_one_line() -> None:
    import subprocess
    import sys

    for env, value in (("AREAL_WORKER_MAX_RUNS", "0"), ("AREAL_WORKER_RUN_IDLE_S", "soon"),
                       ("AREAL_WORKER_ENDED_RUN_IDLE_S", "-5")):
        done = subprocess.run([sys.executable, "-m", "areal_metrics.streams"], capture_output=True, text=True,
                              timeout=120, env={"PATH": "/usr/bin:/bin", env: value})
        assert done.returncode == 2 and done.stdout == "", (env, done.stderr)
        assert done.stderr.startswith(f"areal-streams: {env}='{value}'") and len(done.stderr.splitlines()) == 1


class FaustLikeTable:
    """What the store uses of Faust's table: `data`, and `send_changelog` (unused: records go direct)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}

    def send_changelog(self, partition: int, key: bytes, value: bytes | None, **kw: Any) -> None:
        raise AssertionError("the changelog records go through `changelog`")


def test_a_run_that_leaves_is_tombstoned_on_its_changelog_partition_head_first() -> None:
    table, sent, clock, rec = FaustLikeTable(), [], Clock(), Recorder()

    async def changelog(records: list[tuple[int, bytes, bytes | None]]) -> None:
        sent.extend(records)

    core = StreamCore(topics=TOPICS, config=StreamsConfig(defaults=CFG), table=table, send=rec.send, clock=clock,
                      changelog=changelog, run_idle_s=IDLE, ended_run_idle_s=ENDED_IDLE, max_runs=100)

    async def go() -> None:
        msgs = [step("r", 1, rank=0, world=2), step("r", 2, rank=0, world=2), step("r", 2, rank=1, world=2),
                result("r", "a", replicas=2), result("r", "b", replicas=2),  # a closed round: a record of its own
                status("r", "finished"), step("other", 1)]
        await core.on_batch([Input(topic, 3, i, None, value, 1.0) for i, (topic, value) in enumerate(msgs)])
        clock.now += CFG.step_wait_s  # step 1 goes out without its second rank
        await core.on_tick(3)
        written = len(sent)
        clock.now += ENDED_IDLE
        await core.on_tick(3)
        tombstones = sent[written:]
        assert tombstones and all(p == 3 and v is None for p, _, v in tombstones)
        assert _parse_key(tombstones[0][1]) == ("r", ("run",)) and len(tombstones) == 2  # the head first
        assert _parse_key(tombstones[1][1])[1][0] == "closed"
        assert {_parse_key(k)[0] for _, k, _ in tombstones} == {"r"}

    asyncio.run(go())
    replayed = replay_changelog(sent)  # what a worker recovering from the changelog reads
    assert replayed == table.data and runs_in(replayed) == {"other"}

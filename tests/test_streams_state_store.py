"""The worker's state as records (areal_metrics.streams.state.state_store) and batches (areal_metrics.streams.shell.batch), no broker.

- a state saved and loaded by a new store (a restart) is the same state;
- a batch of steps rewrites one record per run; closing a round with 2,048 closed rounds
  remembered writes a handful, not 2,048;
- a save cut short after any of its writes (a crash), then the batch read again, gives the
  same state and only copies of the events the batch gave;
- processing messages in batches gives the outputs and states one-by-one processing gives;
- a step of 1,024 ranks reporting one per batch writes each report to the changelog once
  (linear, not 1+2+...+1,024), and a worker restarted from its changelog mid-step, the last
  batches delivered again, ends with the state and events of the uninterrupted one;
- a message whose state record would be over the bound (the changelog's max.message.bytes) is
  dead-lettered saying the sizes, nothing of its state written, and the rest of its batch kept.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.events import EvalEvent, RunEvent, StepEvent
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.streams.state import codec
from areal_metrics.streams.shell.batch import Input, StreamCore
from areal_metrics.streams.core.config import RunConfig, StreamsConfig
from areal_metrics.streams.core.processor import RunState
from areal_metrics.streams.core.ranks import PendingStep, RankReport, RankState
from areal_metrics.streams.state.state_store import RECORD_OVERHEAD, StateRecordTooLarge, StateStore, record_key
from areal_metrics.streams.core.voting import CLOSED_ROUNDS_KEPT, NodeResult, RoundKey, add_result
from tests.support import replay_changelog

TOPICS = Topics("store.")
CFG = RunConfig(window=3, vote_timeout_s=5.0, stall_seconds=0, step_wait_s=3.0, lr_eval_threshold=0.5)


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, dict[str, Any]]] = []

    async def send(self, topic: str, key: bytes, value: bytes) -> Any:
        self.sent.append((topic, key, json.loads(value)))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


class LoggedTable(dict):
    """A dict that logs every put and delete, in order."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.log: list[tuple[str, bytes, bytes | None]] = []

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.log.append(("put", key, value))
        super().__setitem__(key, value)

    def pop(self, key: bytes, *default: Any) -> Any:
        if key in self:
            self.log.append(("delete", key, None))
        return super().pop(key, *default)


def step(run: str, n: int, rank: int = 0, world: int | None = None, reward: float = 0.5) -> bytes:
    return StepEvent(run_id=run, node=f"n{rank}", rank=rank, step=n, epoch=0, reward=reward, world_size=world,
                     throughput=1000.0 + n, ts=1.0 + n, event_id=f"{run}-{rank}-{n}").to_json()


def result(run: str, eval_id: str, node: str, accuracy: float, replicas: int = 2, stage: str = "full") -> bytes:
    return EvalEvent(run_id=run, node=node, eval_id=eval_id, step=1, dataset="math|500", stage=stage,
                     accuracy=accuracy, replicas=replicas, ts=2.0, event_id=f"{run}-{eval_id}-{node}").to_json()


def feed(core: StreamCore, batches: list[list[tuple[str, bytes]]], tick: bool = False) -> None:
    async def go() -> None:
        offset = 0
        for batch in batches:
            msgs = []
            for topic, value in batch:
                msgs.append(Input(topic, 0, offset, None, value, 1.0))
                offset += 1
            await core.on_batch(msgs)
            if tick:
                await core.on_tick(0)

    asyncio.run(go())


def busy_state(core: StreamCore) -> None:
    """A run with every kind of record: steps waiting for ranks, open and closed rounds, a last
    good consensus, a dead letter's memory."""
    feed(core, [
        [(TOPICS.steps, step("r", n)) for n in range(5)],
        [(TOPICS.steps, step("r", 5, rank=0, world=2)), (TOPICS.steps, step("r", 6, rank=1, world=2))],
        [(TOPICS.evals, result("r", "e1", "a", 0.5)), (TOPICS.evals, result("r", "e1", "b", 0.5))],
        [(TOPICS.evals, result("r", "e2", "a", 0.7, replicas=3))],
        [(TOPICS.steps, b'{"type": "step", "run_id": "r", "step": -1}'), (TOPICS.runs, RunEvent(run_id="r", node="n0", status="running",
                                                               config={"eval_interval_steps": 7}, ts=1.0).to_json())],
    ])


def make_core(table: Any) -> tuple[StreamCore, Recorder]:
    rec = Recorder()
    return StreamCore(topics=TOPICS, config=StreamsConfig(defaults=CFG), table=table, send=rec.send,
                      clock=lambda: 1000.0), rec


def test_a_saved_state_loads_back_the_same_in_a_new_store() -> None:
    table: dict[bytes, bytes] = {}
    core, _ = make_core(table)
    busy_state(core)
    state = core.cache["r"]
    assert state.ranks.pending and state.votes.open_rounds and state.votes.closed and state.votes.last_good
    assert state.invalid and state.trigger.base_interval == 7
    assert StateStore(table).load("r") == state
    kinds = sorted(json.loads(k)[1] for k in table)
    # head, 2 waiting steps (written once each: their reports in their own record), 2 rounds
    assert kinds == ["closed", "pending", "pending", "round", "run"]


def test_a_batch_of_steps_rewrites_one_record_per_run() -> None:
    table = LoggedTable()
    core, _ = make_core(table)
    busy_state(core)
    table.log.clear()
    feed(core, [[(TOPICS.steps, step(run, n)) for n in range(10, 30) for run in ("r", "q")]])
    assert sorted(key for _, key, _ in table.log) == [record_key("q", "run"), record_key("r", "run")]


def test_closing_a_round_beside_2048_closed_ones_writes_a_handful_of_records() -> None:
    table = LoggedTable()
    core, _ = make_core(table)
    feed(core, [[(TOPICS.evals, result("r", f"e{i}", "a", 0.5, replicas=1)) for i in range(CLOSED_ROUNDS_KEPT)]])
    assert len(core.cache["r"].votes.closed) == CLOSED_ROUNDS_KEPT
    table.log.clear()
    feed(core, [[(TOPICS.evals, result("r", "late", "a", 0.5, replicas=2))],
                [(TOPICS.evals, result("r", "late", "b", 0.5, replicas=2))]])
    ops = [(op, json.loads(key)[1]) for op, key, _ in table.log]
    # the round opens (round + head), then closes: its number, the head, its tombstone, the oldest forgotten
    assert ops == [("put", "round"), ("put", "run"),
                   ("put", "closed"), ("put", "run"), ("delete", "round"), ("delete", "closed")]
    state = StateStore(dict(table)).load("r")
    assert state == core.cache["r"] and state.votes.closed[-1].eval_id == "late"
    assert state.votes.closed[0].eval_id == "e1"  # e0 forgotten: the oldest


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_a_save_cut_short_and_the_batch_read_again_give_the_same_state_and_events(data: st.DataObject) -> None:
    table = LoggedTable()
    core, rec = make_core(table)
    busy_state(core)
    before = dict(table)
    table.log.clear()
    rec.sent.clear()
    batch = data.draw(st.lists(st.sampled_from([
        (TOPICS.evals, result("r", "e2", "b", 0.7, replicas=3)),  # closes e2: round deleted, closed added
        (TOPICS.evals, result("r", "e3", "a", 0.1, replicas=2)),  # opens e3
        (TOPICS.steps, step("r", 5, rank=1, world=2)),  # completes step 5
        (TOPICS.steps, step("r", 7, rank=0, world=2)),  # a new step waits
        (TOPICS.steps, step("r", 6, rank=2, world=3)),  # step 6 waits on (rewritten)
        (TOPICS.steps, step("r", 40)),
    ]), min_size=1, max_size=5))
    feed(core, [batch])
    new_state, first = core.cache["r"], {v["event_id"]: v for _, _, v in rec.sent}
    writes = list(table.log)
    for cut in range(len(writes) + 1):
        crashed = dict(before)
        for op, key, value in writes[:cut]:
            if op == "put":
                crashed[key] = value
            else:
                crashed.pop(key, None)
        again, rec2 = make_core(crashed)
        feed(again, [batch])  # the offsets were not committed: the batch comes again
        assert again.cache["r"] == new_state, cut
        assert StateStore(crashed).load("r") == new_state, cut
        assert all(first.get(v["event_id"]) == v for _, _, v in rec2.sent), cut
        if cut == 0:
            assert {v["event_id"] for _, _, v in rec2.sent} == set(first)


def test_a_state_of_the_older_layout_loads_and_is_replaced_at_the_next_save() -> None:
    table: dict[bytes, bytes] = {}
    core, _ = make_core(table)
    busy_state(core)
    old_layout = {b"r": codec.dumps(core.cache["r"])}
    core2, _ = make_core(old_layout)
    assert core2.load("r", 0) == core.cache["r"]
    feed(core2, [[(TOPICS.steps, step("r", 50))]])
    assert b"r" not in old_layout and StateStore(old_layout).load("r") == core2.cache["r"]


def test_a_run_whose_head_does_not_decode_starts_over_and_its_leftovers_go() -> None:
    table: dict[bytes, bytes] = {}
    core, _ = make_core(table)
    busy_state(core)
    table[record_key("r", "run")] = b'{"smoothing": {"points": "no"}}'
    core2, rec = make_core(table)
    feed(core2, [[(TOPICS.steps, step("r", 0))]])
    dead = [v for t, _, v in rec.sent if t == TOPICS.deadletter]
    assert len(dead) == 1 and "$.smoothing.points" in dead[0]["reason"]
    assert core2.stats["bad_states"] == 1 and core2.stats["errors"] == 0
    assert sorted(json.loads(k)[1] for k in table) == ["run"]  # the old round records are gone
    assert StateStore(table).load("r").smoothing.max_step == 0


def test_a_waiting_steps_reports_that_are_missing_or_overrun_its_count_do_not_decode() -> None:
    table: dict[bytes, bytes] = {}
    core, _ = make_core(table)
    # the first report in the step's record; at the next batch both in a record of their own (generation 1),
    # then the next two in a second record
    feed(core, [[ranked(7, 0, 5)], [ranked(7, 1, 5)], [ranked(7, 2, 5), ranked(7, 3, 5)]])
    first, second = record_key("r", "reports", [0, 7], 1, 0), record_key("r", "reports", [0, 7], 1, 2)
    assert first in table and second in table
    assert StateStore(dict(table)).load("r") == core.cache["r"]
    for change, why in (({first: None}, "$.ranks.pending[0].reports[0]: the reports' record is missing"),
                        ({second: codec.dumps([])}, "$.ranks.pending[0].reports[2]: 0 reports where 2 are left"),
                        ({second: codec.dumps([RankReport(r, 0.5, None) for r in (2, 3, 4)])},
                         "$.ranks.pending[0].reports[2]: 3 reports where 2 are left"),
                        ({second: b'[{"rank": "x"}]'}, "$.ranks.pending[0].reports[2]: Expected `int`")):
        broken = {k: v for k, v in {**table, **change}.items() if v is not None}
        store = StateStore(broken)
        assert store.load("r") is None
        assert len(store.bad) == 1 and why in store.bad[0].why


def test_round_keys_with_separators_stay_apart_in_record_keys() -> None:
    cfg = RunConfig()
    votes, _ = add_result(RunState("r").votes, RoundKey("r", "a|b", "c", "full"), 1, 2, NodeResult("n", True, 0.5),
                          0.0, cfg)
    votes, _ = add_result(votes, RoundKey("r", "a", "b|c", "full"), 1, 2, NodeResult("n", True, 0.5), 0.0, cfg)
    table: dict[bytes, bytes] = {}
    StateStore(table).save(RunState("r", partition=0, votes=votes))
    assert StateStore(table).load("r").votes == votes


# ------------------------------------------------------------------ batches = one by one

RUNS = ("r1", "r2")


@st.composite
def message(draw: Any) -> tuple[str, bytes]:
    run = draw(st.sampled_from(RUNS))
    kind = draw(st.sampled_from(["step", "step", "step", "ranked", "eval", "bad", "run"]))
    n = draw(st.integers(0, 12))
    if kind == "step":
        return TOPICS.steps, step(run, n, reward=draw(st.floats(0, 1)))
    if kind == "ranked":
        return TOPICS.steps, step(run, n, rank=draw(st.integers(0, 2)), world=3, reward=draw(st.floats(0, 1)))
    if kind == "eval":
        return TOPICS.evals, result(run, f"e{n % 3}", draw(st.sampled_from("abc")), draw(st.floats(0, 1)), 3,
                                    draw(st.sampled_from(["quick", "full"])))
    if kind == "run":
        return TOPICS.runs, RunEvent(run_id=run, node="n0", status=draw(st.sampled_from(["running", "finished"])),
                                     attempt=draw(st.integers(0, 1)), ts=1.0, event_id=f"{run}-run-{n}").to_json()
    return TOPICS.steps, json.dumps({"type": "step", "run_id": run, "step": -n}).encode()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(message(), min_size=1, max_size=40), st.data())
def test_batches_give_what_one_message_at_a_time_gives(msgs: list[tuple[str, bytes]], data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(msgs) - 1)), max_size=5)))
    batches = [msgs[a:b] for a, b in zip([0, *cuts], [*cuts, len(msgs)]) if a < b]
    one_table: dict[bytes, bytes] = {}
    one, one_rec = make_core(one_table)
    feed(one, [[m] for m in msgs], tick=False)
    many_table: dict[bytes, bytes] = {}
    many, many_rec = make_core(many_table)
    feed(many, batches, tick=False)
    for run in RUNS:
        per_run = [[(t, v) for t, _, v in rec.sent if v["run_id"] == run] for rec in (one_rec, many_rec)]
        assert per_run[0] == per_run[1], run
        assert StateStore(one_table).load(run) == StateStore(many_table).load(run)
    assert one.stats["errors"] == many.stats["errors"] == 0


class FaustLikeTable:
    """What the store uses of Faust's table: `data`, and `send_changelog` (recorded)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.changelog: list[tuple[int, bytes, bytes | None]] = []

    def send_changelog(self, partition: int, key: bytes, value: bytes | None, **kw: Any) -> None:
        self.changelog.append((partition, key, value))


def test_changelog_records_sent_directly_are_the_tables_own_in_the_same_order() -> None:
    via_table = FaustLikeTable()
    core, _ = make_core(via_table)
    busy_state(core)
    completes = [[(TOPICS.steps, step("r", 5, rank=1, world=2))]]  # its waiting record goes: a tombstone
    feed(core, completes)
    direct_table, sent = FaustLikeTable(), []

    async def changelog(records: list[tuple[int, bytes, bytes | None]]) -> None:
        sent.extend(records)

    rec = Recorder()
    direct = StreamCore(topics=TOPICS, config=StreamsConfig(defaults=CFG), table=direct_table, send=rec.send,
                        clock=lambda: 1000.0, changelog=changelog)
    busy_state(direct)
    feed(direct, completes)
    assert direct_table.changelog == []  # none through the table's buffer
    assert sent == via_table.changelog and any(v is None for _, _, v in sent)  # tombstones too
    assert direct.store.io.take() == []  # every record left at the end of its batch
    replayed = replay_changelog(sent)  # what a worker recovering from the changelog reads
    assert replayed == direct_table.data and StateStore(replayed).load("r") == direct.cache["r"]


# ------------------------------------------------------------------ a step of many ranks, one report per batch

RANKS = 1024


def direct_core(table: FaustLikeTable, sent: list[tuple[int, bytes, bytes | None]]) -> tuple[StreamCore, Recorder]:
    """A worker core whose changelog records go to `sent`, as in the worker (app.py)."""

    async def changelog(records: list[tuple[int, bytes, bytes | None]]) -> None:
        sent.extend(records)

    rec = Recorder()
    return StreamCore(topics=TOPICS, config=StreamsConfig(defaults=CFG), table=table, send=rec.send,
                      clock=lambda: 1000.0, changelog=changelog), rec


def ranked(n: int, rank: int, world: int = RANKS) -> tuple[str, bytes]:
    return TOPICS.steps, step("r", n, rank=rank, world=world, reward=rank / world)


def test_a_step_whose_ranks_report_one_per_batch_writes_each_report_to_the_changelog_once() -> None:
    written = {}
    for world in (RANKS // 4, RANKS):
        sent: list[tuple[int, bytes, bytes | None]] = []
        core, rec = direct_core(FaustLikeTable(), sent)
        feed(core, [[ranked(7, rank, world)] for rank in range(world)])
        points = [v for t, _, v in rec.sent if t == TOPICS.smoothed]
        assert [p["step"] for p in points] == [7]
        assert points[0]["reward"] == pytest.approx(sum(r / world for r in range(world)) / world)  # every rank's
        assert not core.cache["r"].ranks.pending
        values = [v for _, _, v in sent if v is not None]
        # every report that waited is encoded into one changelog record, once (before: into every later
        # batch's record too), but the first: in the step's own record, then moved into a record of the
        # reports' own at the next batch; the last completes the step, which leaves
        copies = [sum(v.count(b'{"rank":%d,' % rank) for v in values) for rank in range(world)]
        assert copies == [2] + [1] * (world - 2) + [0]
        written[world] = sum(len(k) + len(v or b"") for _, k, v in sent)
    # four times the ranks, four times the bytes (less what a step costs once: its point, the head)
    assert written[RANKS] < 4 * written[RANKS // 4]
    assert written[RANKS] < 300 * RANKS  # a record and the step's own per report, a tombstone each at the end


def test_a_worker_restarted_from_its_changelog_mid_step_ends_as_the_uninterrupted_one() -> None:
    batches = [[ranked(7, rank)] for rank in range(RANKS)] + [[ranked(8, 0, 2), ranked(8, 1, 2)]]
    sent: list[tuple[int, bytes, bytes | None]] = []
    whole, whole_rec = direct_core(FaustLikeTable(), sent)
    at: dict[int, tuple[Any, int]] = {}  # batches fed -> (the state then, changelog records sent by then)
    for i, batch in enumerate(batches):
        feed(whole, [batch])
        at[i + 1] = (whole.cache["r"], len(sent))
    end = whole.cache["r"]
    assert not end.ranks.pending and end.smoothing.max_step == 8
    for cut in (1, 2, 333, RANKS - 1):
        state, n_sent = at[cut]
        replayed = replay_changelog(sent[:n_sent])  # the worker died after `cut` batches, committed
        assert StateStore(replayed).load("r") == state, cut
        table = FaustLikeTable()
        table.data.update(replayed)
        again, rec = direct_core(table, [])
        redelivered = max(0, cut - 5)  # the last five batches were not committed: they come again
        feed(again, batches[redelivered:])
        assert again.cache["r"] == end, cut  # no report counted twice: the same mean, the same state
        smoothed = [v for t, _, v in rec.sent if t == TOPICS.smoothed]
        assert smoothed == [v for t, _, v in whole_rec.sent if t == TOPICS.smoothed], cut


def test_a_waiting_step_of_the_layout_before_loads_and_its_next_report_rewrites_it() -> None:
    table: dict[bytes, bytes] = {}
    core, _ = make_core(table)
    feed(core, [[ranked(7, rank, 4)] for rank in range(2)])
    waiting = core.cache["r"].ranks.pending[(0, 7)]
    # the step as the layout before wrote it: every report in the step's own record
    key = record_key("r", "pending", [0, 7])
    old_layout = {k: v for k, v in table.items() if json.loads(k)[1] != "reports"}
    old_layout[key] = codec.dumps(waiting)
    assert b'"rank":1' in old_layout[key]
    again, _ = make_core(old_layout)
    assert again.load("r", 0) == core.cache["r"]
    feed(again, [[ranked(7, 2, 4)]])
    feed(core, [[ranked(7, 2, 4)]])
    assert again.cache["r"] == core.cache["r"] and len(again.cache["r"].ranks.pending[(0, 7)].reports) == 3
    assert b"rank" not in old_layout[key]  # rewritten: the reports in a record of their own
    assert StateStore(dict(old_layout)).load("r") == core.cache["r"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True),
       st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True))
def test_a_step_whose_reports_are_replaced_reads_back_as_before_or_after_wherever_the_save_stops(
        first: list[int], then: list[int]) -> None:
    """Reports that do not continue the saved ones (not the worker's path: a step's reports
    only grow) are written anew as the next generation; a save cut short reads as either state."""
    def with_reports(ranks: list[int], ts: float) -> RunState:
        reports = tuple(RankReport(r, r / 10, None) for r in ranks)
        return RunState("r", partition=0, ranks=RankState({(0, 7): PendingStep(8, 1.0, ts, reports)}))

    table = LoggedTable()
    store = StateStore(table)
    store.save(with_reports(first, 1.0))
    store.save(with_reports(first + [9], 1.5))  # continues: one record more
    before, old = dict(table), with_reports(first + [9], 1.5)
    table.log.clear()
    new = with_reports(then, 2.0)
    store.save(new)
    assert StateStore(dict(table)).load("r") == new
    for cut in range(len(table.log) + 1):
        crashed = dict(before)
        for op, key, value in table.log[:cut]:
            if op == "put":
                crashed[key] = value
            else:
                crashed.pop(key, None)
        assert StateStore(crashed).load("r") in (old, new), cut
    assert sorted(json.loads(k)[1] for k in table) == ["pending", "reports", "run"]  # the old generation's gone


# ------------------------------------------------------------------ a record too large to keep


def big_result(run: str, n: int) -> bytes:
    """A result whose open round is a record of about 2 bytes a verdict."""
    return EvalEvent(run_id=run, node="a", eval_id="big", step=1, dataset="math", replicas=2, ts=2.0,
                     verdicts=[i % 2 for i in range(n)], accuracy=0.5, event_id=f"{run}-big-a").to_json()


def bounded_core(table: dict[bytes, bytes], max_record_bytes: int | None) -> tuple[StreamCore, Recorder]:
    rec = Recorder()
    return StreamCore(topics=TOPICS, config=StreamsConfig(defaults=CFG), table=table, send=rec.send,
                      clock=lambda: 1000.0, state_record_max_bytes=max_record_bytes), rec


def test_a_message_whose_state_record_would_be_over_the_bound_is_dead_lettered_and_the_rest_kept() -> None:
    """The broker refuses a state record over its changelog's max.message.bytes, and a state it refused is
    a state lost: the store refuses to write one (StateRecordTooLarge, nothing written), and the batch goes
    again one by one, so the message behind it is dead-lettered saying the sizes and the others count. A
    waiting step (its reports in records of their own) that got a report in that batch ends as it does
    without the big message."""
    waits = [[(TOPICS.steps, step("r", 20, rank=r, world=4))] for r in (0, 1)]  # its reports in records of their own
    batch = [(TOPICS.steps, step("r", 20, rank=2, world=4)), (TOPICS.evals, big_result("r", 4_000)),
             (TOPICS.steps, step("r", 21)), (TOPICS.evals, result("r", "e9", "a", 0.5))]
    then = [(TOPICS.steps, step("r", 20, rank=3, world=4)), (TOPICS.steps, step("r", 22))]
    bounded_table: dict[bytes, bytes] = {}
    bounded, bounded_rec = bounded_core(bounded_table, 4_000)
    feed(bounded, [[(TOPICS.steps, step("r", n)) for n in range(5)], *waits, batch, then])
    reference_table: dict[bytes, bytes] = {}
    reference, reference_rec = bounded_core(reference_table, None)
    feed(reference, [[(TOPICS.steps, step("r", n)) for n in range(5)], *waits,
                     [m for m in batch if b'"big"' not in m[1]], then])

    dead = [v for t, _, v in bounded_rec.sent if t == TOPICS.deadletter]
    assert [d["source_topic"] for d in dead] == [TOPICS.evals]
    assert dead[0]["reason"].startswith("evals: not processed: the run's state record 'round' would be ")
    assert "over the 4,000 a state record may take" in dead[0]["reason"]
    assert bounded.stats["errors"] == 0  # the input's doing, not a worker error
    # the outputs of the batch's first pass went out before its save failed, and go again with the same ids
    # in the pass one by one: as the sink stores them (by event_id), they are the reference's
    kept = list({v["event_id"]: (t, v) for t, _, v in bounded_rec.sent
                 if t not in (TOPICS.deadletter, TOPICS.alerts)}.values())
    assert kept == [(t, v) for t, _, v in reference_rec.sent]
    assert [p["step"] for t, p in kept if t == TOPICS.smoothed] == [0, 1, 2, 3, 4, 21, 20, 22]
    state, expected = StateStore(bounded_table).load("r"), StateStore(reference_table).load("r")
    assert state is not None and expected is not None and state.invalid  # the dead letter's memory
    assert msgspec.structs.replace(state, invalid=expected.invalid) == expected
    assert all(len(k) + len(v) + RECORD_OVERHEAD <= 4_000 for k, v in bounded_table.items())


def test_a_result_that_makes_its_round_too_large_is_refused_as_it_arrives_however_the_results_are_batched() -> None:
    """The bound is asked after each result, not of the batch's end state: a round that grew past it and was
    decided later in the same batch sent a consensus counting the result the one-by-one pass then refused
    (the same event_id later carried another accuracy), and batched and one-by-one processing disagreed."""

    def res(eval_id: str, node: str, acc: float, verdicts: int = 0, replicas: int = 3) -> tuple[str, bytes]:
        return TOPICS.evals, EvalEvent(run_id="r", node=node, eval_id=eval_id, step=1, dataset="math", ts=2.0,
                                       replicas=replicas, accuracy=acc, event_id=f"r-{eval_id}-{node}",
                                       **({"verdicts": [1] * verdicts} if verdicts else {})).to_json()

    msgs = [(TOPICS.steps, step("r", n)) for n in range(3)] + [
        res("e5", "a", 0.5), res("e5", "b", 0.9, verdicts=2_000), res("e5", "c", 0.9),
        res("e6", "a", 0.5, verdicts=2_000, replicas=2), res("e5", "d", 0.5)]
    sent, tables = [], []
    for batches in ([msgs[:3], msgs[3:4], msgs[4:7], msgs[7:]], [[m] for m in msgs]):
        table: dict[bytes, bytes] = {}
        core, rec = bounded_core(table, 4_000)
        feed(core, batches)
        sent.append([(t, v) for t, _, v in rec.sent])
        tables.append(table)
    assert sent[0] == sent[1] and tables[0] == tables[1]
    [consensus] = [v for t, v in sent[0] if t == TOPICS.consensus]
    assert (consensus["accuracy"], consensus["dissenters"]) == (0.5, ["c"])  # a, c, d: b never counted
    assert [v["reason"].split(":")[0] for t, v in sent[0] if t == TOPICS.deadletter] == ["evals", "evals"]


def test_a_run_whose_head_is_over_the_bound_dead_letters_its_input_without_stopping_the_batch() -> None:
    """A bound lowered below a stored state (or a head grown past it): every input of the run is dead-lettered
    (its state cannot be kept), and the dead letter's own save, which fails too, no longer raises out of the
    batch (a worker crash, twice a message, then a poison_message for a healthy step)."""
    table: dict[bytes, bytes] = {}
    unbounded, _ = bounded_core(table, None)
    feed(unbounded, [[(TOPICS.runs, RunEvent(run_id="r", node=f"n{i}", rank=i, world_size=4_000, status="running",
                                             ts=1.0).to_json()) for i in range(4_000)]])
    head = len(table[record_key("r", "run")])
    bounded, rec = bounded_core(table, head // 2)
    feed(bounded, [[(TOPICS.steps, step("r", 1)), (TOPICS.steps, step("q", 1))]])
    dead = [v for t, _, v in rec.sent if t == TOPICS.deadletter]
    assert [(d["run_id"], d["reason"].split(":")[0]) for d in dead] == [("r", "steps")]
    assert "state record 'run' would be" in dead[0]["reason"]
    # the other run goes on; r's point went out with the batch's first pass, before its save failed (only the
    # round records are checked as each input arrives: a head over the bound is a bound lowered under a state)
    assert [v["run_id"] for t, _, v in rec.sent if t == TOPICS.smoothed] == ["r", "q"]


def test_a_tick_whose_state_cannot_be_saved_sends_its_decision_once_and_says_so_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """A head over a bound lowered under it, at a tick that completes a waiting step: the step's point goes
    out and the state cannot be saved. It stays in memory: the next ticks do not decide (and send) it again,
    which they did each second, and the log says so once, not at every tick."""
    table: dict[bytes, bytes] = {}
    unbounded, _ = bounded_core(table, None)
    feed(unbounded, [[(TOPICS.runs, RunEvent(run_id="r", node=f"n{i}", rank=i, world_size=4_000, status="running",
                                             ts=1.0).to_json()) for i in range(4_000)],
                     [(TOPICS.steps, step("r", 1, rank=0, world=2))]])  # waits for rank 1
    head = len(table[record_key("r", "run")])
    now = [1000.0]
    rec = Recorder()
    core = StreamCore(topics=TOPICS, config=StreamsConfig(defaults=CFG), table=table, send=rec.send,
                      clock=lambda: now[0], state_record_max_bytes=head // 2)

    async def ticks() -> None:
        for _ in range(4):
            now[0] += CFG.step_wait_s + 1
            await core.on_tick(0)

    with caplog.at_level(logging.ERROR, logger="streams"):
        asyncio.run(ticks())
    assert [v["step"] for t, _, v in rec.sent if t == TOPICS.smoothed] == [1]
    assert len([r for r in caplog.records if "not saved after its tick" in r.getMessage()]) == 1
    assert core.cache["r"].ranks.pending == {} and table[record_key("r", "run")]  # the stored state is the one before


def test_an_input_after_a_tick_state_that_was_not_stored_goes_on_the_stored_state() -> None:
    """The tick's state stays in memory when it cannot be stored; an input of the run whose save then fails
    on it (the tick's part is what cannot be stored) goes again, once, on the state the table holds, and
    is kept: it was dead-lettered, a valid step lost (review of de442a5)."""
    table: dict[bytes, bytes] = {}
    now = [1000.0]
    rec = Recorder()
    core = StreamCore(topics=TOPICS, config=StreamsConfig(defaults=CFG), table=table, send=rec.send,
                      clock=lambda: now[0])
    feed(core, [[(TOPICS.steps, step("r", 1, rank=0, world=2))]])  # waits for rank 1
    saving = core.store.save

    def refusing_step_1(state: Any) -> None:  # the tick's part (step 1 smoothed) cannot be stored
        if any(p.step == 1 for p in state.smoothing.points):
            raise StateRecordTooLarge("step 1's point cannot be stored")
        saving(state)

    core.store.save = refusing_step_1  # type: ignore[method-assign]
    now[0] += CFG.step_wait_s + 1
    asyncio.run(core.on_tick(0))
    assert [v["step"] for t, _, v in rec.sent if t == TOPICS.smoothed] == [1]
    feed(core, [[(TOPICS.steps, step("r", 2, rank=0, world=2))]])  # waits too: no point of its own
    assert not [v for t, _, v in rec.sent if t == TOPICS.deadletter]
    stored = StateStore(dict(table)).load("r")
    assert stored is not None and {k[1] for k in stored.ranks.pending} == {1, 2}  # kept on the stored state


def test_a_run_whose_records_left_the_table_after_the_index_was_built_loads_as_none() -> None:
    """Faust drops a lost partition's records once a rebalance's recovery completes; an index built before
    (a batch in between) still lists them. Loading such a run is 'not this worker's run' (it raised out of
    the batch: the head decoded from None, review of 95b74dc)."""
    table: dict[bytes, bytes] = {}
    core, _ = bounded_core(table, None)
    feed(core, [[(TOPICS.steps, step("r", 1, rank=0, world=2))]])  # a head and a waiting step's record
    store = StateStore(table)
    assert store.run_ids() == ["r"]  # the index, built
    table.clear()  # the partition went to another worker
    assert store.load("r") is None and store.run_ids() == [] and not store.bad


def test_a_run_whose_tick_state_cannot_be_stored_is_said_once_however_many_inputs_come(
        caplog: pytest.LogCaptureFixture) -> None:
    """Each input of such a run goes again on the stored state, after which the next tick decides again:
    the log says it once in ten minutes, not at each cycle (a successful save of the input reset the count,
    and the replay logged each time: review of 95b74dc). The decision goes out again each cycle, with the
    same id."""
    table: dict[bytes, bytes] = {}
    now = [1000.0]
    rec = Recorder()
    core = StreamCore(topics=TOPICS, config=StreamsConfig(defaults=CFG), table=table, send=rec.send,
                      clock=lambda: now[0])
    feed(core, [[(TOPICS.steps, step("r", 1, rank=0, world=2))]])
    saving = core.store.save

    def refusing_step_1(state: Any) -> None:
        if any(p.step == 1 for p in state.smoothing.points):
            raise StateRecordTooLarge("step 1's point cannot be stored")
        saving(state)

    core.store.save = refusing_step_1  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="streams"):
        for n in (2, 3, 4):
            now[0] += CFG.step_wait_s + 1
            asyncio.run(core.on_tick(0))
            feed(core, [[(TOPICS.steps, step("r", n, rank=0, world=2 + n))]])  # waits: no point of its own
    said = [r.getMessage() for r in caplog.records if "not saved" in r.getMessage()]
    assert len(said) == 1 and "after its tick" in said[0]
    points = [v for t, _, v in rec.sent if t == TOPICS.smoothed and v["step"] == 1]  # (2 and 3 time out too)
    assert len(points) == 3 and len({p["event_id"] for p in points}) == 1
    assert not [v for t, _, v in rec.sent if t == TOPICS.deadletter]

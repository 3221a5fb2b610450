"""Wire and state compatibility held by golden files (tests/data/golden/, made by
tests/data/make_golden.py from the code of the day they were recorded).

Every event type's JSON reads back and is written again byte for byte, and the worker's stored
state (RunState, as the state codec writes it, and a busier one as its table records)
likewise: a new record or codec implementation must read what the old one wrote and write
what the old one read (plus the fields a record gained since, at their defaults: ADDED_SINCE).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_metrics.producers.contract.events import EVENT_TYPES, parse_event
from areal_metrics.streams.core.processor import RunState
from areal_metrics.streams.state import codec
from areal_metrics.streams.state.state_store import StateStore

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
EVENTS = GOLDEN.joinpath("events.jsonl").read_bytes().splitlines()
STATES = GOLDEN.joinpath("state.jsonl").read_bytes().splitlines()
TABLE = dict(line.split(b"\t", 1) for line in GOLDEN.joinpath("table.jsonl").read_bytes().splitlines())


def test_the_golden_events_cover_every_type() -> None:
    assert {json.loads(line)["type"] for line in EVENTS} == set(EVENT_TYPES)


@pytest.mark.parametrize("line", EVENTS, ids=lambda line: json.loads(line)["type"])
def test_each_event_reads_back_and_is_written_byte_for_byte(line: bytes) -> None:
    event = parse_event(line)
    assert event.to_json() == line
    assert set(event.to_dict()) == set(json.loads(line))  # no field dropped on the way


# Fields a stored record gained since the golden files were recorded, as a record written now
# holds them at their default: an old record reads back with the default and is written as
# before plus these (EvalLoopState.good_round: the rollback's latest good round; the CUSUM
# threshold rule, the plateau's window and dispersion, the raise's wait, of issue 40; RunState.acks:
# the scale_lr commands watched for the trainers' acknowledgements, of issue 41; TriggerState.baseline_from: what an
# evaluate_now's "since" names, of issue 40; EvalLoopState's plateau window, dispersion and last round with undecided
# samples counted wrong, of issue 42's round: filled from the one reading at the next round; Consensus' effective
# sizes of its interval's two ends, which the loop reads: one rule for both, of issue 42).
ADDED_SINCE = (b',"good_round":null', b',"cusum":0.0', b',"window":[]', b',"dispersion":[0.0,0]',
               b',"last_round":null', b',"window_low":[]', b',"dispersion_low":[0.0,0]', b',"last_round_low":null',
               b',"lowered_from":null', b',"steady":0', b',"ceiling":1.0',
               b',"raised_in":null', b',"locked_in":null', b',"acks":{"sent":[],"acked":[],"alerted":[]}',
               b',"baseline_from":"start"')
CONSENSUS_ADDED = (b',"n_effective_wrong":null,"n_effective_right":null',)  # where a state holds a consensus


# A waiting step's first write is still the golden layout: its record holds its reports. At its
# next change they move into records of their own, each report written once from then on (issue
# 42: a step of 1,024 ranks reporting one per batch rewrote 1+2+...+1,024 reports), which
# tests/test_streams_state_store.py reads back in every layout.


def as_recorded(written: bytes) -> bytes:
    """A record written now, less the fields added since (each at its default, once)."""
    for added in ADDED_SINCE + CONSENSUS_ADDED:
        assert written.count(added) <= 1, added
        written = written.replace(added, b"")
    return written


@pytest.mark.parametrize("line", STATES)
def test_the_workers_state_reads_back_and_is_written_byte_for_byte(line: bytes) -> None:
    state = codec.loads(RunState, line)
    assert state.run_id == "run-1" and state.smoothing.points  # the record is a real, populated state
    assert state.eval_loop.good_round is None  # an added field reads back at its default
    written = codec.dumps(state)
    assert all(added in written for added in ADDED_SINCE)
    assert as_recorded(written) == line


def test_the_workers_table_records_read_back_and_are_written_byte_for_byte() -> None:
    state = StateStore(dict(TABLE)).load("run-1")
    assert state is not None and state.ranks.pending and state.votes.open_rounds and state.votes.closed
    assert state.votes.last_good and state.invalid and state.loop_overrides  # every kind of record, every mapping
    rewritten: dict[bytes, bytes] = {}
    StateStore(rewritten).save(state)
    assert {key: as_recorded(value) for key, value in rewritten.items()} == TABLE
    assert StateStore(dict(rewritten)).load("run-1") == state  # the records of either layout: one state
    again: dict[bytes, bytes] = {}
    StateStore(again).save(StateStore(dict(rewritten)).load("run-1"))
    assert again == rewritten

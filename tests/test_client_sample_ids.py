"""`run.log_eval(..., sample_ids=..., shard_nodes=...)`: a sharded round through the public client, as a
trainer in any framework sends it; a bad value is never raised to the trainer."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.areal_train.reporting import RunSpec
from areal_metrics.producers.contract.events import EvalEvent
from tests.train_capture import ClientCapture


def _run(tmp_path, rank: int = 0):
    capture = ClientCapture(tmp_path)
    return capture, capture.open_run(RunSpec("shard-run", rank, 4, 0, f"n{rank}", {}, (), None))


def test_a_sharded_round_carries_its_sample_ids_and_shard_nodes(tmp_path) -> None:
    capture, run = _run(tmp_path)
    run.log_eval("math", 3, verdicts=np.array([1, 0, 1]), sample_ids=np.array([30, 31, 0]), replicas=3,
                 shard_nodes=4)
    run.log_eval("math", 3, stage="quick", verdicts=[1, 1])  # unsharded: neither field
    run.finish()
    full, quick = sorted((e for e in capture.events() if isinstance(e, EvalEvent)), key=lambda e: e.stage)
    assert (full.sample_ids, full.shard_nodes, full.replicas, full.verdicts) == ((30, 31, 0), 4, 3, (1, 0, 1))
    assert (quick.sample_ids, quick.shard_nodes) == (None, None)


@settings(max_examples=40, deadline=None)
@given(ids=st.one_of(st.none(), st.text(max_size=3), st.lists(st.one_of(st.integers(-5, 2**33), st.floats(),
                                                                          st.text(max_size=2)), max_size=4)),
       nodes=st.one_of(st.none(), st.integers(-3, 5000), st.floats(), st.text(max_size=2)))
def test_bad_sample_ids_or_shard_nodes_never_raise(tmp_path_factory, ids, nodes) -> None:
    capture, run = _run(tmp_path_factory.mktemp("j"))
    run.log_eval("math", 1, verdicts=[1, 0, 1, 1], sample_ids=ids, replicas=2, shard_nodes=nodes)
    run.finish()
    for event in (e for e in capture.events() if isinstance(e, EvalEvent)):  # sent only when valid
        assert event.sample_ids is None or (len(event.sample_ids) == 4 and len(set(event.sample_ids)) == 4)
        assert event.shard_nodes is None or event.shard_nodes >= 2

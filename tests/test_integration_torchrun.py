"""examples/torchrun_ppo.py under torchrun (2 processes, gloo) against the real broker, stream worker and sink.

The example uses `areal_metrics.init` alone (rank, world size and node from
torchrun's environment). Once it is running, `evaluate_now` and `stop` are
published on the control topic: both ranks evaluate and stop at the same step,
long before `--steps`. Then every step of both ranks is a row, and every
evaluation round the example ran (on its schedule, or the command's) has one
consensus with the 2 ranks' votes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_metrics.producers.contract.topics import Topics
from tests import integration_support, test_client_broker
from tests.integration_support import torchrun_obeying
from tests.support import ROOT, wait_for

sink = test_client_broker.sink  # the fixture: the real sink as a process, queried through its endpoint
stream_worker = integration_support.stream_worker  # the fixture: the real stream worker as a process

pytestmark = [pytest.mark.broker, pytest.mark.timeout(600)]
RUN = "torchrun-ppo"
STEPS = 3000  # an upper bound: the stop command ends the run long before


def test_two_torchrun_ranks_report_vote_and_obey_commands(stack_env: dict[str, str], topics: Topics, tmp_path: Path,
                                                          sink, stream_worker) -> None:
    args = [str(ROOT / "examples" / "torchrun_ppo.py"), "--run-id", RUN, "--steps", str(STEPS), "--eval-every", "10",
            "--rollout-delay", "0.02"]
    out = torchrun_obeying(args, stack_env, topics, RUN, ["ready", RUN, "world", "2"], tmp_path / "torchrun.log",
                           timeout=400)
    lines = [line.split() for line in out.splitlines()]
    done = [words for words in lines if words[0] == "done"]
    assert len(done) == 1
    last, rounds = int(done[0][1]), int(done[0][3])
    assert last < STEPS - 1  # stopped by the command
    evals = [(int(words[1]), words[2]) for words in lines if words[0] == "eval"]
    assert len(evals) == rounds and "command" in {why for _, why in evals}

    wait_for(lambda: sink(f"SELECT count() FROM v_steps WHERE run_id = '{RUN}'") == [(2 * (last + 1),)], 180,
             "both ranks' steps")
    assert sink(f"SELECT rank, count(), max(step), uniqExact(node) FROM v_steps WHERE run_id = '{RUN}' "
                "GROUP BY rank ORDER BY rank") == [(0, last + 1, last, 1), (1, last + 1, last, 1)]
    wait_for(lambda: len(sink(f"SELECT 1 FROM v_eval_consensus WHERE run_id = '{RUN}'")) >= rounds, 180,
             "a consensus for every evaluation round")
    consensus = sink(f"SELECT step, votes, replicas FROM v_eval_consensus WHERE run_id = '{RUN}' ORDER BY step")
    assert consensus == [(step, 2, 2) for step, _ in sorted(evals)]
    runs = wait_for(lambda: sink(f"SELECT status, ranks, world_size, framework FROM v_runs WHERE run_id = '{RUN}' "
                                 "AND status != 'running'"), 60, "the run to finish")
    assert runs == [("finished", 2, 2, "torch")]
    assert stream_worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]

"""The vote on the real broker, fed as kcat would: raw JSON lines, keyed by run_id.

- run-k: a sharded round of 12 samples over 4 nodes at redundancy 3 (`sample_ids`,
  `shard_nodes`), node n3 faulty and first: the consensus is the honest accuracy, n3 alone
  is named (had it come last, the three honest nodes would have decided every sample first).
- run-t: two replicas that disagree on 3 samples: those are undecided, nobody is blamed, and a
  `vote_undecided` alert names both (two replicas cannot tell which one is wrong).
- run-0: a 2-rank run where only rank 0 registered and logs (rank-0-only logging): its round
  gets a consensus of its one node, and no `eval_failed` for the rank that never registered.

And the closed loop's rollback end to end: rounds logged through the public client, the
worker's `scale_lr` with `restore_step` read back by the same client, as the reference
trainer reads it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from areal_metrics.producers.contract.topics import Topics
from tests.test_streams_e2e import Msg, OutputReader, Worker, produce

pytestmark = pytest.mark.broker

T0 = 1_790_000_000.0
CONFIG = {"defaults": {"vote_timeout_s": 3.0, "stall_seconds": 0}, "tick_interval_s": 0.5}
TRUTH = (1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 0)  # 7 of 12


def line(**fields) -> bytes:
    """One message as a user would type it for kcat: a JSON object, nothing from our code."""
    return json.dumps({"schema": 1, "ts": T0, **fields}).encode()


def sharded_round(topics: Topics) -> list[Msg]:
    msgs = []
    for i in (3, 0, 1, 2):  # the faulty node first: counted, then outvoted (last, it would not be needed)
        ids = [s for s in range(12) if s % 4 != i]  # each sample on 3 of the 4 nodes
        verdicts = [1 - TRUTH[s] if i == 3 else TRUTH[s] for s in ids]  # n3 answers every sample wrong
        msgs.append(Msg(topics.evals, b"run-k", line(
            type="eval", event_id=f"k-n{i}", run_id="run-k", node=f"n{i}", rank=i, eval_id="k1", step=40,
            dataset="math500", stage="full", status="ok", accuracy=sum(verdicts) / len(verdicts),
            verdicts=verdicts, sample_ids=ids, replicas=3, shard_nodes=4)))
    return msgs


def tied_round(topics: Topics) -> list[Msg]:
    other = [1 - v if s < 3 else v for s, v in enumerate(TRUTH)]  # disagrees on samples 0..2
    return [Msg(topics.evals, b"run-t", line(type="eval", event_id=f"t-{node}", run_id="run-t", node=node, rank=r,
                                             eval_id="t1", step=10, dataset="math500", status="ok",
                                             accuracy=sum(v) / 12, verdicts=list(v), replicas=2))
            for r, (node, v) in enumerate((("a", TRUTH), ("b", other)))]


def rank_zero_only(topics: Topics) -> list[Msg]:
    return [
        Msg(topics.runs, b"run-0", line(type="run", event_id="r0", run_id="run-0", node="host-0", rank=0,
                                        status="running", world_size=2, config={})),
        Msg(topics.evals, b"run-0", line(type="eval", event_id="z-0", run_id="run-0", node="host-0", rank=0,
                                         eval_id="z1", step=5, dataset="math500", status="ok", accuracy=0.5,
                                         verdicts=[1, 0, 1, 0], replicas=2)),
    ]


def test_rounds_published_as_raw_json_vote_per_sample(kafka_bootstrap: str, topics: Topics,
                                                        stack_env: dict[str, str], tmp_path: Path) -> None:
    cfg = tmp_path / "streams.json"
    cfg.write_text(json.dumps(CONFIG))
    env = {**stack_env, "AREAL_STREAMS_CONFIG": str(cfg), "AREAL_STREAMS_SESSION_TIMEOUT": "6"}
    produce(kafka_bootstrap, [*rank_zero_only(topics), *sharded_round(topics), *tied_round(topics)])
    worker = Worker(env, tmp_path / "worker.log")
    reader = OutputReader(kafka_bootstrap, topics)
    worker.start()
    try:
        reader.wait_for({topics.consensus: 3}, timeout=90)
        reader.settle(5.0)  # past vote_timeout_s: an eval_failed for run-0's second rank would show now
    finally:
        rc = worker.stop()
        reader.close()
    assert rc == 0, (tmp_path / "worker.log").read_text()[-3000:]
    got = reader.distinct()
    consensus = {c["run_id"]: c for c in got[topics.consensus].values()}
    assert len(got[topics.consensus]) == 3

    k = consensus["run-k"]
    assert k["accuracy"] == 7 / 12 and (k["n_samples"], k["n_undecided"]) == (12, 0)
    assert k["dissenters"] == ["n3"] and k["votes"] == 4 and k["replicas"] == 3 and not k["partial"]
    assert k["ci_low"] < 7 / 12 < k["ci_high"]
    assert k["agreement"] == pytest.approx(27 / 36)  # n3's 9 votes outvoted

    t = consensus["run-t"]
    assert (t["n_samples"], t["n_undecided"], t["dissenters"]) == (9, 3, [])
    assert t["accuracy"] == sum(TRUTH[3:]) / 9

    z = consensus["run-0"]
    assert (z["votes"], z["replicas"], z["accuracy"], z["n_samples"], z["partial"]) == (1, 1, 0.5, 4, False)

    alerts = sorted((a["run_id"], a["kind"], a["message"]) for a in got[topics.alerts].values())
    # run-t: 3 of 12 undecided (25 % > 5 %): the two replicas are named, neither blamed
    assert [(run, kind) for run, kind, _ in alerts] == [("run-k", "node_divergence"), ("run-t", "vote_undecided")]
    assert "node n3 " in alerts[0][2].split(":")[0]
    assert "nodes a and b disagree on 3 of 12 samples" in alerts[1][2]


RANK_ZERO_SCRIPT = """
    import areal_metrics as am

    run = am.init(run_id="rank-zero-only", config={"eval_loop": {"threshold": 0.2}})  # RANK=0, WORLD_SIZE=2
    run.log({"reward": 0.5}, step=1)
    run.log_eval("math500", 1, verdicts=[1, 0, 1, 1])
    run.finish()
"""


def test_a_two_rank_run_that_logs_from_rank_zero_only_gets_its_consensus(
    kafka_bootstrap: str, topics: Topics, stack_env: dict[str, str], tmp_path: Path
) -> None:
    """The habit other trackers teach: `init` on rank 0 alone, through the real client and worker."""
    from tests.kafka_reading import read_to_end
    from tests.support import child_env, start_service, stop_process, wait_for
    from tests.test_client_broker import start

    cfg = tmp_path / "streams.json"
    cfg.write_text(json.dumps(CONFIG))  # vote_timeout_s 3: an eval_failed would come quickly
    env = {**stack_env, "AREAL_STREAMS_CONFIG": str(cfg)}
    worker = start_service("areal_metrics.streams", env, tmp_path / "worker.log")
    try:
        rank0 = start(RANK_ZERO_SCRIPT, child_env(stack_env, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"),
                      tmp_path / "rank0.log")
        assert rank0.wait(120) == 0, (tmp_path / "rank0.log").read_text()

        def consensus() -> list[dict]:
            return [json.loads(r.value) for r in read_to_end(kafka_bootstrap, topics.consensus)
                    if r.key == b"rank-zero-only"]

        [c] = wait_for(consensus, 60, "the consensus of rank 0's round")
        assert (c["votes"], c["replicas"], c["accuracy"], c["n_samples"], c["partial"]) == (1, 1, 0.75, 4, False)
        time.sleep(5)  # past vote_timeout_s (3 s) and a few ticks
        kinds = [json.loads(r.value)["kind"] for r in read_to_end(kafka_bootstrap, topics.alerts)
                 if r.key == b"rank-zero-only"]
        assert "eval_failed" not in kinds, kinds
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        stop_process(worker)


ROLLBACK_SCRIPT = """
    import json, sys, time
    import areal_metrics as am
    from areal_metrics.areal_train.control import apply_commands

    run = am.init(run_id="rollback")
    run.log({"reward": 0.8}, step=0)
    run.log_eval("math500", 0, verdicts=[1] * 100 + [0] * 28)  # 0.78 of 128: its interval lies above 0.5
    run.log({"reward": 0.1}, step=10)
    run.log_eval("math500", 10, verdicts=[1] * 10 + [0] * 118)  # 0.08 of 128: below 0.5
    commands, deadline = [], time.monotonic() + 90
    while not commands and time.monotonic() < deadline:
        commands = [c for c in run.commands() if c.command == "scale_lr"]
        time.sleep(0.2)
    applied = apply_commands(commands, scheduler=None)
    print(json.dumps({"args": [c.args for c in commands], "reasons": [c.reason for c in commands],
                      "lr_factor": applied.lr_factor, "restore_step": applied.restore_step}))
    run.finish()
"""


def test_a_drop_below_the_threshold_sends_the_trainer_the_weights_of_the_last_good_round(
    kafka_bootstrap: str, topics: Topics, stack_env: dict[str, str], tmp_path: Path
) -> None:
    from tests.kafka_reading import read_to_end
    from tests.support import child_env, start_service, stop_process
    from tests.test_client_broker import start

    cfg = tmp_path / "streams.json"
    loop = {"lr_eval_threshold": 0.5, "lr_rollback": True, "lr_factor": 0.1, "lr_min_factor": 0.01}
    cfg.write_text(json.dumps({"defaults": {**loop, "stall_seconds": 0}}))  # the worker's: no wait for the run's config
    env = {**stack_env, "AREAL_STREAMS_CONFIG": str(cfg)}
    worker = start_service("areal_metrics.streams", env, tmp_path / "worker.log")
    try:
        trainer = start(ROLLBACK_SCRIPT, child_env(stack_env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"),
                        tmp_path / "trainer.log")
        out, _ = trainer.communicate(timeout=150)
        assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()
        got = json.loads(out.strip().splitlines()[-1])
        seen = [(e["type"], e.get("step"), e.get("accuracy"), e.get("kind"), e.get("message") or e.get("reason"))
                for t in (topics.consensus, topics.alerts, topics.control, topics.deadletter)
                for e in map(json.loads, (r.value for r in read_to_end(kafka_bootstrap, t)))]
        assert got["args"] == [{"factor": 0.1, "from_step": 15, "restore_step": 0}], seen
        assert "weights of step 0 restored first" in got["reasons"][0]
        assert (got["lr_factor"], got["restore_step"]) == (0.1, 0)
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        stop_process(worker)


def stuck_grader_rounds(topics: Topics, run: str, rounds: int) -> tuple[list[Msg], list[float]]:
    """Two ranks at two replicas; rank 1's grader returns 0 for everything. Each round: 32 prompts x 4
    samples whose solve rates spread by prompt, rank 0 grading them honestly (about 0.28 right)."""
    import random

    rnd = random.Random(40)
    msgs = [Msg(topics.runs, run.encode(), line(type="run", event_id=f"{run}-r{r}", run_id=run, node=f"host-{r}",
                                                rank=r, status="running", world_size=2, config={}))
            for r in (0, 1)]
    honest = []
    for i in range(rounds):
        rates = [min(1.0, max(0.0, rnd.gauss(0.28, 0.2))) for _ in range(32)]
        truth = [int(rnd.random() < p) for p in rates for _ in range(4)]
        honest.append(sum(truth) / len(truth))
        for r, verdicts in ((0, truth), (1, [0] * len(truth))):
            msgs.append(Msg(topics.evals, run.encode(), line(
                type="eval", event_id=f"{run}-{i}-{r}", run_id=run, node=f"host-{r}", rank=r, eval_id=f"s{i}",
                step=10 * (i + 1), dataset="math500", stage="full", status="ok",
                accuracy=sum(verdicts) / len(verdicts), verdicts=verdicts, replicas=2,
                metrics={"samples_per_prompt": 4})))
    return msgs, honest


def test_a_stuck_grader_at_two_replicas_is_named_and_never_cuts_the_lr(
    kafka_bootstrap: str, topics: Topics, stack_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 40's case: rank 1's grader says 0 for everything, the honest accuracy is about 0.28, the
    loop watches a threshold of 0.2. Every sample rank 0 got right is a tie: undecided. The consensus
    interval covers the honest accuracy, no `scale_lr` is sent, and `vote_undecided` names both nodes."""
    cfg = tmp_path / "streams.json"
    loop = {"lr_eval_threshold": 0.2, "lr_rollback": True, "lr_factor": 0.1, "lr_min_factor": 0.01}
    cfg.write_text(json.dumps({**CONFIG, "defaults": {**CONFIG["defaults"], **loop}}))
    env = {**stack_env, "AREAL_STREAMS_CONFIG": str(cfg), "AREAL_STREAMS_SESSION_TIMEOUT": "6"}
    msgs, honest = stuck_grader_rounds(topics, "run-stuck", 3)
    produce(kafka_bootstrap, msgs)
    worker = Worker(env, tmp_path / "worker.log")
    reader = OutputReader(kafka_bootstrap, topics)
    worker.start()
    try:
        reader.wait_for({topics.consensus: 3, topics.alerts: 3}, timeout=90)
        reader.settle(4.0)  # anything the loop would send for the last round is out by now
    finally:
        rc = worker.stop()
        reader.close()
    assert rc == 0, (tmp_path / "worker.log").read_text()[-3000:]
    got = reader.distinct()
    rounds = sorted((c for c in got[topics.consensus].values() if c["run_id"] == "run-stuck"),
                    key=lambda c: c["step"])
    assert [c["step"] for c in rounds] == [10, 20, 30]
    for c, truth in zip(rounds, honest):
        assert 0.2 < truth < 0.36
        assert c["accuracy"] == 0.0 and c["n_undecided"] == round(truth * 128)  # the ties: rank 0 right, rank 1 not
        assert c["ci_low"] <= truth <= c["ci_high"], (c, truth)
        assert c["dissenters"] == [] and not c["partial"]
    commands = [e for e in got[topics.control].values() if e["run_id"] == "run-stuck"]
    assert [e["command"] for e in commands if e["command"] == "scale_lr"] == [], commands
    alerts = [a for a in got[topics.alerts].values() if a["run_id"] == "run-stuck"]
    assert sorted(a["kind"] for a in alerts) == ["vote_undecided"] * 3, alerts
    for a in alerts:
        assert a["severity"] == "warning" and "nodes host-0 and host-1 disagree" in a["message"]
        assert "two replicas cannot tell which one is wrong" in a["message"] and "third replica" in a["message"]

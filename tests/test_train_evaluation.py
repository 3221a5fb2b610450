"""Evaluation rounds without a broker: shards, replicas agreeing, two stages, failures, the process."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.areal_train.config import TrainConfig
from areal_metrics.areal_train.eval_process import make_pause, pause_for
from areal_metrics.areal_train.evalsets import EvalSet, covered, layout
from areal_metrics.areal_train.evaluation import (
    Outcome,
    RoundJob,
    StageMemory,
    TwoStage,
    evaluate_shard,
    maj_at_k,
    pass_at_k,
    run_round,
)
from areal_metrics.areal_train.evaluator import Evaluator
from areal_metrics.areal_train.policy import Policy
from areal_metrics.areal_train.session import build_eval_sets
from areal_metrics.areal_train.task import make_eval_set

CPU = torch.device("cpu")


def tiny_policy(seed: int = 0) -> Policy:
    torch.manual_seed(seed)
    return Policy(d_model=32, layers=2, heads=2).eval()


def small_set(n: int = 12, k: int = 3, name: str = "math_id") -> EvalSet:
    return EvalSet(name, tuple(make_eval_set(name, n)), k=k, attempt_len=8, seed=7)


# ---------------------------------------------------------------- layout


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 4), world=st.integers(1, 8), data=st.data())
def test_every_sample_is_evaluated_by_exactly_redundancy_ranks(n: int, k: int, world: int, data) -> None:
    redundancy = data.draw(st.integers(1, 8))
    shards = [layout(n, k, world, redundancy, rank) for rank in range(world)]
    counts = [0] * (n * k)
    for shard in shards:
        samples = covered(shard, k)
        assert not samples or samples[0] == shard.offset  # the window starts at its offset ...
        assert samples == [(shard.offset + i) % (n * k) for i in range(len(samples))]  # ... and is cyclic
        for s in samples:
            counts[s] += 1
    assert set(counts) <= {min(redundancy, world), 0}
    if n >= world:
        assert set(counts) == {min(redundancy, world)}


def test_sharding_halves_the_work_of_each_of_four_ranks() -> None:
    full = len(covered(layout(64, 4, 4, 4, 0), 4))
    sharded = [len(covered(layout(64, 4, 4, 2, r), 4)) for r in range(4)]
    assert full == 256 and sharded == [128, 128, 128, 128]


# ---------------------------------------------------------------- one shard


def test_replicas_of_a_sample_write_the_same_answer_whatever_their_shard() -> None:
    policy, evalset = tiny_policy(), small_set()
    per_sample: dict[int, set[int]] = {}
    for rank in range(4):
        shard = layout(len(evalset.problems), evalset.k, 4, 2, rank)
        result = evaluate_shard(policy, evalset, shard, CPU)
        assert len(result.verdicts) == len(covered(shard, evalset.k))
        assert result.metrics["shard_offset"] == shard.offset and result.metrics["shard_redundancy"] == 2
        for sample, verdict in zip(covered(shard, evalset.k), result.verdicts):
            per_sample.setdefault(sample, set()).add(verdict)
    assert all(len(v) == 1 for v in per_sample.values()) and len(per_sample) == evalset.n_samples


def test_pass_and_majority_at_k() -> None:
    assert pass_at_k([0, 0, 1, 0, 0, 0], 3) == 0.5
    assert maj_at_k([5, 5, 6, 7, None, 8], [5, 8], 3) == 0.5  # prompt 2: 7 and 8 tie, 7 came first
    assert maj_at_k([None, None, None], [1], 3) == 0.0


def test_error_counts_cover_every_wrong_sample() -> None:
    evalset = small_set()
    result = evaluate_shard(tiny_policy(), evalset, layout(12, 3, 1, 1, 0), CPU)
    wrong = sum(1 - v for v in result.verdicts)
    assert sum(v for k, v in result.metrics.items() if k.startswith("errors.")) == wrong
    assert len(result.samples) == 4 and {"prompt", "response", "verdict", "reward"} == set(result.samples[0])


# ------------------------------------------------------------ two stages


def test_the_quick_stage_calls_for_the_full_one_only_when_it_moved() -> None:
    rule = TwoStage(z=1.0, max_skipped=2)
    assert rule.decide(StageMemory(), 0.3, 64, None) == (True, "first full stage")
    memory = StageMemory(quick_at_full=0.30)
    run, why = rule.decide(memory, 0.32, 64, None)  # noise: sqrt(.31 * .69 / 64) = 0.058
    assert not run and "within noise 0.058" in why
    assert rule.decide(memory, 0.45, 64, None)[0]
    assert rule.decide(StageMemory(0.30, skipped=2), 0.30, 64, None) == (True, "full stage overdue (2 skipped in a row)")
    assert rule.decide(memory, 0.30, 64, "end of training") == (True, "end of training")
    assert TwoStage.remember(memory, 0.31, ran=False) == StageMemory(0.30, 1)
    assert TwoStage.remember(StageMemory(0.30, 1), 0.5, ran=True) == StageMemory(0.5, 0)


def round_outcomes(job: RoundJob, memory: dict | None = None, policy: Policy | None = None
                   ) -> tuple[list[Outcome], dict]:
    sets = {"math_id": small_set(), "math_hard": small_set(name="math_hard")}
    out: list[Outcome] = []
    memory = run_round(policy or tiny_policy(), sets, job, memory or {}, TwoStage(), out.append, CPU)
    return out, memory


def test_a_round_skips_the_full_stage_with_the_reason_and_runs_it_when_overdue() -> None:
    job = RoundJob(step=5, round_no=1, rank=0, world_size=2, quick_size=4)
    first, memory = round_outcomes(job)
    assert [(o.dataset, o.stage, o.status) for o in first] == [
        ("math_id", "quick", "ok"), ("math_id", "full", "ok"), ("math_hard", "quick", "ok"), ("math_hard", "full", "ok")]
    again, memory = round_outcomes(job, memory)  # the same weights: the quick stage did not move
    skipped = [o for o in again if o.stage == "full"]
    assert all(o.status == "skipped" and "within noise" in (o.error or "") for o in skipped)
    again, memory = round_outcomes(job, memory)
    again, memory = round_outcomes(job, memory)  # two skipped in a row: overdue
    assert [o.status for o in again if o.stage == "full"] == ["ok", "ok"]


def test_failures_injected_mismatched_and_dissenting() -> None:
    failed, _ = round_outcomes(RoundJob(step=5, round_no=3, rank=0, world_size=2, fail=True))
    assert {o.status for o in failed} == {"failed"} and "(round 3)" in (failed[0].error or "")
    mismatch = {"math_id": "dataset fingerprint mismatch on math_id: rank 0 holds a, rank 1 holds b"}
    outcomes, _ = round_outcomes(RoundJob(step=5, round_no=1, rank=0, world_size=2, mismatch=mismatch))
    assert [o.status for o in outcomes if o.dataset == "math_id"] == ["failed", "failed"]
    assert "fingerprint mismatch" in (outcomes[0].error or "")
    assert [o.status for o in outcomes if o.dataset == "math_hard"] == ["ok", "ok"]
    honest, memory_h = round_outcomes(RoundJob(step=5, round_no=1, rank=0, world_size=2))
    faulty, memory_f = round_outcomes(RoundJob(step=5, round_no=1, rank=1, world_size=2, dissent=True))
    assert honest[0].result.verdicts != faulty[0].result.verdicts
    assert memory_h == memory_f  # a faulty replica publishes wrong verdicts but decides like the others


# -------------------------------------------------------------- the process


def test_asynchronous_rounds_run_in_a_process_on_the_snapshot_and_skip_when_busy() -> None:
    policy, sets = tiny_policy(), {"math_id": small_set()}
    job = RoundJob(step=1, round_no=1, rank=0, world_size=1, two_stage=False)
    inline: list[Outcome] = []
    Evaluator(sets, inline.append, {"d_model": 32, "layers": 2, "heads": 2}, CPU).submit(policy, job)
    sent: list[Outcome] = []
    evaluator = Evaluator(sets, sent.append, {"d_model": 32, "layers": 2, "heads": 2}, CPU, asynchronous=True)
    try:
        evaluator.submit(policy, job)
        assert evaluator.busy()  # one round in the process: another would be skipped
        with torch.no_grad():  # training goes on and changes the weights meanwhile
            for p in policy.parameters():
                p.add_(torch.randn_like(p))
    finally:
        evaluator.close(timeout=300)
    assert [o.result.verdicts for o in sent] == [o.result.verdicts for o in inline]
    assert not evaluator.busy()


def test_a_run_with_no_scheduled_evaluation_starts_its_process_at_the_first_round_only() -> None:
    quiet = TrainConfig(eval_at_start=False, eval_at_end=False, eval_every_steps=None)
    assert not quiet.evaluates_on_schedule and TrainConfig().evaluates_on_schedule
    assert TrainConfig(eval_at_start=False, eval_at_end=False, eval_every_steps=None,
                       eval_every_seconds=60.0).evaluates_on_schedule
    policy, sets = tiny_policy(), {"math_id": small_set()}
    sent: list[Outcome] = []
    evaluator = Evaluator(sets, sent.append, {"d_model": 32, "layers": 2, "heads": 2}, CPU, asynchronous=True,
                          start_early=quiet.evaluates_on_schedule)
    try:
        assert evaluator._process is None  # no interpreter (torch and all) for rounds that may never come
        evaluator.submit(policy, RoundJob(step=1, round_no=1, rank=0, world_size=1, two_stage=False))  # evaluate_now
        assert evaluator._process is not None
    finally:
        evaluator.close(timeout=300)
    assert [(o.dataset, o.status) for o in sent] == [("math_id", "ok")]


def test_the_cpu_share_sets_the_pause() -> None:
    assert pause_for(0.2, 1.0) == 0.0
    assert pause_for(0.2, 0.5) == 0.2
    assert abs(pause_for(0.3, 0.25) - 0.9) < 1e-9


def test_the_end_of_training_ends_the_pause_at_once() -> None:
    import threading

    unthrottled = threading.Event()
    pausing = threading.Thread(target=make_pause(0.5, unthrottled), args=(300.0,), daemon=True)  # a 300 s pause
    pausing.start()
    pausing.join(0.2)
    assert pausing.is_alive()  # throttled while training goes on
    unthrottled.set()  # Evaluator.close(): training is over
    pausing.join(30)
    assert not pausing.is_alive()


def test_eval_sets_are_the_same_for_every_run_seed() -> None:
    a = build_eval_sets(TrainConfig(seed=1, eval_size=16))
    b = build_eval_sets(TrainConfig(seed=2, eval_size=16, max_turns=4))
    assert {n: s.fingerprint() for n, s in a.items()} == {n: s.fingerprint() for n, s in b.items()}


def test_the_stream_worker_votes_the_published_shards_back_into_the_whole_set(tmp_path) -> None:
    """Four ranks' events of one round, sent by the public client, through the worker's vote: the whole set's accuracy."""
    from areal_metrics.areal_train.reporting import Reporter, RunSpec
    from areal_metrics.producers.contract.events import EvalEvent
    from areal_metrics.streams.core.config import RunConfig
    from areal_metrics.streams.core.processor import RunState, on_eval
    from tests.train_capture import ClientCapture

    policy, evalset = tiny_policy(2), small_set(n=16, k=2)
    sets = {"math_id": evalset}
    capture = ClientCapture(tmp_path)
    for rank in range(4):
        run = capture.open_run(RunSpec("run-v", rank, 4, 0, f"node-{rank}", {}, (), None))
        job = RoundJob(step=3, round_no=1, rank=rank, world_size=4, redundancy=2, quick_size=8, force_full="test")
        run_round(policy, sets, job, {}, TwoStage(), Reporter(run, "run-v").evaluation, CPU)
        run.finish()
    events = [e for e in capture.events() if isinstance(e, EvalEvent)]
    whole = evaluate_shard(policy, evalset, layout(16, 2, 1, 1, 0), CPU)
    quick_whole = evaluate_shard(policy, evalset.head(8), layout(8, 2, 1, 1, 0), CPU)
    for stage, expected in (("full", whole.accuracy), ("quick", quick_whole.accuracy)):
        state, emitted = RunState("run-v"), []
        for event in (e for e in events if e.stage == stage):
            state, outputs = on_eval(state, event, 0.0, RunConfig())
            emitted += [o.event for o in outputs if o.event.type == "eval_consensus"]
        assert len(emitted) == 1 and emitted[0].accuracy == expected and emitted[0].agreement == 1.0, stage
        assert emitted[0].votes >= 3  # never decided by fewer than a strict majority of the four ranks
    full = [e for e in events if e.stage == "full"]
    assert [e.n_samples for e in full] == [16, 16, 16, 16]  # 2/4 of the 32 samples each
    assert {e.dataset_fingerprint for e in full} == {evalset.fingerprint()}  # the exact samples evaluated:
    assert {e.dataset_fingerprint for e in events if e.stage == "quick"} == {evalset.head(8).fingerprint()}


STANDBY_CHECK = """
import sys, torch
from areal_metrics.areal_train.eval_process import fork_standby
from areal_metrics.areal_train.evalsets import EvalSet
from areal_metrics.areal_train.evaluation import RoundJob
from areal_metrics.areal_train.evaluator import Evaluator
from areal_metrics.areal_train.policy import Policy
from areal_metrics.areal_train.task import make_eval_set

standby, unused = fork_standby(), fork_standby()  # as the worker does: before any thread starts
torch.manual_seed(0)
policy = Policy(d_model=32, layers=2, heads=2).eval()
sets = {"math_id": EvalSet("math_id", tuple(make_eval_set("math_id", 12)), k=3, attempt_len=8, seed=7)}
model, cpu, job = {"d_model": 32, "layers": 2, "heads": 2}, torch.device("cpu"), RoundJob(1, 1, 0, 1, two_stage=False)
inline, sent = [], []
Evaluator(sets, inline.append, model, cpu).submit(policy, job)
evaluator = Evaluator(sets, sent.append, model, cpu, asynchronous=True, standby=standby)
assert evaluator._process is standby.process  # used, not a spawned interpreter
evaluator.submit(policy, job)
evaluator.close(timeout=300)
assert [o.result.verdicts for o in sent] == [o.result.verdicts for o in inline], (sent, inline)
assert standby.process.exitcode == 0
assert standby.unthrottled.is_set()  # close() lifted the CPU share for the last rounds
idle = Evaluator(sets, sent.append, model, cpu, asynchronous=True, start_early=False, standby=unused)
idle.close()  # no round came: told to stop
assert unused.process.exitcode == 0, unused.process.exitcode
print("standby ok")
"""


def test_a_forked_standby_process_evaluates_as_inline_and_stops_when_unused() -> None:
    """In a fresh interpreter, as the worker forks it: before any thread of its own starts."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", STANDBY_CHECK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "standby ok" in done.stdout, done.stderr[-3000:]

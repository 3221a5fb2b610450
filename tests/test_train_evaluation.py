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
        assert list(result.sample_ids) == covered(shard, evalset.k) and result.replicas == 2
        assert not any(k.startswith("shard_") for k in result.metrics)  # no layout in metrics: the sample_ids say it
        for sample, verdict in zip(result.sample_ids, result.verdicts):
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
    assert result.samples and {"prompt", "response", "verdict", "reward", "gold", "error_type"} == set(result.samples[0])


# ------------------------------------------------------------ two stages


def test_the_quick_stage_calls_for_the_full_one_only_when_it_moved() -> None:
    rule = TwoStage(alpha=0.05, max_skipped=2)
    before = (0, 0, 0, 0) * 12  # 12 prompts (a skip needs gate.MIN_PROMPTS = 11), k = 4
    assert rule.decide(StageMemory(), before, 4, None) == (True, "first full stage")
    memory = StageMemory(verdicts_at_full=before)
    five_up = (1, 0, 0, 0) * 5 + (0, 0, 0, 0) * 7  # 5 prompts up, none down: p = 2/32 = 0.0625
    run, why = rule.decide(memory, five_up, 4, None)
    assert not run and "5 up, 0 down, p = 0.062" in why
    six_up = (1, 1, 0, 0) * 6 + (0, 0, 0, 0) * 6  # p = 2/64 = 0.031
    assert rule.decide(memory, six_up, 4, None)[0]
    mixed = (1, 0, 0, 0) * 4 + (0, 0, 0, 0) * 8  # the same prompts moving both ways would not count twice
    assert not rule.decide(StageMemory(mixed), (0, 0, 0, 0) * 2 + (1, 0, 0, 0) * 2 + (0, 0, 0, 0) * 8, 4, None)[0]
    # a drop the sign test misses (5 down, p = 0.0625) is not shown small: the full stage runs
    half = (1, 1, 0, 0) * 12
    run, why = rule.decide(StageMemory(half), (1, 0, 0, 0) * 5 + (1, 1, 0, 0) * 7, 4, None)
    assert run and "not shown to have dropped less than 0.15" in why
    assert rule.decide(StageMemory(before), (0, 0, 0, 0) * 10, 4, None) == (True, "first full stage")  # another size
    assert rule.decide(StageMemory(before, skipped=2), before, 4, None) == (
        True, "full stage overdue (2 skipped in a row)")
    assert rule.decide(memory, before, 4, "end of training") == (True, "end of training")
    assert TwoStage.remember(memory, six_up, ran=False) == StageMemory(before, 1)
    assert TwoStage.remember(StageMemory(before, 1), six_up, ran=True) == StageMemory(six_up, 0)


def round_outcomes(job: RoundJob, memory: dict | None = None, policy: Policy | None = None
                   ) -> tuple[list[Outcome], dict]:
    sets = {"math_id": small_set(), "math_hard": small_set(name="math_hard")}
    out: list[Outcome] = []
    memory = run_round(policy or tiny_policy(), sets, job, memory or {}, TwoStage(), out.append, CPU)
    return out, memory


def test_a_round_skips_the_full_stage_with_the_reason_and_runs_it_when_overdue() -> None:
    job = RoundJob(step=5, round_no=1, rank=0, world_size=2, quick_size=12)  # a skip needs 11 quick prompts
    first, memory = round_outcomes(job)
    assert [(o.dataset, o.stage, o.status) for o in first] == [
        ("math_id", "quick", "ok"), ("math_id", "full", "ok"), ("math_hard", "quick", "ok"), ("math_hard", "full", "ok")]
    again, memory = round_outcomes(job, memory)  # the same weights: the quick stage did not move
    skipped = [o for o in again if o.stage == "full"]
    assert all(o.status == "skipped" and "did not move" in (o.error or "") for o in skipped)
    again, memory = round_outcomes(job, memory)
    again, memory = round_outcomes(job, memory)
    again, memory = round_outcomes(job, memory)  # three skipped in a row: overdue
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


def _published_round(tmp_path, world: int, redundancy: int | None, dissent_rank: int | None,
                     board=None) -> tuple[list, "EvalSet", Policy]:
    """`world` ranks' events of one round, sent by the public client (ranks in threads when they
    exchange verdicts on `board`)."""
    import threading

    from areal_metrics.areal_train.reporting import Reporter, RunSpec
    from areal_metrics.producers.contract.events import EvalEvent
    from tests.train_capture import ClientCapture

    policy, evalset = tiny_policy(2), small_set(n=16, k=2)
    capture = ClientCapture(tmp_path)

    def rank_round(rank: int) -> None:
        run = capture.open_run(RunSpec("run-v", rank, world, 0, f"node-{rank}", {}, (), None))
        job = RoundJob(step=3, round_no=1, rank=rank, world_size=world, redundancy=redundancy, quick_size=8,
                       force_full="test", dissent=rank == dissent_rank)
        run_round(policy, {"math_id": evalset}, job, {}, TwoStage(), Reporter(run, "run-v").evaluation, CPU,
                  board=board)
        run.finish()

    threads = [threading.Thread(target=rank_round, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return [e for e in capture.events() if isinstance(e, EvalEvent)], evalset, policy


def _vote(events: list) -> tuple[dict[int, int], dict[str, int]]:
    """The contract's per-sample vote over the events' (sample_ids, verdicts): the decided verdicts, and
    per node how many of its verdicts a strict majority outvoted."""
    from areal_metrics.producers.contract.statistics import node_majority

    decided = node_majority([dict(zip(e.sample_ids, e.verdicts)) for e in events])
    outvoted = {e.node: sum(decided.get(s, v) != v for s, v in zip(e.sample_ids, e.verdicts)) for e in events}
    return decided, outvoted


def test_four_ranks_default_to_three_replicas_and_outvote_a_faulty_one(tmp_path) -> None:
    """The published shards, voted per sample as the contract says: the whole set's honest verdicts,
    and only the faulty node outvoted."""
    events, evalset, policy = _published_round(tmp_path, 4, None, dissent_rank=1)
    honest = evaluate_shard(policy, evalset, layout(16, 2, 1, 1, 0), CPU)
    full = [e for e in events if e.stage == "full"]
    assert {(e.replicas, e.shard_nodes) for e in full} == {(3, 4)}
    assert [e.n_samples for e in full] == [24, 24, 24, 24]  # 3/4 of the 32 samples each
    assert not any(k.startswith("shard_") for e in full for k in e.metrics)
    counts = [0] * 32
    for e in full:
        for sample in e.sample_ids:
            counts[sample] += 1
    assert set(counts) == {3}
    decided, outvoted = _vote(full)
    assert [decided[s] for s in range(32)] == list(honest.verdicts)
    assert {n for n, c in outvoted.items() if c} == {"node-1"}
    quick = [e for e in events if e.stage == "quick"]
    assert {(e.replicas, e.shard_nodes) for e in quick} == {(4, 4)}
    assert {e.dataset_fingerprint for e in full} == {evalset.fingerprint()}
    assert {e.dataset_fingerprint for e in quick} == {evalset.head(8).fingerprint()}


def test_two_replicas_get_a_third_on_disputed_samples_before_the_round_closes(tmp_path) -> None:
    from areal_metrics.areal_train.board import MemoryBoard

    events, evalset, policy = _published_round(tmp_path, 4, 2, dissent_rank=1, board=MemoryBoard())
    honest = evaluate_shard(policy, evalset, layout(16, 2, 1, 1, 0), CPU)
    full = sorted((e for e in events if e.stage == "full"), key=lambda e: e.rank)
    assert {(e.replicas, e.shard_nodes) for e in full} == {(2, 4)}
    decided, outvoted = _vote(full)
    assert [decided.get(s) for s in range(32)] == list(honest.verdicts)  # no tie left: every sample decided
    assert {n for n, c in outvoted.items() if c} == {"node-1"}
    # node-1 holds blocks 1 and 2, so its flips are disputed there; ranks 3 and 0 adjudicate those blocks
    extra = [len(e.sample_ids) - 16 for e in full]
    assert extra[1] == extra[2] == 0 and extra[3] > 0 and extra[0] > 0


def test_two_replicas_without_a_board_leave_disputes_undecided(tmp_path) -> None:
    """What adjudication is for: without it, a faulty replica's flips are ties."""
    events, evalset, policy = _published_round(tmp_path, 4, 2, dissent_rank=1)
    decided, outvoted = _vote([e for e in events if e.stage == "full"])
    assert len(decided) < 32 and not any(outvoted.values())


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


def test_a_multi_turn_set_keeps_the_first_attempt_verdicts_and_says_what_later_turns_solve() -> None:
    from dataclasses import replace as with_

    policy, one = tiny_policy(4), small_set(n=16, k=2)
    four = with_(one, turns=4)
    assert four.fingerprint() == one.fingerprint()  # the same samples: strategies stay comparable
    shard = layout(16, 2, 1, 1, 0)
    single, multi = evaluate_shard(policy, one, shard, CPU), evaluate_shard(policy, four, shard, CPU)
    assert multi.verdicts == single.verdicts and multi.samples == single.samples
    assert multi.metrics["first_attempt_accuracy"] == single.accuracy == multi.accuracy
    assert "solved_within_4_turns" in multi.metrics and "solved_within_1_turns" not in single.metrics
    assert multi.metrics["solved_within_4_turns"] >= multi.metrics["first_attempt_accuracy"]
    from areal_metrics.areal_train.evaluation import generate

    answers = generate(policy, four, list(range(32)), CPU)
    assert all(a.solved_turn in (None, 1, 2, 3, 4) for a in answers.values())
    assert all((a.solved_turn == 1) == bool(a.verdict) for a in answers.values())
    later = sum(1 for a in answers.values() if a.solved_turn and a.solved_turn > 1)
    assert multi.metrics["solved_within_4_turns"] == (sum(single.verdicts) + later) / 32


def test_eval_turns_default_to_the_strategy_and_can_be_capped() -> None:
    import pytest

    from areal_metrics.areal_train.config import ConfigError

    assert {s.turns for s in build_eval_sets(TrainConfig(eval_size=8, quick_size=4, max_turns=4)).values()} == {4}
    capped = build_eval_sets(TrainConfig(eval_size=8, quick_size=4, max_turns=4, eval_turns=1))
    assert {s.turns for s in capped.values()} == {1}
    with pytest.raises(ConfigError, match="eval_turns"):
        TrainConfig(eval_turns=0)

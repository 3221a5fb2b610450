"""The trainer in one process: it learns, it reports every step, and a resumed run continues exactly.

A small policy and a short warm start (cached in a temporary directory for
this module) keep these tests to about a minute on two busy cores.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_metrics.areal_train.config import TrainConfig
from areal_metrics.areal_train.evalsets import layout
from areal_metrics.areal_train.evaluation import evaluate_shard
from areal_metrics.areal_train.metrics import choose_device
from areal_metrics.areal_train.session import build_eval_sets
from areal_metrics.areal_train.trainer import train
from areal_metrics.areal_train.warmstart import load, spec_for
from areal_metrics.areal_train.reporting import RecordedRun
from areal_metrics.producers.contract.events import CommandEvent, EvalEvent, RunEvent, StepEvent
from tests.train_capture import ClientCapture

SMALL = dict(d_model=64, layers=2, heads=2, warmstart_steps=0, eval_size=16, quick_size=8, eval_samples=2,
             publish=False, checkpoint_every_steps=None)


@pytest.fixture(scope="module")
def warmstarts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The warm starts' cache of these tests: train() takes it (the entry point reads AREAL_CACHE_DIR)."""
    return tmp_path_factory.mktemp("warmstarts")


def steps_of(events: list) -> list[StepEvent]:
    return [e for e in events if isinstance(e, StepEvent)]


def test_ppo_raises_the_rate_of_rewarded_answers() -> None:
    """The update itself: reward one kind of answer (the bare answer, no scratchpad) and it spreads."""
    from areal_metrics.areal_train import ppo
    from areal_metrics.areal_train.episodes import rollout
    from areal_metrics.areal_train.policy import Policy
    from areal_metrics.areal_train.task import VOCAB_SIZE, make_eval_set

    torch.manual_seed(0)
    policy = Policy(d_model=32, layers=2, heads=2)
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    problems = [p for p in make_eval_set("math_id", 4) for _ in range(8)]
    noise = torch.Generator().manual_seed(1)
    rates = []
    for _ in range(40):
        policy.eval()
        episodes = rollout(policy, problems, attempt_len=4, noise=torch.rand(32, 5, VOCAB_SIZE, generator=noise))
        reward = torch.tensor([float(a[0][0] == "#") for a in episodes.attempts])
        rates.append(float(reward.mean()))
        advantage, _ = ppo.advantages(episodes, reward, 8, "grpo", policy, 1.0, 1.0)
        policy.train()
        ppo.update(policy, optimizer, episodes, advantage, None, None, ppo.PPOSettings(), None)
    assert sum(rates[:5]) / 5 < 0.15 and sum(rates[-5:]) / 5 > 0.5, rates


def test_the_warm_start_learns_the_answer_format() -> None:
    from areal_metrics.areal_train.warmstart import WarmStartSpec, build

    _, info = build(WarmStartSpec(d_model=32, layers=1, heads=2, steps=60, batch=16), log=False)
    assert info["loss_last"] < 0.8 * info["loss_first"], info


def test_every_step_reports_the_metrics_and_cpu_memory(tmp_path) -> None:
    capture = ClientCapture(tmp_path / "journals")
    cfg = TrainConfig(**{**SMALL, "warmstart_steps": 0}, seed=1, eval_at_start=False, eval_every_steps=None,
                      eval_at_end=False, advantage="gae", max_turns=2, checkpoint_dir=str(tmp_path))
    train(cfg, "metrics", steps=4, open_run=capture.open_run)
    events = capture.events()
    steps = steps_of(events)
    assert [e.step for e in steps] == [1, 2, 3, 4] and not [e for e in events if isinstance(e, EvalEvent)]
    for e in steps:
        for name in ("reward", "reward_std", "entropy", "advantage_mean", "advantage_std", "kl", "clip_ratio",
                     "loss", "lr", "grad_norm", "response_length", "tokens", "throughput", "latency_ms"):
            assert getattr(e, name) is not None, name
        assert e.world_size == 1 and e.n_samples == cfg.batch_prompts * cfg.group_size and e.attempt == 0
        assert e.tokens > 0 and e.throughput > 0 and e.entropy > 0 and 0 < e.epoch < 1
        assert e.metrics["eval_interval"] == 0.0 and 1.0 <= e.metrics["attempts_mean"] <= 2.0
        if torch.cuda.is_available():  # CUDA: max allocated, in the contract field too
            assert e.gpu_mem_bytes is not None and e.gpu_mem_bytes == e.metrics["mem_bytes"] > 0
            assert e.metrics["cuda"] == 1.0
        else:  # CPU: the process RSS
            assert e.gpu_mem_bytes is None and e.metrics["mem_bytes"] > 10e6
    assert steps[-1].clip_ratio > 0 or steps[-1].kl > 0  # the second minibatch is off the sampling policy
    runs = [e for e in events if isinstance(e, RunEvent)]
    assert [r.status for r in runs] == ["running", "finished"] and runs[0].config["strategy"] == "mt2-gae"
    assert torch.get_num_threads() == 1


def test_the_first_evaluation_sees_the_warm_start(tmp_path, warmstarts: Path) -> None:
    capture = ClientCapture(tmp_path / "journals")
    cfg = TrainConfig(**{**SMALL, "warmstart_steps": 20}, seed=5, eval_every_steps=None, eval_every_epochs=1, train_size=64, batch_prompts=16,
                      two_stage=False, eval_at_end=False, lr=0.01, checkpoint_dir=str(tmp_path))
    summary = train(cfg, "start", steps=8, open_run=capture.open_run, warmstarts=warmstarts)
    events = capture.events()
    assert summary.eval_steps == [0, 4, 8]  # before training, then after each epoch of 64 / 16 = 4 steps
    device = choose_device()
    evalset = build_eval_sets(cfg)["math_id"]
    shard = layout(len(evalset.problems), evalset.k, 1, 2, 0)
    expected = evaluate_shard(load(spec_for(cfg), device, cache=warmstarts).eval(), evalset, shard, device).verdicts
    full = {e.step: e for e in events if isinstance(e, EvalEvent) and e.dataset == "math_id"}
    assert full[0].verdicts == expected and full[0].dataset_fingerprint == evalset.fingerprint()
    assert full[8].samples != full[0].samples  # a large lr moved the weights by step 8
    assert {e.step for e in events if isinstance(e, EvalEvent) and e.status == "ok"} == {0, 4, 8}
    assert {"pass@2", "maj@2", "errors.carry"} <= set(full[0].metrics)


def test_a_resumed_run_continues_exactly_where_an_uninterrupted_one_goes(tmp_path) -> None:
    common = dict(**SMALL, seed=3, eval_every_steps=3, max_turns=2, checkpoint_dir=str(tmp_path))
    whole, cut_run = ClientCapture(tmp_path / "whole"), ClientCapture(tmp_path / "cut")
    train(TrainConfig(**common), "whole", steps=9, open_run=whole.open_run)
    first = train(TrainConfig(**{**common, "checkpoint_every_steps": 3}), "cut", steps=5, open_run=cut_run.open_run)
    assert first.attempt == 0 and first.steps == 5
    resumed = train(TrainConfig(**common), "cut", steps=9, open_run=cut_run.open_run, resume=True)
    cut = cut_run.events()
    assert resumed.attempt == 1 and resumed.start_step == 5
    steps = steps_of(cut)
    assert [(e.step, e.attempt) for e in steps] == [(s, 0) for s in range(1, 6)] + [(s, 1) for s in range(6, 10)]
    expected = {e.step: e for e in steps_of(whole.events())}
    for e in steps:
        assert math.isclose(e.reward, expected[e.step].reward) and math.isclose(e.loss, expected[e.step].loss,
                                                                                 rel_tol=1e-5), e.step
    evals = {(e.step, e.dataset, e.stage): e for e in cut if isinstance(e, EvalEvent)}
    assert {s for s, _, _ in evals} == {0, 3, 5, 6, 9}  # 5: the end of the first attempt; then every 3 steps on
    assert all(e.attempt == (1 if e.step > 5 else 0) for e in evals.values())
    runs = [(e.status, e.attempt) for e in cut if isinstance(e, RunEvent)]
    assert runs == [("running", 0), ("finished", 0), ("running", 1), ("finished", 1)]


class CommandedRun(RecordedRun):
    """A run whose control feed hands over `arriving[i]` at the i-th call (rank 0 calls once per step)."""

    def __init__(self, arriving: list[list[CommandEvent]]) -> None:
        super().__init__()
        self.arriving = arriving

    def commands(self) -> list[CommandEvent]:
        return self.arriving.pop(0) if self.arriving else []


class ControlTopic:
    """The run's control topic as the client reads it: commands in the order sent, each with its time; a run's
    `commands(since=)` reads from there (else from the run's start), and each run hands a command over once."""

    def __init__(self) -> None:
        self.sent: list[CommandEvent] = []

    def run(self, die_at_call: int | None = None) -> RecordedRun:
        topic = self

        class Attempt(RecordedRun):
            def __init__(self) -> None:
                super().__init__()
                self.started = self.commands_since = time.time()
                self.calls, self.given, self.acks = 0, set(), []

            def commands(self, *, since: float | None = None) -> list[CommandEvent]:
                self.calls += 1
                if die_at_call is not None and self.calls >= die_at_call:
                    raise RuntimeError("the attempt dies here, before its next checkpoint")
                start = min(self.commands_since, since) if since is not None else self.commands_since
                out = [c for c in topic.sent if c.ts >= start and c.event_id not in self.given]
                self.given |= {c.event_id for c in out}
                return out

            def acknowledge(self, command: CommandEvent, status: str, **fields: Any) -> None:
                self.acks.append((command.command, status, fields.get("step")))

        return Attempt()


def test_a_resumed_attempt_applies_the_commands_that_came_after_its_checkpoint(tmp_path) -> None:
    """Attempt 0 checkpoints at step 3, then gets a scale_lr (applied at step 5) and a stop, and dies at step 6
    before its next checkpoint. Attempt 1 resumes from step 3 and reads the control topic from the first
    attempt's start (kept in the checkpoint): the scale_lr applies again from its step (its lr went with the
    crash), the stop sent to the attempt before it is acknowledged as ignored, and training goes on. Before,
    the resumed feed read from its own start: the command was lost, the lr back at x1 for good."""
    topic = ControlTopic()
    cfg = TrainConfig(**{**SMALL, "checkpoint_every_steps": 3}, seed=2, eval_at_start=False, eval_every_steps=None,
                      eval_at_end=False, checkpoint_dir=str(tmp_path))
    first = topic.run(die_at_call=6)

    def sending(spec: object) -> RecordedRun:
        return first

    original = first.commands

    def commands_then_send(**kwargs: Any) -> list[CommandEvent]:
        if first.calls == 3:  # read after step 4, past the checkpoint at step 3
            topic.sent.append(CommandEvent(run_id="rs", command="scale_lr", args={"factor": 0.5, "from_step": 4}))
        got = original(**kwargs)
        if first.calls == 5:  # sent after step 5; the attempt dies before it reads it
            topic.sent.append(CommandEvent(run_id="rs", command="stop", args={}))
        return got

    first.commands = commands_then_send  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="dies here"):
        train(cfg, "rs", steps=8, open_run=sending)
    assert [s.values["lr_scale"] for s in first.steps] == [1.0, 1.0, 1.0, 1.0, 0.5, 0.5]
    time.sleep(0.01)
    second = topic.run()
    summary = train(cfg, "rs", steps=8, open_run=lambda spec: second, resume=True)
    assert summary.attempt == 1 and summary.start_step == 3 and summary.steps == 8  # the stop not obeyed
    assert [(s.step, s.values["lr_scale"]) for s in second.steps] == [(4, 1.0), (5, 0.5), (6, 0.5), (7, 0.5),
                                                                       (8, 0.5)]
    assert sorted(a[:2] for a in second.acks) == [("scale_lr", "applied"), ("stop", "ignored")]


def test_scale_lr_applies_from_its_step_boundary_and_stops_at_the_floor(tmp_path) -> None:
    halve = [CommandEvent(run_id="lr", command="scale_lr", args={"factor": 0.5, "from_step": 3}) for _ in range(8)]
    now = [CommandEvent(run_id="lr", command="scale_lr", args={"factor": 0.5})]
    run = CommandedRun([halve, now])  # after step 1: eight halvings for step 3's boundary; after step 2: one now
    cfg = TrainConfig(**SMALL, seed=2, eval_at_start=False, eval_every_steps=None, eval_at_end=False,
                      lr_min_scale=1 / 16, checkpoint_dir=str(tmp_path))
    train(cfg, "lr", steps=5, open_run=lambda spec: run)
    scales = [s.values["lr_scale"] for s in run.steps]
    assert scales == [1.0, 1.0, 0.5, 1 / 16, 1 / 16]  # 1/512 asked for, the floor kept
    assert [s.values["lr"] for s in run.steps] == [cfg.lr * x for x in scales]


def test_a_scale_lr_with_restore_step_puts_back_the_weights_that_round_measured(tmp_path) -> None:
    """After step 3: a rollback to step 2 and an evaluation. The round at step 3 reads what the round at
    step 2 read, while the same run without the rollback reads its trained weights (an entropy bonus
    moves the untrained weights whatever the reward). A step the trainer did not keep is not restored."""
    def run_with(restore_step: int | None) -> CommandedRun:
        args: dict = {"factor": 0.5} if restore_step is None else {"factor": 0.5, "restore_step": restore_step}
        commands = [CommandEvent(run_id="rb", command="scale_lr", args=args), CommandEvent(run_id="rb", command="evaluate_now")]
        run = CommandedRun([[], [], commands])
        cfg = TrainConfig(**SMALL, seed=4, rl_parameters=".", lr=0.05, entropy_coef=0.5, eval_every_steps=2, eval_at_end=False,
                          two_stage=False, checkpoint_dir=str(tmp_path))
        train(cfg, "rb", steps=4, open_run=lambda spec: run)
        return run

    def verdicts(run: CommandedRun, step: int) -> list:  # what the round read: its samples' responses
        return [[s["response"] for s in e["samples"]] for e in run.evals if e["step"] == step and e["dataset"] == "math_id"]

    rolled, plain, unknown = run_with(2), run_with(None), run_with(1)
    assert verdicts(rolled, 2) == verdicts(plain, 2) and verdicts(rolled, 3) == verdicts(rolled, 2)
    assert verdicts(plain, 3) != verdicts(plain, 2)  # step 3's training moved what the round reads
    assert [s.values["weights_restored"] for s in rolled.steps] == [0, 0, 0, 1]
    assert verdicts(unknown, 3) == verdicts(plain, 3)
    assert [s.values["weights_restored"] for s in unknown.steps] == [0, 0, 0, 0]
    assert [s.values["lr_scale"] for s in rolled.steps] == [1.0, 1.0, 1.0, 0.5]


def test_weights_restored_are_evaluated_at_once_in_a_full_round(tmp_path) -> None:
    """No evaluate_now: the rollback after step 3 makes a round at step 3 by itself (rounds every 2 steps
    otherwise), of the restored weights: it reads what the round at step 2 read. A factor alone, or a
    restore of weights the trainer did not keep, makes none."""
    def run_with(restore_step: int | None) -> CommandedRun:
        args: dict = {"factor": 0.5} if restore_step is None else {"factor": 0.5, "restore_step": restore_step}
        run = CommandedRun([[], [], [CommandEvent(run_id="rb", command="scale_lr", args=args)]])
        cfg = TrainConfig(**SMALL, seed=4, rl_parameters=".", lr=0.05, entropy_coef=0.5, eval_every_steps=2,
                          eval_at_end=False, two_stage=True, checkpoint_dir=str(tmp_path))
        train(cfg, "rb", steps=4, open_run=lambda spec: run)
        return run

    def full_rounds(run: CommandedRun) -> dict[int, list]:
        return {e["step"]: [s["response"] for s in e["samples"]] for e in run.evals
                if e["dataset"] == "math_id" and e["stage"] == "full"}

    rolled, plain, unknown = full_rounds(run_with(2)), full_rounds(run_with(None)), full_rounds(run_with(1))
    assert 3 in rolled and rolled[3] == rolled[2]
    assert 3 not in plain and 3 not in unknown


def test_an_async_run_with_no_scheduled_evaluation_starts_its_process_at_evaluate_now(tmp_path, monkeypatch) -> None:
    from areal_metrics.areal_train.evaluator import Evaluator

    run = CommandedRun([[], [CommandEvent(run_id="quiet", command="evaluate_now")]])  # after step 2
    started_after: list[int] = []  # steps logged when the evaluation process was started
    ensure = Evaluator._ensure_process

    def spy(self: Evaluator) -> None:
        if self._process is None:
            started_after.append(len(run.steps))
        ensure(self)

    monkeypatch.setattr(Evaluator, "_ensure_process", spy)
    cfg = TrainConfig(**SMALL, seed=3, eval_mode="async", eval_at_start=False, eval_every_steps=None,
                      eval_at_end=False, two_stage=False, checkpoint_dir=str(tmp_path))
    assert not cfg.evaluates_on_schedule
    train(cfg, "quiet", steps=4, open_run=lambda spec: run)
    assert started_after == [2]  # not at the start: only for the round the command asked for
    assert {e["step"] for e in run.evals} == {2} and {e["status"] for e in run.evals} == {"ok"}


def test_rl_updates_only_the_parameters_its_config_names_and_a_pattern_naming_none_is_refused() -> None:
    import pytest
    import torch

    from areal_metrics.areal_train.policy import Policy
    from areal_metrics.areal_train.session import rl_parameters
    from areal_metrics.producers.contract.errors import ConfigError

    torch.manual_seed(0)
    policy = Policy(32, 1, 2)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    optimizer = torch.optim.Adam(rl_parameters(policy, "ln_final"), lr=0.1)
    ids = torch.randint(5, 20, (3, 7))
    policy.logits(policy(ids, torch.ones_like(ids, dtype=torch.bool))).logsumexp(-1).sum().backward()
    optimizer.step()
    changed = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"ln_final.weight", "ln_final.bias"}
    assert all(p.grad is None for n, p in policy.named_parameters() if not n.startswith("ln_final"))
    assert len(rl_parameters(policy, ".")) == len(list(policy.parameters()))  # "." trains every weight
    with pytest.raises(ConfigError, match="rl_parameters: 'nothing_here' names no parameter"):
        rl_parameters(policy, "nothing_here")


def test_no_folder_for_the_checkpoints_is_said_before_training_not_at_the_first_checkpoint(tmp_path) -> None:
    cfg = TrainConfig(**{**SMALL, "checkpoint_every_steps": 50})  # no checkpoint_dir, and no home given
    capture = ClientCapture(tmp_path / "journals")
    with pytest.raises(ValueError, match="checkpoint_dir: the config names no folder"):
        train(cfg, "nowhere", steps=60, open_run=capture.open_run)
    assert capture.events() == []  # nothing ran: no run event, no step

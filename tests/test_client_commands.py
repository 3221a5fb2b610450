"""`CommandApplier` on real torch optimizers and schedulers (no broker): the lr of a command's steps is the
factor times the same run's schedule without it, for every scheduler type; the bounds; rollback from kept
weights; the flags; resume from its state; two gloo ranks applying a command at the same step (the records
broadcast as they are); a `sync=` hook that carries the commands' JSON form."""

from __future__ import annotations

import copy
import json
import os
import pickle
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as sch

import areal_metrics as am
from areal_metrics.producers.client.trainer_control import CommandApplier, due, from_step
from areal_metrics.producers.client import trainer_control
from areal_metrics.producers.contract.events import CommandEvent, event_from_dict
from areal_metrics.producers.contract.field_rules import ValidationError

STEPS = 14


class Feed:
    """What a trainer's run gives the applier: `commands()` (the run's control feed drained) and
    `acknowledge(...)`; here the commands are handed in at chosen calls."""

    def __init__(self, plan: dict[int, list[CommandEvent]] | None = None, node: str = "host:0") -> None:
        self.plan = plan or {}
        self.node = node
        self.calls = 0
        self.every_node: list[bool] = []  # how each call asked
        self.acks: list[tuple[str, str, int, float, str | None]] = []

    def commands(self, *, every_node: bool = False) -> list[CommandEvent]:
        """As the run's feed: this node's commands, or with `every_node` all of them."""
        out = self.plan.get(self.calls, [])
        self.calls += 1
        self.every_node.append(every_node)
        return out if every_node else [c for c in out if c.target_node in (None, self.node)]

    def acknowledge(self, command: CommandEvent, status: str, *, step: int, lr_factor: float,
                    detail: str | None) -> None:
        self.acks.append((command.command, status, step, lr_factor, detail))


def command(name: str, **args: object) -> CommandEvent:
    return CommandEvent(run_id="r1", node="worker", command=name, args=args)


def model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    # two groups with their own lrs: each must be scaled
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-2},
                             {"params": model[2].parameters(), "lr": 3e-3}], lr=1e-2)
    return model, opt


def linear_warmup(opt: torch.optim.Optimizer) -> sch.LRScheduler:
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=STEPS)


SCHEDULES: dict[str, Callable[[torch.optim.Optimizer], object]] = {
    "hf_linear_warmup_LambdaLR": linear_warmup,
    "StepLR": lambda opt: sch.StepLR(opt, step_size=3, gamma=0.7),
    "CosineAnnealingLR_eta_min": lambda opt: sch.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-4),
    "SequentialLR": lambda opt: sch.SequentialLR(
        opt, [sch.LinearLR(opt, start_factor=0.2, total_iters=4), sch.CosineAnnealingLR(opt, T_max=10, eta_min=5e-4)],
        milestones=[4]),
    "ChainedScheduler": lambda opt: sch.ChainedScheduler(
        [sch.ConstantLR(opt, factor=0.5, total_iters=5), sch.ExponentialLR(opt, gamma=0.9)]),
    "OneCycleLR": lambda opt: sch.OneCycleLR(opt, max_lr=[2e-2, 6e-3], total_steps=STEPS + 1),
    "no_scheduler": lambda opt: None,
}


def train(schedule: str, feed: Feed | None, steps: range = range(1, STEPS + 1), state: dict | None = None,
          **applier_kwargs: Any) -> tuple[dict[int, list[float]], CommandApplier, dict]:
    """A loop that logs at step s the lrs update s used; returns them, the applier and a checkpoint."""
    model, opt = model_and_optimizer()
    scheduler = SCHEDULES[schedule](opt)
    control = CommandApplier(feed, opt, scheduler, model=model, **applier_kwargs)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        control.load_state_dict(state["control"])
    gen = torch.Generator().manual_seed(1)
    lrs: dict[int, list[float]] = {}
    for step in steps:
        control.at_step(step)
        x = torch.randn(16, 4, generator=gen)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        lrs[step] = [g["lr"] for g in opt.param_groups]
        opt.step()
        if scheduler is not None:
            scheduler.step()
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                                "control": control.state_dict()})
    return lrs, control, checkpoint


def assert_scaled(lrs: dict[int, list[float]], base: dict[int, list[float]], factors: Callable[[int], float]) -> None:
    for step, values in base.items():
        want = [factors(step) * v for v in values]
        assert lrs[step] == pytest.approx(want, rel=1e-9, abs=0), (step, lrs[step], want)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_lr_is_the_factor_times_the_schedule_from_the_commands_step_on(schedule: str) -> None:
    base, _, _ = train(schedule, None)
    assert len({tuple(v) for v in base.values()}) > (1 if schedule != "no_scheduler" else 0)  # a schedule moves
    feed = Feed({2: [command("scale_lr", factor=0.5, from_step=6)]})  # arrives at step 3, waits for 6
    lrs, control, _ = train(schedule, feed)
    assert_scaled(lrs, base, lambda s: 0.5 if s >= 6 else 1.0)
    assert control.factor == 0.5
    assert feed.acks == [("scale_lr", "applied", 6, 0.5, None)]


def test_two_commands_compose_and_the_factor_stays_within_its_bounds() -> None:
    base, _, _ = train("hf_linear_warmup_LambdaLR", None)
    feed = Feed({1: [command("scale_lr", factor=0.5, from_step=4)], 5: [command("scale_lr", factor=0.5)],
                 7: [command("scale_lr", factor=0.5)], 9: [command("scale_lr", factor=100.0)]})
    lrs, control, _ = train("hf_linear_warmup_LambdaLR", feed, lr_min_factor=0.3)

    def factor(s: int) -> float:
        return 1.0 if s < 4 else 0.5 if s < 6 else 0.3 if s < 10 else 1.0

    assert_scaled(lrs, base, factor)
    assert [(a[0], a[1], a[2], a[3]) for a in feed.acks] == [
        ("scale_lr", "applied", 4, 0.5), ("scale_lr", "applied", 6, 0.3), ("scale_lr", "applied", 8, 0.3),
        ("scale_lr", "applied", 10, 1.0)]
    assert "kept at 0.3" in feed.acks[1][4] and "kept at 1" in feed.acks[3][4]
    assert control.factor == 1.0


def test_a_resumed_attempt_neither_applies_a_command_again_nor_forgets_one_waiting() -> None:
    first, second = command("scale_lr", factor=0.5, from_step=3), command("scale_lr", factor=0.5, from_step=11)
    base, _, _ = train("hf_linear_warmup_LambdaLR", None)
    whole, _, _ = train("hf_linear_warmup_LambdaLR", Feed({0: [first, second]}))
    # interrupted after step 7 (the first applied, the second waiting), resumed from that checkpoint; the
    # resumed attempt's feed hands the first command over again (a feed reading from an earlier offset)
    before, _, saved = train("hf_linear_warmup_LambdaLR", Feed({0: [first, second]}), steps=range(1, 8))
    feed = Feed({0: [first]})
    after, control, _ = train("hf_linear_warmup_LambdaLR", feed, steps=range(8, STEPS + 1), state=saved)
    assert {**before, **after} == whole
    assert_scaled(whole, base, lambda s: 1.0 if s < 3 else 0.5 if s < 11 else 0.25)
    assert feed.acks == [("scale_lr", "applied", 11, 0.25, None)]  # only the one that waited
    assert control.state_dict()["applied"] == [first.event_id, second.event_id]


def test_an_attempt_resumed_after_a_stop_goes_on_and_does_not_obey_it_again() -> None:
    from tests.support import logger_warnings

    stop = command("stop")
    _, opt = model_and_optimizer()
    stopped = CommandApplier(Feed({0: [stop]}), opt)
    assert stopped.at_step(4).stop
    saved = stopped.state_dict()  # the checkpoint saved as the attempt stopped
    resumed = CommandApplier(Feed({0: [stop]}), opt)  # its feed hands the stop over again
    with logger_warnings(trainer_control.log) as said:
        resumed.load_state_dict(saved)
    due_now = resumed.at_step(5)
    assert not due_now.stop and due_now.applied == [] and resumed.state_dict()["applied"] == [stop.event_id]
    assert ["had stopped on a `stop` command; this attempt goes on" in r.getMessage() for r in said] == [True]


def test_keeping_the_weights_never_raises_into_the_loop() -> None:
    """An optimizer whose state_dict() is not torch's shape (no "state": Megatron's distributed one)."""
    from tests.support import logger_warnings

    class Unusual:
        param_groups = [{"lr": 0.1, "params": []}]

        def state_dict(self) -> dict[str, Any]:
            return {"optimizer": {}}

    model, _ = model_and_optimizer()
    control = CommandApplier(Feed({}), Unusual(), model=model, keep_rounds=2)
    with logger_warnings(trainer_control.log) as said:
        control.keep(3)
    assert control.kept == {} and ["weights of step 3 not kept" in r.getMessage() for r in said] == [True]


def test_a_rollback_puts_back_the_kept_weights_and_optimizer_state_and_keeps_the_lower_lr() -> None:
    model, opt = model_and_optimizer()
    scheduler = linear_warmup(opt)
    feed = Feed({6: [command("scale_lr", factor=0.5, restore_step=4)]})
    control = CommandApplier(feed, opt, scheduler, model=model, keep_rounds=2)
    gen = torch.Generator().manual_seed(3)
    kept: dict[int, tuple[dict, dict]] = {}
    for step in range(1, 10):
        due_now = control.at_step(step)
        if step == 7:
            assert due_now.restored_step == 4
            for name, value in model.state_dict().items():
                assert torch.equal(value, kept[4][0][name]), name
            for index, value in opt.state_dict()["state"].items():
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(value[key], kept[4][1][index][key])
            # the lower lr stays: half the schedule's value at its 6th step (linear decay: 8/11)
            assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5 * 1e-2 * 8 / 11, 0.5 * 3e-3 * 8 / 11])
        x = torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        scheduler.step()
        if step % 2 == 0:  # an evaluated round
            control.keep(step)
            kept[step] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["state"]))
        if step == 7:
            assert sorted(control.kept) == [4, 6]
    assert feed.acks[0][:4] == ("scale_lr", "applied", 7, 0.5) and feed.acks[0][4] == "weights of step 4 restored"


def test_weights_not_kept_give_the_factor_alone_and_say_why_and_a_restore_callback_is_asked() -> None:
    model, opt = model_and_optimizer()
    feed = Feed({0: [command("scale_lr", factor=0.5, restore_step=2)]})
    control = CommandApplier(feed, opt, model=model, keep_rounds=1)
    control.at_step(1)
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert feed.acks[0][1] == "applied" and "factor alone: the weights of step 2 were not kept" in feed.acks[0][4]
    asked: list[int] = []
    feed2 = Feed({0: [command("scale_lr", factor=0.5, restore_step=2)]})
    control2 = CommandApplier(feed2, opt, restore=lambda s: asked.append(s) or True)
    assert control2.at_step(3).restored_step == 2 and asked == [2]


def test_evaluate_now_interval_and_stop_are_flags_and_ignored_commands_say_why() -> None:
    _, opt = model_and_optimizer()
    feed = Feed({0: [command("set_eval_interval", steps=7), command("evaluate_now")], 1: [command("stop")]})
    control = CommandApplier(feed, opt, ignore={"evaluate_now": "this loop evaluates on its schedule only"})
    first = control.at_step(0)
    assert (first.evaluate, first.stop, first.eval_interval) == (False, False, 7)
    assert control.eval_interval(50) == 7
    second = control.at_step(1)
    assert second.stop and not control.at_step(2).evaluate and control.at_step(3).stop
    assert [(a[0], a[1], a[4]) for a in feed.acks] == [
        ("set_eval_interval", "applied", None), ("evaluate_now", "ignored", "this loop evaluates on its schedule only"),
        ("stop", "applied", None)]
    feed3 = Feed({0: [command("evaluate_now")]})
    assert CommandApplier(feed3, opt).at_step(5).evaluate


def test_the_pure_step_rule_is_the_reference_trainers() -> None:
    from areal_metrics.areal_train import control

    assert control.due is due and control.from_step is from_step
    assert from_step(command("scale_lr", factor=0.5, from_step=4)) == 4 and from_step(command("stop")) == 0


def test_the_applier_is_public_and_importing_the_client_imports_no_torch(tmp_path: Path) -> None:
    assert am.CommandApplier is CommandApplier
    import subprocess

    code = ("import sys, areal_metrics as am; am.CommandApplier; "
            "import areal_metrics.producers.client.run; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


# ---------------------------------------------------------------- two ranks


def two_ranks(rank_main: Callable[[int, int, str], None], out: Path) -> None:
    """`rank_main(rank, port, out)` in two spawned processes, a gloo group on a free loopback port."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(rank_main, args=(port, str(out)), nprocs=2, join=True)


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    received: list[list[Any]] = []
    broadcast = dist.broadcast_object_list

    def spy(holder: list[Any], src: int = 0, **kw: Any) -> None:  # what crosses between the ranks
        broadcast(holder, src=src, **kw)
        received.append(list(holder[0]))

    setattr(dist, "broadcast_object_list", spy)  # in this process only (a spawned rank)
    model, opt = model_and_optimizer()
    scheduler = linear_warmup(opt)
    # the commands reach rank 0 at its 5th call, one of them naming rank 1's node; rank 1 passes its own
    # run (it reads nothing: rank 0 reads for it), to acknowledge what it does
    stop_one = CommandEvent(run_id="r1", node="worker", command="stop", target_node="host:1")
    plan = {4: [command("scale_lr", factor=0.25), stop_one], 6: [command("evaluate_now")]} if rank == 0 else {}
    feed = Feed(plan, node=f"host:{rank}")
    control = CommandApplier(feed, opt, scheduler)
    record = []
    for step in range(1, 10):
        d = control.at_step(step)
        record.append([step, d.lr_factor, d.evaluate, opt.param_groups[0]["lr"]])
        opt.step()
        scheduler.step()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    Path(out, f"acks{rank}.json").write_text(json.dumps([feed.acks, feed.calls, feed.every_node]))
    Path(out, f"received{rank}.pkl").write_bytes(pickle.dumps(received))
    dist.destroy_process_group()


def test_two_gloo_ranks_apply_a_command_at_the_same_step(tmp_path: Path) -> None:
    two_ranks(_rank, tmp_path)
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert zero == one
    assert [r[1] for r in zero] == [1.0] * 4 + [0.25] * 5  # applied before update 5 on both
    assert [r[0] for r in zero if r[2]] == [7]
    # what rank 1 received is rank 0's records themselves (no dicts), equal field for field
    sent, got = (pickle.loads((tmp_path / f"received{r}.pkl").read_bytes()) for r in range(2))
    assert got == sent and len(got) == 9 and [len(g) for g in got] == [0, 0, 0, 0, 2, 0, 1, 0, 0]
    assert all(type(c) is CommandEvent for g in got for c in g)
    assert [c.command for g in got for c in g] == ["scale_lr", "stop", "evaluate_now"]
    # the stop named rank 1's node: rank 0 read it for rank 1 (every node's commands), neither rank stopped
    # (one rank cannot leave a lockstep loop), and rank 1 alone acknowledged it as ignored, saying why
    (acks0, calls0, every0), (acks1, calls1, _) = (json.loads((tmp_path / f"acks{r}.json").read_text())
                                                   for r in range(2))
    assert calls0 == 9 and set(every0) == {True} and calls1 == 0
    assert [a[:3] for a in acks0] == [["scale_lr", "applied", 5], ["evaluate_now", "applied", 7]]
    assert [a[:3] for a in acks1] == [["scale_lr", "applied", 5], ["stop", "ignored", 5],
                                      ["evaluate_now", "applied", 7]]
    assert "without target_node 'host:1'" in acks1[1][4]


def _restore_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model, opt = model_and_optimizer()
    rollback = command("scale_lr", factor=0.5, restore_step=2)
    feed = Feed({1: [rollback], 3: [command("scale_lr", factor=1.0, restore_step=4)]} if rank == 0 else {},
                node=f"host:{rank}")
    control = CommandApplier(feed, opt, model=model, keep_rounds=3)
    restored = []
    for step in range(1, 6):
        if step in (2, 4) and (step == 4 or rank == 0):  # step 2's weights kept on rank 0 alone, step 4's on both
            control.keep(step)
        restored.append(control.at_step(step).restored_step)
    Path(out, f"restored{rank}.json").write_text(json.dumps([restored, feed.acks]))
    dist.destroy_process_group()


def test_ranks_that_disagree_on_a_restore_all_say_so_and_none_counts_it_restored(tmp_path: Path) -> None:
    """Each rank restores from its own snapshot: one that kept the weights and one that did not would part ways
    (one evaluating restored weights waits in a collective the other never joins). The ranks compare what
    they did: where they disagree, none counts as restored and each acknowledgement names every rank's
    outcome; where they agree, both report the restore."""
    two_ranks(_restore_rank, tmp_path)
    (zero, acks0), (one, acks1) = (json.loads((tmp_path / f"restored{r}.json").read_text()) for r in range(2))
    assert zero == one == [None, None, None, 4, None]  # step 2: disagreed (before: 2 on rank 0 alone); step 4: both
    for acks in (acks0, acks1):
        assert "the ranks disagree on the restored weights (rank 0: step 2, rank 1: not restored)" in acks[0][4]
        assert "weights of step 4 restored" in acks[1][4]


class ResumedFeed(Feed):
    """Rank 0's run in a resumed attempt: it started at `started`, and reads the control topic again from
    `since` when asked (the commands given as sent before then)."""

    def __init__(self, plan: dict[int, list[CommandEvent]], started: float) -> None:
        super().__init__(plan, node="host:0")
        self.started = self.commands_since = started

    def commands(self, *, every_node: bool = False, since: float | None = None) -> list[CommandEvent]:
        return super().commands(every_node=every_node)


def _resumed_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model, opt = model_and_optimizer()
    old_stop = CommandEvent(run_id="r1", node="worker", command="stop", ts=500.0)  # sent to the attempt before
    rollback = command("scale_lr", factor=0.5, restore_step=2)

    def restore(step: int) -> bool:
        if rank == 1:
            raise OSError("the checkpoint is not on this node")
        return True

    # rank 0 reads (its run started at 1000); rank 1 has no run (TRL's other ranks): it decides nothing itself.
    # `done` was applied before the checkpoint; rank 1's node kept no applier state (HF's save_on_each_node
    # without the callback's file there): its factor is the schedule's, its handled ids none
    done = CommandEvent(run_id="r1", node="worker", command="scale_lr", args={"factor": 0.5}, ts=400.0)
    feed = ResumedFeed({0: [old_stop, done], 2: [rollback]}, started=1000.0) if rank == 0 else None
    control = CommandApplier(feed, opt, model=model, restore=restore)
    control.load_state_dict({"factor": 0.5, "applied": [done.event_id] if rank == 0 else [], "commands_since": 100.0})
    record = []
    for step in range(1, 5):
        due_now = control.at_step(step)
        record.append([due_now.stop, due_now.restored_step, due_now.lr_factor])
    Path(out, f"resumed{rank}.json").write_text(json.dumps([record, feed.acks if feed else []]))
    dist.destroy_process_group()


def test_a_resumed_loops_ranks_agree_on_an_old_stop_and_on_a_restore_that_raises(tmp_path: Path) -> None:
    """Two gloo ranks of a resumed attempt, rank 1 without a run (as TRL's other ranks). A `stop` sent to the
    attempt before, and a command the checkpoint had handled, are dropped where they are read, before the ranks
    get them: neither stops, neither applies the old command again (before: rank 1, which has no start time to
    judge the stop by, nor the handled ids where its node kept no state, obeyed both and the ranks parted). A restore that raises on rank 1 still
    reaches the ranks' comparison: no hang, and neither counts it restored."""
    two_ranks(_resumed_rank, tmp_path)
    (zero, acks), (one, _) = (json.loads((tmp_path / f"resumed{r}.json").read_text()) for r in range(2))
    # the command handled before the checkpoint, read again by rank 0, is not handed to rank 1 (which would
    # apply it again: x0.25, then x0.125 after the rollback)
    assert zero == one == [[False, None, 0.5], [False, None, 0.5], [False, None, 0.25], [False, None, 0.25]]
    assert [a[:2] for a in acks] == [["stop", "ignored"], ["scale_lr", "applied"]]
    assert "rank 0: step 2, rank 1: not restored" in acks[1][4]


def test_a_command_record_pickles_equal_and_is_checked_again_as_it_is_unpickled() -> None:
    """What the applier's broadcast (and the reference trainer's `Control`) carries between ranks."""
    records = [command("scale_lr", factor=0.5, from_step=7, restore_step=3), command("stop"),
               CommandEvent(run_id="r1", node="worker", target_node="n0", command="set_eval_interval",
                            args={"steps": 5}, reason="the reward moves fast")]
    back = pickle.loads(pickle.dumps(records))
    assert back == records and all(type(c) is CommandEvent for c in back)
    rebuild, (cls, fields) = records[0].__reduce__()

    class Tampered:  # a pickle whose record breaks the contract (a factor out of range)
        def __reduce__(self) -> tuple[Any, ...]:
            return rebuild, (cls, {**fields, "args": {"factor": 500}})

    with pytest.raises(ValidationError, match=r"commands.args.factor: must be a number in \(0, 100\]"):
        pickle.loads(pickle.dumps(Tampered()))


def test_a_sync_hook_carries_the_commands_json_form_as_before() -> None:
    """`sync=` (another transport than torch.distributed) gets rank 0's commands as `to_dict()` dicts and may
    return dicts (e.g. through JSON) or the records; either way the same commands apply."""
    sent: list[list[Any]] = []

    def through_json(mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
        sent.append(mine)
        return json.loads(json.dumps(mine))

    scale, stop = command("scale_lr", factor=0.5, from_step=2), command("stop")
    _, opt = model_and_optimizer()
    control = CommandApplier(Feed({0: [scale], 1: [stop]}), opt, sync=through_json)
    first, second = control.at_step(1), control.at_step(2)
    assert sent[0] == [scale.to_dict()] and all(type(c) is dict for m in sent for c in m)
    assert first.applied == [] and second.applied == [scale, stop] and second.lr_factor == 0.5 and second.stop
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5e-2)
    as_records = CommandApplier(Feed({0: [scale]}), opt,
                                sync=lambda mine: [event_from_dict(c, CommandEvent) for c in mine])
    assert as_records.at_step(2).applied == [scale]

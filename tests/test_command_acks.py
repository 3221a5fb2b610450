"""Trainers acknowledge commands; the worker says when one went nowhere.

Pure (no broker): the rules of streams/core/acks.py through the processor. Against the real broker,
stream worker and sink: three runs get the worker's `scale_lr` (an evaluation below the threshold);
one never applies it (`command_not_applied`), one applies it through `CommandApplier` (an ack, no
alert; `v_command_status` names the node, its step and factor), one ignores it (`command_ignored`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from areal_metrics.producers.contract.events import CommandAckEvent, StepEvent
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.streams.core.acks import AckState, on_sent
from areal_metrics.streams.core.config import RunConfig, StreamsConfig
from areal_metrics.streams.core.processor import RunState, on_command_ack, on_step
from areal_metrics.streams.__main__ import load_config
from tests import test_client_broker
from tests.support import start_service, stop_process, wait_for

sink = test_client_broker.sink

CFG = RunConfig(command_ack_steps=3)


def watched(from_step: int = 15, target: str | None = None) -> RunState:
    acks = on_sent(AckState(), "cmd-1", "scale_lr", {"factor": 0.5, "from_step": from_step}, 0, target)
    return RunState(run_id="r", acks=acks)


def step(state: RunState, node: str, n: int, attempt: int = 0) -> list:
    state, out = on_step(state, StepEvent(run_id="r", node=node, step=n, epoch=0, attempt=attempt), 0.0, CFG)
    return [(o.event.kind, o.event.step) for o in out if o.event.type == "alert"], state


def ack(state: RunState, node: str, status: str = "applied", detail: str = "") -> tuple[RunState, list]:
    ev = CommandAckEvent(run_id="r", node=node, command_id="cmd-1", command="scale_lr", status=status, step=15,
                         lr_factor=0.5, detail=detail)
    state, out = on_command_ack(state, ev, 0.0, CFG)
    return state, [(o.event.kind, o.event.severity, o.event.message) for o in out]


def test_a_node_that_does_not_acknowledge_is_named_once_the_ack_steps_have_passed() -> None:
    state = watched()
    for n in (10, 15, 17):
        alerts, state = step(state, "a", n)
        assert alerts == []
    alerts, state = step(state, "a", 18)  # from_step 15 + 3
    assert alerts == [("command_not_applied", 18)]
    assert step(state, "a", 19)[0] == []  # once per command and node
    assert step(state, "b", 30)[0] == [("command_not_applied", 30)]  # another node, its own


def test_an_acknowledged_command_raises_nothing_and_an_ignored_one_is_an_info_alert() -> None:
    state, alerts = ack(watched(), "a")
    assert alerts == []
    assert step(state, "a", 40)[0] == []
    state, alerts = ack(state, "b", "ignored", "the trainer has no optimizer")
    assert [(k, s) for k, s, _ in alerts] == [("command_ignored", "info")]
    assert "the trainer has no optimizer" in alerts[0][2]
    assert ack(state, "b", "ignored", "again")[1] == []  # once
    assert step(state, "b", 40)[0] == []  # it answered: not "not applied"


def test_a_targeted_command_waits_for_its_node_and_an_older_attempt_does_not_count() -> None:
    state = watched(target="a")
    assert step(state, "b", 40)[0] == []
    assert step(state, "a", 40)[0] == [("command_not_applied", 40)]
    sent_in_attempt_1 = RunState(run_id="r", acks=on_sent(AckState(), "c", "scale_lr", {"factor": 0.5}, 1))
    assert step(sent_in_attempt_1, "a", 40, attempt=0)[0] == []


def test_the_ack_steps_come_from_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_COMMAND_ACK_STEPS", "7")
    assert load_config().defaults.command_ack_steps == 7
    assert StreamsConfig.load().defaults.command_ack_steps == RunConfig().command_ack_steps  # the core reads no environment
    monkeypatch.setenv("AREAL_COMMAND_ACK_STEPS", "-1")
    with pytest.raises(Exception, match="AREAL_COMMAND_ACK_STEPS"):
        load_config()


# ---------------------------------------------------------------- the real broker, worker and sink


def _train_until_the_command(run, applier, first: int, last: int, sink, wait_ack: bool) -> None:
    """Steps `first..last`; the worker's scale_lr taken off the feed before the first (the applier's at_step
    applies it at its from_step); with `wait_ack`, the ack stored before the steps after it are logged."""
    commands, deadline = [], time.monotonic() + 120
    while not commands and time.monotonic() < deadline:
        commands = [c for c in run.commands() if c.command == "scale_lr"]
        time.sleep(0.2)
    assert commands, f"no scale_lr for {run.run_id}"
    if applier is not None:
        applier.submit(commands)
    for n in range(first, last + 1):
        if applier is not None:
            applier.at_step(n)
        run.log({"reward": 0.1}, step=n)
        if wait_ack and n == commands[0].args["from_step"]:
            wait_for(lambda: sink(f"SELECT count() FROM v_command_acks WHERE run_id = '{run.run_id}'") == [(1,)],
                     120, "the acknowledgement stored")


@pytest.mark.broker
@pytest.mark.timeout(600)
def test_a_command_nobody_applies_raises_command_not_applied_and_an_applied_one_does_not(
        stack_env: dict[str, str], topics: Topics, tmp_path: Path, sink, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import areal_metrics as am

    cfg = tmp_path / "streams.json"
    cfg.write_text(json.dumps({"defaults": {"lr_eval_threshold": 0.5, "lr_factor": 0.5, "stall_seconds": 0}}))
    worker = start_service("areal_metrics.streams",
                           {**stack_env, "AREAL_STREAMS_CONFIG": str(cfg), "AREAL_COMMAND_ACK_STEPS": "3"},
                           tmp_path / "worker.log")
    for name, value in stack_env.items():
        if name.startswith("AREAL_"):
            monkeypatch.setenv(name, value)
    try:
        runs = {name: am.init(run_id=name, world_size=1, git=False) for name in ("ack-none", "ack-applied", "ack-ignored")}
        for run in runs.values():
            run.log({"reward": 0.8}, step=0)
            run.log_eval("math500", 0, verdicts=[1] * 100 + [0] * 28)  # 0.78 of 128: above 0.5
            run.log({"reward": 0.1}, step=10)
            run.log_eval("math500", 10, verdicts=[1] * 10 + [0] * 118)  # 0.08: below -> scale_lr from step 15
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        applied = am.CommandApplier(runs["ack-applied"], optimizer)
        ignored = am.CommandApplier(runs["ack-ignored"], optimizer,
                                    ignore={"scale_lr": "this trainer's lr is fixed by its launcher"})
        _train_until_the_command(runs["ack-none"], None, 11, 22, sink, wait_ack=False)
        _train_until_the_command(runs["ack-applied"], applied, 11, 22, sink, wait_ack=True)
        _train_until_the_command(runs["ack-ignored"], ignored, 11, 22, sink, wait_ack=True)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05) and applied.factor == 0.5

        node = runs["ack-none"].node
        alert_sql = ("SELECT run_id, kind, severity, step FROM v_alerts WHERE kind IN "
                     "('command_not_applied', 'command_ignored') ORDER BY run_id")
        wait_for(lambda: len(sink(alert_sql)) >= 2, 120, "the two alerts")
        # every run's last step went through the worker (its smoothed reward), so a late alert would be here too
        wait_for(lambda: sink("SELECT count() FROM v_rewards_smoothed WHERE step = 22") == [(3,)], 120,
                 "every run's step 22 through the worker")
        time.sleep(2)  # the alerts of those batches (another topic) stored as well
        assert sink(alert_sql) == [("ack-ignored", "command_ignored", "info", 15),
                                   ("ack-none", "command_not_applied", "warning", 18)]
        status = sink("SELECT run_id, command, applied_nodes, applied, ignored_nodes, ignored FROM v_command_status "
                      "ORDER BY run_id")
        assert [(r[0], r[1]) for r in status] == [("ack-applied", "scale_lr"), ("ack-ignored", "scale_lr"),
                                                  ("ack-none", "scale_lr")]
        by_run = {r[0]: r for r in status}
        assert by_run["ack-applied"][2] == [node] and [a[:3] for a in by_run["ack-applied"][3]] == [(node, 15, 0.5)]
        assert by_run["ack-ignored"][4] == [node]
        assert by_run["ack-ignored"][5] == [(node, 15, "this trainer's lr is fixed by its launcher")]
        assert by_run["ack-none"][2:] == ([], [], [], [])
        for run in runs.values():
            run.finish()
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        stop_process(worker)


def test_migration_8_adds_the_acks_table_and_the_status_view_to_an_older_store(tmp_path: Path) -> None:
    from areal_metrics.producers.contract.events import CommandEvent
    from areal_metrics.sinks.schema import SCHEMA_VERSION, SchemaOptions
    from areal_metrics.sinks.step_means import drop_statements
    from areal_metrics.sinks.migrations import applied_version, apply_schema
    from areal_metrics.sinks.query import Target, open_client
    from areal_metrics.sinks.rows import Located
    from areal_metrics.sinks.writer import insert_rows

    client = open_client(Target.parse(f"chdb://{tmp_path / 'store'}"), readonly=False, use_database=False)
    try:
        apply_schema(client)
        client.command("DROP VIEW areal.v_command_status")
        client.command("DROP VIEW areal.v_command_acks")
        client.command("DROP TABLE areal.command_acks SYNC")
        for stmt in drop_statements(SchemaOptions()):  # and migration 9's objects: a store of schema 7
            client.command(stmt)
        client.command("ALTER TABLE areal.schema_migrations DELETE WHERE version >= 8 SETTINGS mutations_sync = 1")
        assert applied_version(client) == 7
        assert apply_schema(client) == SCHEMA_VERSION and apply_schema(client) == SCHEMA_VERSION
        sent = CommandEvent(run_id="r1", node="worker", command="scale_lr", args={"factor": 0.5, "from_step": 4})
        insert_rows(client, "areal", [Located(sent, "areal.control", 0, 0)], "t1")
        acks = [CommandAckEvent(run_id="r1", node=n, command_id=sent.event_id, command="scale_lr", status=s, step=4,
                                lr_factor=0.5 if s == "applied" else 1.0, detail=d)
                for n, s, d in (("n1", "applied", ""), ("n2", "ignored", "no optimizer"))]
        insert_rows(client, "areal", [Located(a, "areal.acks", 0, i) for i, a in enumerate(acks)], "t2")
        insert_rows(client, "areal", [Located(acks[0], "areal.acks", 0, 0)], "t3")  # redelivered: counted once
        rows = client.query("SELECT command_id, applied_nodes, arrayMap(a -> (a.1, a.2, a.3), applied), ignored_nodes, "
                            "ignored FROM areal.v_command_status").result_rows
        assert rows == [(sent.event_id, ["n1"], [("n1", 4, 0.5)], ["n2"], [("n2", 4, "no optimizer")])]
    finally:
        client.close()

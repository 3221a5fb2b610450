"""W&B's habits (issue 44, item 6) and no silent loss past the key cap (item 3).

- A W&B-shaped script (`import areal_metrics as wandb`; init with notes, log, alert, summary,
  finish; system metrics on) runs unchanged against the real broker: its steps, its alert of
  kind `user` on the alerts topic, and its end event with notes and summary are on Kafka.
- `AREAL_MODE=disabled` (and `init(mode="disabled")`): nothing sent (no topic made), no journal
  or state file written, no thread started; every call of a run works.
- Past AREAL_MAX_METRICS a step keeps the first names; `log` warns once and counts the rest in
  `stats().skipped`.
- The system-metrics sampler hands each sample to one step only, and the names are W&B's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from areal_metrics.producers.contract.events import parse_event
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.stack.kafka_broker import free_port
from tests.kafka_reading import read_to_end
from tests.support import ROOT, client_warnings

WANDB_SCRIPT = """
import areal_metrics as wandb

run = wandb.init(run_id="wandb-shaped", config={"lr": 1e-5, "model": "tiny"}, tags=["grpo"], group="sweep-1",
                 name="my first run", notes="trying a smaller lr")
for step in range(6):
    if step == 5:  # the last step waits for a system sample, so that one surely lands in a step
        while run._sampler._latest is None:
            import time; time.sleep(0.01)
    wandb.log({"reward": 0.1 * step, "my/score": 1.0 / (step + 1)})
    if step >= 3:  # the same title again within wait_duration: sent once
        wandb.alert(title="reward is low", text=f"reward {0.1 * step:.1f} < 0.5", level=wandb.AlertLevel.WARN)
wandb.run.summary["best_reward"] = 0.5
wandb.summary["final_loss"] = 1 / 6
wandb.finish()
assert wandb.run is None
print("stats", run.stats().steps, run.stats().failed)
"""


@pytest.mark.broker
@pytest.mark.timeout(300)
def test_a_wandb_shaped_script_runs_unchanged(stack_env: dict[str, str], topics: Topics, kafka_bootstrap: str) -> None:
    env = {**stack_env, "AREAL_SYSTEM_METRICS_S": "0.05"}
    out = subprocess.run([sys.executable, "-c", WANDB_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["stats", "6", "0"], out.stdout

    steps = [parse_event(m.value) for m in read_to_end(kafka_bootstrap, topics.steps)]
    assert [s.step for s in steps] == list(range(6))
    assert [s.reward for s in steps] == pytest.approx([0.1 * i for i in range(6)])
    assert steps[2].metrics["my/score"] == pytest.approx(1 / 3)
    sampled = [s.metrics for s in steps if "system/cpu" in s.metrics]
    assert sampled and all(0 <= m["system/cpu"] <= 100 and 0 < m["system/memory"] < 100
                           and m["system/proc.memory.rssMB"] > 1 for m in sampled)

    alerts = [parse_event(m.value) for m in read_to_end(kafka_bootstrap, topics.alerts)]
    assert [(a.kind, a.severity, a.message, a.step) for a in alerts] == [
        ("user", "warning", "reward is low: reward 0.3 < 0.5", 3)]

    runs = [parse_event(m.value) for m in read_to_end(kafka_bootstrap, topics.runs)]
    assert [r.status for r in runs] == ["running", "finished"]
    assert {r.notes for r in runs} == {"trying a smaller lr"} and runs[0].name == "my first run"
    assert runs[0].summary is None
    assert runs[1].summary == {"best_reward": 0.5, "final_loss": pytest.approx(1 / 6)}
    assert runs[1].config == {"lr": 1e-5, "model": "tiny"} and runs[1].group == "sweep-1"


DISABLED_SCRIPT = """
import os, threading, sys
import areal_metrics as am

before = {t.name for t in threading.enumerate()}
if sys.argv[1] == "argument":
    run = am.init(run_id="disabled-run", config={"a": 1}, notes="n", mode="disabled", system_metrics_s=0.01)
else:
    run = am.init(run_id="disabled-run", config={"a": 1}, notes="n")
assert am.run is run and type(run).__name__ == "DisabledRun", run
for step in range(50):
    am.log({"reward": 0.5, "loss": float("nan")}, step=step)
    run.log_eval("math500", step, verdicts=[1, 0, 1])
am.alert("t", "x", level="ERROR")
run.summary["best"] = 1.0
assert run.commands() == []
with run:
    pass
am.finish()
assert am.run is None
print(sorted({t.name for t in threading.enumerate()} - before), run.stats().steps, run.stats().sent)
"""


@pytest.mark.broker
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["environment", "argument"])
def test_disabled_mode_sends_nothing_writes_nothing_and_starts_no_thread(how: str, stack_env: dict[str, str],
                                                                          topics: Topics, kafka_bootstrap: str,
                                                                          tmp_path: Path) -> None:
    from kafka import KafkaAdminClient

    home = tmp_path / "home"
    env = {**stack_env, "AREAL_HOME": str(home), "AREAL_SYSTEM_METRICS_S": "0.01"}
    if how == "environment":
        env["AREAL_MODE"] = "disabled"
    out = subprocess.run([sys.executable, "-c", DISABLED_SCRIPT, how], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["[]", "50", "0"], out.stdout
    assert out.stderr == ""  # not even the generated run id line: nothing was started
    assert not home.exists() or list(home.rglob("*")) == []  # no journal, no attempt record
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        ours = [t for t in admin.list_topics() if t.startswith(topics.prefix)]  # made by the fixture
    finally:
        admin.close()
    assert topics.steps in ours and read_to_end(kafka_bootstrap, *ours) == []  # nothing was sent anywhere


def test_the_disabled_run_has_every_public_call_of_a_run() -> None:
    from areal_metrics.producers.client.run import DisabledRun, Run

    public = {name for name in dir(Run) if not name.startswith("_")}
    assert public - set(dir(DisabledRun)) == set()


def test_past_the_key_cap_log_warns_once_and_counts_what_it_dropped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from areal_metrics.producers.client.run import init

    monkeypatch.setenv("AREAL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AREAL_MAX_METRICS", "10")
    with client_warnings() as logged:
        run = init(run_id="capped", kafka_bootstrap=f"127.0.0.1:{free_port()}", journal_dir=str(tmp_path / "j"),
                   git=False, rank=0, world_size=1, exit_timeout_s=0.5)
        for step in range(3):
            run.log({"reward": 0.5, **{f"k{i:02d}": float(i) for i in range(25)}}, step=step)
        run.log({"reward": 0.5, "ok": 1.0}, step=3)
        run.finish()
    assert run.stats().skipped == 3 * 15
    told = [r.getMessage() for r in logged if "AREAL_MAX_METRICS" in r.getMessage()]
    assert len(told) == 1 and "more than 10 metrics names" in told[0], told
    kept = [json.loads(line) for line in _journal_lines(tmp_path / "j") if b'"type":"step"' in line]
    assert [sorted(s["metrics"]) for s in kept[:3]] == [[f"k{i:02d}" for i in range(10)]] * 3  # the first logged
    assert all(s["reward"] == 0.5 for s in kept) and kept[3]["metrics"] == {"ok": 1.0}


def _journal_lines(folder: Path) -> list[bytes]:
    from areal_metrics.producers.delivery.journal import open_journal

    journal = open_journal(folder)
    try:
        return [r.value for r in journal.read(10_000)]
    finally:
        journal.close()


def test_the_default_cap_is_what_readers_accept() -> None:
    from areal_metrics.producers.client.coerce import split_step
    from areal_metrics.producers.contract.field_rules import METRICS_MAX
    from areal_metrics.producers.contract.settings import Settings

    assert Settings.from_env({}, reader="client").max_metrics == METRICS_MAX
    parts = split_step({f"m{i}": 1.0 for i in range(METRICS_MAX + 7)})
    assert len(parts.metrics) == METRICS_MAX and parts.dropped == 7
    assert split_step({f"m{i}": 1.0 for i in range(5)}, max_metrics=2).dropped == 3


def test_the_sampler_hands_each_sample_to_one_step() -> None:
    from areal_metrics.producers.client.system_metrics import Sampler

    taken = threading.Event()
    count = iter(range(10**6))

    def source() -> dict[str, float]:
        taken.set()
        return {"system/cpu": float(next(count))}

    sampler = Sampler(0.001, source)
    try:
        taken.wait(30)
        while (first := sampler.take()) is None:
            pass
        assert set(first) == {"system/cpu"}
        second = sampler.take()
        assert second is None or second["system/cpu"] > first["system/cpu"]
    finally:
        sampler.close()
    assert not sampler.alive


def test_the_real_sources_give_wandbs_names() -> None:
    from areal_metrics.producers.client.system_metrics import Sampler

    sampler = Sampler(3600)  # no sample of its own in this test: its sources, called here
    try:
        got = sampler._sample()
    finally:
        sampler.close()
    assert {"system/cpu", "system/memory", "system/proc.memory.rssMB"} <= set(got)
    assert all(name.startswith("system/") and isinstance(v, float) for name, v in got.items())
    assert not [n for n in got if n.startswith("system/gpu.")] or "pynvml" in sys.modules

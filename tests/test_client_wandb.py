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
import types
from pathlib import Path
from typing import Any

import pytest

from areal_metrics.producers.contract.events import parse_event
from areal_metrics.producers.client import run as run_module
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.stack.kafka_broker import free_port
from tests.kafka_reading import read_to_end
from tests.support import ROOT, logger_warnings, wait_for

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
    with logger_warnings(run_module._log) as logged:
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
    from areal_metrics.producers.client.settings import ClientSettings

    assert ClientSettings.from_env({}).max_metrics == METRICS_MAX
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


# ------------------------------------------------------------ GPUs through NVML (a stand-in for pynvml)

GIB = 2**30


class _NVMLError(Exception):
    """pynvml's exception class (its text is NVML's: "Driver Not Loaded", "GPU is lost", ...)."""


def stand_in_pynvml(gpus: list[tuple[int, int, int, int]] | None, fail: str | None = None) -> Any:
    """A module with pynvml's (nvidia-ml-py's) names: nvmlInit, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex,
    nvmlDeviceGetUtilizationRates (`.gpu`, `.memory`, in %), nvmlDeviceGetMemoryInfo (`.total`, `.free`,
    `.used`, bytes), nvmlShutdown, NVMLError. `gpus`: (util.gpu, util.memory, used, total) per device;
    `fail`: the call that raises NVMLError ("init": no driver; "device": every device call, a lost GPU)."""
    module = types.ModuleType("pynvml")
    module.calls = []  # type: ignore[attr-defined]

    def call(name: str) -> None:
        module.calls.append(name)  # type: ignore[attr-defined]
        if fail == "init" and name == "nvmlInit" or fail == "device" and name.startswith("nvmlDeviceGet") \
                and name not in ("nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex"):
            raise _NVMLError("Driver Not Loaded" if fail == "init" else "GPU is lost")

    def handle(i: int) -> tuple[str, int]:
        call("nvmlDeviceGetHandleByIndex")
        return ("handle", i)

    def utilization(h: tuple[str, int]) -> Any:
        call("nvmlDeviceGetUtilizationRates")
        gpu, memory, _, _ = (gpus or [])[h[1]]
        return types.SimpleNamespace(gpu=gpu, memory=memory)

    def memory_info(h: tuple[str, int]) -> Any:
        call("nvmlDeviceGetMemoryInfo")
        _, _, used, total = (gpus or [])[h[1]]
        return types.SimpleNamespace(total=total, free=total - used, used=used)

    module.NVMLError = _NVMLError  # type: ignore[attr-defined]
    module.nvmlInit = lambda: call("nvmlInit")  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: call("nvmlShutdown")  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: call("nvmlDeviceGetCount") or len(gpus or [])  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = handle  # type: ignore[attr-defined]
    module.nvmlDeviceGetUtilizationRates = utilization  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = memory_info  # type: ignore[attr-defined]
    return module


TWO_GPUS = [(87, 40, 30 * GIB, 80 * GIB), (3, 1, GIB, 80 * GIB)]
GPU_METRICS = {"system/gpu.0.gpu": 87.0, "system/gpu.0.memory": 40.0, "system/gpu.0.memoryAllocated": 37.5,
               "system/gpu.0.memoryAllocatedBytes": float(30 * GIB),
               "system/gpu.1.gpu": 3.0, "system/gpu.1.memory": 1.0, "system/gpu.1.memoryAllocated": 1.25,
               "system/gpu.1.memoryAllocatedBytes": float(GIB)}
CPU_AND_MEMORY = {"system/cpu", "system/memory", "system/proc.memory.rssMB"}
NO_DRIVER = "system metrics: no GPU metrics: NVML did not start (_NVMLError: Driver Not Loaded); CPU and memory only"


def test_each_gpu_is_sampled_through_nvml_under_wandbs_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from areal_metrics.producers.client.system_metrics import Sampler

    nvml = stand_in_pynvml(TWO_GPUS)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with logger_warnings(run_module._log) as warned:
        sampler = Sampler(3600)  # its sources, called here
        try:
            first, second = sampler._sample(), sampler._sample()
        finally:
            sampler.close()
    assert not sampler.alive and not warned
    for got in (first, second):
        assert {k: v for k, v in got.items() if k.startswith("system/gpu.")} == GPU_METRICS
        assert set(got) == CPU_AND_MEMORY | set(GPU_METRICS)
    assert nvml.calls[:4] == ["nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                              "nvmlDeviceGetHandleByIndex"]  # the handles once, at start
    assert nvml.calls[4:] == ["nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo"] * 4 + ["nvmlShutdown"]


@pytest.mark.parametrize("fail", ["init", "device"])
def test_nvml_failing_leaves_cpu_and_memory_with_one_warning(fail: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No driver (nvmlInit raises NVMLError) or a GPU lost mid-run (its calls raise): the samples go on
    with CPU and memory, one warning says why, nothing reaches the caller however often it samples."""
    from areal_metrics.producers.client.system_metrics import Sampler

    monkeypatch.setitem(sys.modules, "pynvml", stand_in_pynvml(TWO_GPUS, fail=fail))
    with logger_warnings(run_module._log) as warned:
        sampler = Sampler(3600)
        try:
            samples = [sampler._sample() for _ in range(3)]
        finally:
            sampler.close()
    assert all(set(s) == CPU_AND_MEMORY for s in samples)
    assert [r.getMessage() for r in warned] == [NO_DRIVER if fail == "init" else
                                                "system metrics: GPU 0 did not answer NVML (_NVMLError: GPU is lost); "
                                                "left out of the samples while it does not"]


@pytest.mark.broker
@pytest.mark.timeout(300)
def test_gpu_samples_reach_the_steps_metrics_and_no_driver_only_warns(kafka_bootstrap: str, topics: Topics,
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """In a training loop: with NVML the logged steps carry each GPU's numbers; with NVML raising (no
    driver) the same loop runs, its steps carry CPU and memory, and one warning was logged."""
    from areal_metrics.producers.client.run import init

    logged: dict[str, list[dict[str, float]]] = {}
    for run_id, fail in (("nvml-gpus", None), ("nvml-no-driver", "init")):
        monkeypatch.setitem(sys.modules, "pynvml", stand_in_pynvml(TWO_GPUS, fail=fail))
        with logger_warnings(run_module._log) as warned:
            run = init(run_id=run_id, kafka_bootstrap=kafka_bootstrap, topic_prefix=topics.prefix,
                       journal_dir=str(tmp_path / run_id), git=False, rank=0, world_size=1, system_metrics_s=0.01)
            for step in range(3):
                wait_for(lambda: run._sampler._latest is not None, 30, "a system sample")
                run.log({"reward": 0.5}, step=step)
            run.finish()
        assert [r.getMessage() for r in warned] == ([] if fail is None else [NO_DRIVER])
        assert run.stats().failed == 0
    for m in read_to_end(kafka_bootstrap, topics.steps):
        step = parse_event(m.value)
        logged.setdefault(step.run_id, []).append(step.metrics)
    assert len(logged["nvml-gpus"]) == len(logged["nvml-no-driver"]) == 3
    # step 0 surely carries a sample (one was there before it was logged, and nothing took it); a later
    # step may find the newest sample taken by the step before it, and then carries none
    sampled = {run_id: [m for m in steps if "system/cpu" in m] for run_id, steps in logged.items()}
    assert sampled["nvml-gpus"][0] is logged["nvml-gpus"][0] and sampled["nvml-no-driver"][0] is logged["nvml-no-driver"][0]
    for metrics in sampled["nvml-gpus"]:
        assert {k: v for k, v in metrics.items() if k.startswith("system/")} == {
            **GPU_METRICS, **{k: metrics[k] for k in CPU_AND_MEMORY}}
    for metrics in sampled["nvml-no-driver"]:
        assert {k for k in metrics if k.startswith("system/")} == CPU_AND_MEMORY


def test_wandbs_call_shapes_never_raise_and_what_they_send_readers_accept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B's defaults and habits (tags=None, log(commit=False), alert's timedelta or None wait_duration), numpy
    ints where a framework hands them, and values past what a reader takes (more NaN names than `non_finite`
    holds, more verdicts than an array holds, samples over a message's bytes): no call raises, and every message
    written is one the readers parse (before: TypeError on the second alert, a step and an eval each refused)."""
    import datetime

    import numpy as np

    from areal_metrics.producers.client.run import init
    from areal_metrics.producers.contract.events import CommandEvent, EvalEvent, StepEvent
    from areal_metrics.producers.contract.field_rules import NON_FINITE_MAX

    monkeypatch.setenv("AREAL_HOME", str(tmp_path / "home"))
    run = init(run_id="habits", kafka_bootstrap=f"127.0.0.1:{free_port()}", journal_dir=str(tmp_path / "j"),
               git=False, rank=0, world_size=1, exit_timeout_s=0.5, tags=None)
    for wait in (datetime.timedelta(minutes=5), datetime.timedelta(minutes=5), None, "soon"):
        run.alert("slow", wait_duration=wait)
    run.log({"loss": 1.0}, commit=False)
    run.log({"reward": 0.5})  # the same step as the line above
    run.log({"reward": 0.7, **{f"nan{i}": float("nan") for i in range(NON_FINITE_MAX + 50)}})
    run.log_eval("math", step=np.int64(1), verdicts=np.ones(120_000, dtype=np.int64), replicas=np.int64(1))
    wide = [{"prompt": "中" * 4096, "response": "文" * 4096, "verdict": 1} for _ in range(64)]  # ~1.5 MB as JSON
    run.log_eval("code", step=1, samples=wide)
    command = CommandEvent(run_id="habits", command="scale_lr", args={"factor": 0.5, "from_step": 2})
    run.acknowledge(command, "applied", step=np.int64(2), lr_factor=np.float32(0.5))
    run.finish()
    events = [parse_event(line) for line in _journal_lines(tmp_path / "j")]  # raises for what a reader refuses
    steps = {e.step: e for e in events if isinstance(e, StepEvent)}
    assert (steps[0].loss, steps[0].reward) == (1.0, 0.5)  # commit=False: one step, the second log adds to it
    assert steps[1].reward == 0.7 and len(steps[1].non_finite) == NON_FINITE_MAX
    evals = {e.dataset: e for e in events if isinstance(e, EvalEvent)}
    assert evals["math"].verdicts is None and (evals["math"].n_samples, evals["math"].accuracy) == (120_000, 1.0)
    assert 0 < len(evals["code"].samples) < 64 and len(evals["code"].to_json()) < 1 << 20
    assert [e.kind for e in events if e.type == "alert"] == ["user"]  # once within its wait
    assert [(e.status, e.step) for e in events if e.type == "command_ack"] == [("applied", 2)]

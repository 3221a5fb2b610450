"""Shared helpers for the benchmarks: a broker to measure against, percentiles, tables."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from areal_metrics.producers.contract.events import StepEvent
from areal_metrics.producers.contract.settings import is_set, read_setting


@contextlib.contextmanager
def broker() -> Iterator[str]:
    """AREAL_KAFKA_BOOTSTRAP if set, else a fresh real broker in a temp folder for this run."""
    if is_set("kafka_bootstrap"):
        yield read_setting("kafka_bootstrap")
        return
    from areal_metrics.stack.kafka_broker import KafkaBroker
    from areal_metrics.stack.settings import StackSettings

    data = Path(tempfile.mkdtemp(prefix="areal-bench-kafka-"))
    b = KafkaBroker(data, stack=StackSettings.from_env())
    b.start(timeout=120)
    try:
        yield b.bootstrap
    finally:
        b.stop()
        shutil.rmtree(data, ignore_errors=True)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values) if values else float("nan"),
        "mean": statistics.fmean(values) if values else float("nan"),
    }


def step_events(n: int, run_id: str = "bench", ranks: int = 1) -> list[StepEvent]:
    """Realistic step events: every contract field filled."""
    now = time.time()
    return [
        StepEvent(
            run_id=run_id, node=f"node{i % ranks}", rank=i % ranks, ts=now, step=i // ranks, epoch=0,
            reward=0.5, reward_std=0.1, entropy=1.3, advantage_mean=0.0, advantage_std=1.0, kl=0.01,
            clip_ratio=0.1, loss=0.4, lr=3e-4, grad_norm=0.8, response_length=12.0, tokens=4096,
            throughput=20000.0, latency_ms=150.0, gpu_mem_bytes=1 << 30,
        )
        for i in range(n)
    ]


def machine() -> str:
    cpus = os.cpu_count()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    return f"{platform.machine()}, {cpus} cores, {mem:.0f} GiB, Python {platform.python_version()}, {platform.system()}"


def print_table(title: str, rows: list[tuple[str, str, str]]) -> None:
    """rows: (what, figure, ratio-to-baseline)"""
    width = max(len(r[0]) for r in rows)
    print(f"\n{title}")
    print(f"  {'measure'.ljust(width)}  {'figure':>22}  ratio")
    for what, figure, ratio in rows:
        print(f"  {what.ljust(width)}  {figure:>22}  {ratio}")


def measure_and_report(measure: Callable[[str], dict[str, Any]], report: Callable[[dict[str, Any]], None],
                       json_path: Path | None) -> int:
    """A benchmark's main: measure against a broker, print the tables and the load, write the JSON."""
    print(f"machine: {machine()}")
    with broker() as bootstrap:
        result = measure(bootstrap)
    report(result)
    load = print_load()
    if json_path:
        json_path.write_text(json.dumps({**result, "load_average": load}, indent=2))
    return 0


def wait_for_merges(client: Any, quiet_s: float, most_s: float) -> bool:
    """Until no merge runs in the store and its merged rows stayed put for `quiet_s`; False when it is
    still merging after `most_s` (the merges a benchmark's inserts set off, before it reads the parts)."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + most_s
    while time.monotonic() - since < quiet_s:
        if time.monotonic() > deadline:
            return False
        now = (int(client.command("SELECT value FROM system.events WHERE event = 'MergedRows'") or 0),
               int(client.command("SELECT count() FROM system.merges")))
        if now != last or now[1]:
            last, since = now, time.monotonic()
        time.sleep(0.2)
    return True


def print_load() -> list[float]:
    """Print and return the load average: how shared the machine was while it measured."""
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min)")
    return list(load)


def rss_mib() -> float:
    """This process's resident set (VmRSS), MiB; NaN where /proc does not say."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")

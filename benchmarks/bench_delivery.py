"""Where delivering a logged step spends CPU, per delivery option (issue 12's decision, in CPU time).

    python -m benchmarks.bench_delivery [--events 3000] [--json PATH]

Each option logs the same steps (the 59 values of `benchmarks.bench_step`'s
training step) through a real Run, paced at one step every 2 ms so that the
sender works as it does beside a training loop (woken, a few records, idle
again), then finishes (everything acknowledged). Measured from /proc, per
thread, in microseconds per event:

- caller: the logging thread's own time in `run.log`;
- GIL threads: the Run's Python threads (the sender, the pipe writer), time
  the training loop cannot run Python or dispatch torch ops;
- native threads: threads that never take the GIL (librdkafka's);
- child: the delivery process of the separate-process prototype.

CPU time rather than wall time: on a shared machine the wall time of a step
moves by more than the whole cost of monitoring, the CPU a thread used does not.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path

from benchmarks.common import measure_and_report, print_table

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu(stat: Path) -> float:
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _threads() -> dict[int, float]:
    return {int(t.name): _cpu(t / "stat") for t in Path("/proc/self/task").iterdir()}


def _values() -> dict[str, float]:
    names = ["loss", "ppl", "lr", "grad_norm", "tokens", "step_time_ms", "tokens_per_s"]
    names += [f"grad_norm/body.layers.{i // 13}.p{i % 13}" for i in range(52)]
    return {name: 0.1 + i * 1e-3 for i, name in enumerate(names)}


def measure(bootstrap: str, option: str, events: int, tmp: Path) -> dict[str, float]:
    from areal_metrics.stack.kafka_broker import create_topics
    from benchmarks.delivery_process import PipePublisher
    from areal_metrics.producers.client.run import init
    from areal_metrics.producers.contract.topics import Topics

    prefix = f"benchdel{uuid.uuid4().hex[:6]}."
    create_topics(bootstrap, Topics(prefix).all(), partitions=3)
    client = "kafka-python" if option == "separate process, pipe" else option
    before_threads = set(_threads())
    python_before = {t.native_id for t in threading.enumerate()}
    run = init(f"bench-del-{uuid.uuid4().hex[:6]}", kafka_bootstrap=bootstrap, topic_prefix=prefix, git=False,
               journal_dir=tmp / option / "run", kafka_client=client)
    child = None
    if option == "separate process, pipe":
        run._publisher.close(10)
        run._publisher = PipePublisher(bootstrap, Topics(prefix), tmp / option / "pipe")
        child = Path(f"/proc/{run._publisher._child.pid}/stat")
    values = _values()
    for i in range(20):  # connect, warm up
        run.log(values, step=i)
    time.sleep(1.0)
    gil = {t.native_id for t in threading.enumerate()} - python_before
    start, child_start, caller = _threads(), _cpu(child) if child else 0.0, 0.0
    for i in range(20, 20 + events):
        t = time.thread_time()
        run.log(values, step=i)
        caller += time.thread_time() - t
        time.sleep(0.002)
    time.sleep(0.5)  # let the last records go out before the end of the window
    end, child_end = _threads(), _cpu(child) if child else 0.0
    run.finish()
    stats = run.stats()
    new = set(end) - before_threads
    per_event = 1e6 / events
    return {
        "caller_us": caller * per_event,
        "gil_threads_us": sum(end[t] - start.get(t, 0.0) for t in new if t in gil) * per_event,
        "native_threads_us": sum(end[t] - start.get(t, 0.0) for t in new if t not in gil) * per_event,
        "child_us": (child_end - child_start) * per_event,
        "acknowledged": stats.sent + stats.resent, "queued": stats.queued,
    }


def options() -> list[str]:
    import importlib.util

    found = ["confluent-kafka"] if importlib.util.find_spec("confluent_kafka") else []
    return found + ["kafka-python", "separate process, pipe"]


def run(bootstrap: str, events: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        return {option: measure(bootstrap, option, events, Path(tmp)) for option in options()}


def report(result: dict[str, dict[str, float]]) -> None:
    rows = []
    for option, r in result.items():
        total = r["gil_threads_us"] + r["native_threads_us"] + r["child_us"]
        rows.append((option, f"{r['gil_threads_us']:.0f} us GIL",
                     f"native {r['native_threads_us']:.0f} us, child {r['child_us']:.0f} us, background total "
                     f"{total:.0f} us; caller {r['caller_us']:.0f} us; {r['acknowledged']}/{r['queued']} acknowledged"))
    print_table("delivery CPU per logged step (59 values), by option, one step every 2 ms", rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_delivery")
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    return measure_and_report(lambda bootstrap: run(bootstrap, args.events), report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())

"""A reader's heavy query against the sink's HTTP endpoint (the sink is a real process, with
the default AREAL_HTTP_* limits), measured from outside:

- abandoned: a reader sends `SELECT count() FROM numbers(1e11) WHERE ...` and closes its
  connection after 2 s; the sink process's CPU (psutil, sampled every 0.1 s) until it is back
  under 20 % of a core: `abandoned_cpu_idle_s` (from the close);
- visible latency: `publish()` of one step until `sql` sees it, with no reader load and while
  a heavy reader query runs (it runs until the 30 s time limit):
  `visible_ms_p50/p99@idle`, `visible_ms_p50/p99@heavy_reader`;
- a reader query that would hold 8 GB: its error code (`huge_query_code`, 241 is
  MEMORY_LIMIT_EXCEEDED), the sink's peak RSS meanwhile, and whether the sink is still running
  and storing steps afterwards (`sink_alive_after_huge`).

    python -m benchmarks.bench_http_bounds [--samples N] [--json PATH]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from pathlib import Path

from benchmarks.common import broker, machine, print_table, summary
from areal_metrics.producers.contract.events import StepEvent
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.sinks.query import Target, connect, read_owner

HEAVY = "SELECT count() FROM numbers(100000000000) WHERE number % 7 = 3"
HUGE = "SELECT length(groupArray(number)) FROM numbers(1000000000)"  # would hold 8 GB
IDLE_CPU_PCT = 20.0


def send_heavy(port: int, user: str, password: str) -> socket.socket:
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"GET /?{urllib.parse.urlencode({'query': HEAVY})} HTTP/1.1\r\nHost: x\r\n"
                 f"Authorization: Basic {auth}\r\n\r\n".encode())
    return sock


def cpu_back_to_idle(proc, timeout: float = 60.0) -> float:
    """Seconds until the process's CPU over a 0.1 s sample is under IDLE_CPU_PCT."""
    t0 = time.monotonic()
    proc.cpu_percent(None)
    while time.monotonic() - t0 < timeout:
        time.sleep(0.1)
        if proc.cpu_percent(None) < IDLE_CPU_PCT:
            return time.monotonic() - t0
    return float("inf")


def visible_latencies(settings: Settings, samples: int, run: str) -> list[float]:
    from areal_metrics.producers.delivery.publisher import Publisher

    out = []
    with tempfile.TemporaryDirectory() as journal:
        publisher = Publisher.from_settings(settings, journal_dir=journal)
        with connect(settings) as store:
            for i in range(samples):
                event = StepEvent(run_id=run, step=i, epoch=0, reward=0.5)
                t0 = time.perf_counter()
                publisher.publish(event)
                while not store.query(f"SELECT 1 FROM steps WHERE event_id = '{event.event_id}'").rows:
                    time.sleep(0.005)
                out.append((time.perf_counter() - t0) * 1000)
        publisher.close()
    return out


def main() -> None:
    import psutil

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from areal_metrics.stack.kafka_broker import create_topics

    result: dict[str, float] = {}
    store_dir = Path(tempfile.mkdtemp(prefix="areal-bench-http-"))
    sink = None
    try:
        with broker() as bootstrap:
            topics = Topics(f"bench{uuid.uuid4().hex[:6]}.")
            create_topics(bootstrap, topics.all(), partitions=3)
            url = f"chdb://{store_dir}"
            settings = Settings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix, clickhouse_url=url)
            env = {**os.environ, "AREAL_KAFKA_BOOTSTRAP": bootstrap, "AREAL_TOPIC_PREFIX": topics.prefix,
                   "AREAL_CLICKHOUSE_URL": url, "AREAL_HOME": str(store_dir / "home")}
            sink = subprocess.Popen([sys.executable, "-m", "areal_metrics.sinks"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            path = Target.parse(url).path
            deadline = time.monotonic() + 120
            while read_owner(path) is None and time.monotonic() < deadline:
                time.sleep(0.2)
            owner = read_owner(path)
            assert owner is not None, "the sink did not start"
            reader = owner.users["reader"]
            visible_latencies(settings, 5, "warmup")
            proc = psutil.Process(sink.pid)

            idle = visible_latencies(settings, args.samples, "idle")
            sock = send_heavy(owner.port, reader.name, reader.password)
            time.sleep(2.0)
            result["heavy_cpu_pct"] = proc.cpu_percent(0.5)
            sock.close()  # the client gives up
            result["abandoned_cpu_idle_s"] = cpu_back_to_idle(proc)

            sock = send_heavy(owner.port, reader.name, reader.password)
            time.sleep(1.0)
            heavy = visible_latencies(settings, args.samples, "heavy")
            sock.close()
            import http.client

            rss = [proc.memory_info().rss]
            sampling = threading.Event()

            def sample_rss() -> None:
                while not sampling.wait(0.05):
                    rss.append(proc.memory_info().rss)

            sampler = threading.Thread(target=sample_rss, daemon=True)
            sampler.start()
            conn = http.client.HTTPConnection("127.0.0.1", owner.port, timeout=120)
            auth = base64.b64encode(f"{reader.name}:{reader.password}".encode()).decode()
            conn.request("GET", "/?" + urllib.parse.urlencode({"query": HUGE}), headers={"Authorization": f"Basic {auth}"})
            answer = conn.getresponse()
            answer.read()
            conn.close()
            sampling.set()
            sampler.join()
            result["huge_query_code"] = float(answer.getheader("X-ClickHouse-Exception-Code") or 0)
            result["huge_query_sink_peak_rss_mib"] = max(rss) / 2**20
            visible_latencies(settings, 3, "after-huge")  # still storing
            result["sink_alive_after_huge"] = float(sink.poll() is None)
            for name, values in (("idle", idle), ("heavy_reader", heavy)):
                s = summary(values)
                result[f"visible_ms_p50@{name}"] = s["p50"]
                result[f"visible_ms_p99@{name}"] = s["p99"]
    finally:
        if sink is not None:
            sink.terminate()
            sink.wait(60)
        shutil.rmtree(store_dir, ignore_errors=True)

    print(f"machine: {machine()}")
    print_table("reader queries against the sink's endpoint (default limits)", [
        ("sink CPU while a reader's numbers(1e11) runs", f"{result['heavy_cpu_pct']:.0f} %", ""),
        (f"abandoned by its client: sink CPU under {IDLE_CPU_PCT:.0f} % after", f"{result['abandoned_cpu_idle_s']:.2f} s", ""),
        ("publish() -> visible to sql, no reader load, p50 / p99",
         f"{result['visible_ms_p50@idle']:.0f} / {result['visible_ms_p99@idle']:.0f} ms", ""),
        ("publish() -> visible to sql, a heavy reader query running, p50 / p99",
         f"{result['visible_ms_p50@heavy_reader']:.0f} / {result['visible_ms_p99@heavy_reader']:.0f} ms", ""),
        ("a reader's groupArray over 1e9 numbers: error code, sink peak RSS",
         f"{result['huge_query_code']:.0f}, {result['huge_query_sink_peak_rss_mib']:.0f} MiB", ""),
        ("the sink still running and storing steps after it", "yes" if result["sink_alive_after_huge"] else "NO", ""),
    ])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

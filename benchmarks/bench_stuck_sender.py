"""A trainer logging while the publisher's sender is stuck inside the Kafka client (a broker
handshake that never returns): the caller's costliest `publish()` once the queue is full and its
oldest go to the journal on the caller's thread. No broker.

    python -m benchmarks.bench_stuck_sender [--events N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time

from areal_metrics.producers.contract.events import AlertEvent
from areal_metrics.producers.delivery.publisher import Publisher


def bench_stuck_sender(events: int) -> dict[str, float]:
    stuck = threading.Event()
    with tempfile.TemporaryDirectory() as journal:
        publisher = Publisher("127.0.0.1:1", journal_dir=journal, close_at_exit=False)
        publisher._step = lambda: stuck.wait() or False  # type: ignore[method-assign]  # never returns
        time.sleep(0.1)  # the sender is inside it
        event = AlertEvent(run_id="r", node="n", kind="k", message="m")
        costs = []
        for _ in range(events):
            t0 = time.perf_counter()
            publisher.publish(event)
            costs.append(time.perf_counter() - t0)
        spilled = publisher.stats().spilled
        stuck.set()
        publisher.close(1)
    costs.sort()
    return {"stuck_sender_publish_ms_max": costs[-1] * 1000,
            "stuck_sender_publish_ms_p9999": costs[int(len(costs) * 0.9999)] * 1000,
            "stuck_sender_publish_s_total": sum(costs), "stuck_sender_spilled": spilled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=250_000)
    print(json.dumps(bench_stuck_sender(parser.parse_args().events), indent=2))


if __name__ == "__main__":
    main()

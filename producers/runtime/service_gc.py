"""Garbage collection for the long-running services (the stream worker, the sink): never
for a trainer's process, whose interpreter is its user's.

CPython's cyclic collector runs after every 700 net allocations of container objects and,
every 100 of those runs, walks every object the process holds. A service's heap is mostly
modules, classes and library objects made at start (Faust, aiokafka, the embedded engine's
client) that never become garbage, and its per-event objects are freed by reference counting
as soon as the event is done, so the collector's walks are mostly wasted work (its share of
the services' CPU is in docs/PERFORMANCE.md). So: everything alive once the service has started is moved out of the
collector's sight (`gc.freeze`), and the youngest generation is collected after 20,000
allocations instead of 700. Cycles are still collected, only less often.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000


def settle_gc() -> None:
    """Collect once, freeze what survives, and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)

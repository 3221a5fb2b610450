"""Option (b) of issue 12, as a prototype to measure: delivery from a separate process.

The trainer's side (`PipePublisher`, in place of the Run's Publisher) keeps
the caller's cost as it is (`publish` appends to a deque); one thread encodes
the records (the same `encode` the Publisher's sender thread runs) and writes
them, length-prefixed and batched, to the stdin of a child process. The child
(`python -m benchmarks.delivery_process BOOTSTRAP PREFIX JOURNAL`) hands them
to a kafka-python Publisher (journal, acks=all, idempotence) and closes it at
end of input.

Only the benchmark uses it: it measures what this design costs the training
loop beside confluent-kafka in the same process (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import collections
import json
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from areal_metrics.producers.contract.events import Event
from areal_metrics.producers.contract.topics import Topics

_FRAME = struct.Struct("!HHI")  # topic length, key length, value length


class PipePublisher:
    """The part of Publisher's interface a Run calls: publish, flush, close, stats."""

    def __init__(self, bootstrap: str, topics: Topics, journal: Path) -> None:
        self.topics = topics
        self._queue: collections.deque[Any] = collections.deque()
        self._wake = threading.Event()
        self._closing = False
        self._journal = journal
        self._child = subprocess.Popen([sys.executable, "-m", "benchmarks.delivery_process", bootstrap, topics.prefix,
                                        str(journal)], stdin=subprocess.PIPE)
        self._thread = threading.Thread(target=self._pump, name="areal-pipe", daemon=True)
        self._thread.start()
        self.queued = 0

    def publish(self, item: Event | Any) -> None:
        self.queued += 1
        self._queue.append(item)

    def _pump(self) -> None:
        pipe = self._child.stdin
        assert pipe is not None
        while True:
            if not self._queue:
                if self._closing:
                    break
                self._wake.wait(0.02)  # the same idle wait as the Publisher's sender
                self._wake.clear()
                continue
            chunks = []
            while self._queue:
                item = self._queue.popleft()
                topic, key, value = (self.topics.for_event(item), item.run_id.encode(), item.to_json()) \
                    if isinstance(item, Event) else item.encode(self.topics)
                name = topic.encode()
                chunks += (_FRAME.pack(len(name), len(key), len(value)), name, key, value)
            pipe.write(b"".join(chunks))
            pipe.flush()
        pipe.close()

    def flush(self, timeout: float = 30.0, **_: Any) -> bool:
        return True  # the child delivers; close() waits for it

    def close(self, timeout: float = 10.0, **_: Any) -> None:
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        self._child.wait(timeout + 30)

    def stats(self) -> Any:
        """The child's figures once it has closed (it writes them beside its journal)."""
        from areal_metrics.producers.delivery.publisher import PublisherStats

        done = self._journal / "stats.json"
        figures = json.loads(done.read_text()) if done.exists() else {}
        return PublisherStats(**{**dict.fromkeys(PublisherStats.__slots__, 0), **figures})


class _Raw:
    __slots__ = ("record",)

    def __init__(self, record: tuple[str, bytes, bytes]) -> None:
        self.record = record

    def encode(self, topics: Topics) -> tuple[str, bytes, bytes]:
        return self.record


def _child(bootstrap: str, prefix: str, journal: str) -> int:
    from areal_metrics.producers.delivery.publisher import Publisher

    publisher = Publisher(bootstrap, Topics(prefix), journal, kafka_client="kafka-python", close_at_exit=False)
    source = sys.stdin.buffer
    while True:
        head = source.read(_FRAME.size)
        if len(head) < _FRAME.size:
            break
        lt, lk, lv = _FRAME.unpack(head)
        body = source.read(lt + lk + lv)
        publisher.publish(_Raw((body[:lt].decode(), body[lt:lt + lk], body[lt + lk:])))
    publisher.close(60)
    stats = publisher.stats()
    (Path(journal) / "stats.json").write_text(json.dumps({name: getattr(stats, name) for name in stats.__slots__}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_child(*sys.argv[1:4]))

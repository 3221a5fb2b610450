"""The events a trainer's run sends through the public client, without a broker.

`ClientCapture.open_run` is the trainer's `open_run`: the real client
(`areal_metrics.producers.client.run.init`, through `areal_metrics.areal_train.reporting.open_client_run`)
with a bootstrap nothing listens on, so its publisher journals every event.
`events()` reads the journals back: exactly the records the broker would have
received, in each rank's publish order, merged by timestamp.
"""

from __future__ import annotations

from pathlib import Path

from areal_metrics.areal_train.reporting import RunLike, RunSpec, open_client_run
from areal_metrics.producers.contract.events import Event, parse_event

UNREACHABLE = "127.0.0.1:9"  # the discard port: connections are refused at once


class ClientCapture:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.opened: list[Path] = []

    def open_run(self, spec: RunSpec) -> RunLike:
        journal = self.directory / f"{spec.run_id}-r{spec.rank}-a{spec.attempt}-{len(self.opened)}"
        self.opened.append(journal)
        return open_client_run(spec, kafka_bootstrap=UNREACHABLE, journal_dir=journal, git=False)

    def events(self) -> list[Event]:
        found: list[Event] = []
        for journal in self.opened:
            for line in (journal / "journal.log").read_bytes().splitlines():
                _topic, _key, value = line.split(b"\t", 2)
                found.append(parse_event(value))
        return sorted(found, key=lambda e: e.ts)

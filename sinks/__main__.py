"""`python -m areal_metrics.sinks`: run the ClickHouse sink until SIGTERM/SIGINT.

Environment: AREAL_KAFKA_BOOTSTRAP, AREAL_TOPIC_PREFIX, AREAL_CLICKHOUSE_URL,
AREAL_HOME; optional AREAL_SINK_MAX_ROWS (default 5000),
AREAL_SINK_MAX_WAIT_MS (default 500) and AREAL_SINK_IDLE_MS (default 50; 0: off,
wait out MAX_WAIT): the batching policy;
AREAL_SINK_INSTANCE_ID (default <group>@<host>): the static member id
of this sink in its consumer group (give each sink of one group its own);
AREAL_SINK_STOP_MERGES=1 (audits, tests): no background merges, so the raw
row count shows every stored block; AREAL_SINK_HTTP_PORT (default 0: a free
port): the loopback port of the ClickHouse HTTP interface of an embedded store.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from areal_metrics.producers.contract.errors import ArealError, one_line
from areal_metrics.producers.runtime.service_gc import settle_gc
from areal_metrics.producers.contract.settings import Settings

from areal_metrics.sinks.batching import BatchPolicy
from areal_metrics.sinks.sink import Sink


def main() -> int:
    logging.basicConfig(level=os.environ.get("AREAL_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    policy = BatchPolicy(
        max_rows=int(os.environ.get("AREAL_SINK_MAX_ROWS", "5000")),
        max_wait_s=int(os.environ.get("AREAL_SINK_MAX_WAIT_MS", "500")) / 1000,
        idle_s=int(os.environ.get("AREAL_SINK_IDLE_MS", "50")) / 1000,
    )
    stop_merges = os.environ.get("AREAL_SINK_STOP_MERGES", "") == "1"
    http_port = int(os.environ.get("AREAL_SINK_HTTP_PORT", "0"))
    try:
        sink = Sink(Settings.from_env(), policy=policy, stop_merges=stop_merges, http_port=http_port)
    except ArealError as exc:  # a setting that cannot work (e.g. a cluster on the embedded engine): one line
        print(f"areal-sink: {one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sink.stop())
    settle_gc()  # this process's own interpreter: everything built so far lives until exit
    try:
        sink.run()
    except ImportError as exc:  # one line for `areal-metrics status`, and no restart: it cannot pass
        print(f"areal-sink: cannot start: {exc} (install the stack extra: pip install 'areal-metrics[stack]')",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

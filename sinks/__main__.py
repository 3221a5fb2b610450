"""`python -m areal_metrics.sinks`: run the ClickHouse sink until SIGTERM/SIGINT.

Environment: AREAL_KAFKA_BOOTSTRAP, AREAL_TOPIC_PREFIX, AREAL_CLICKHOUSE_URL,
AREAL_HOME; optional AREAL_SINK_MAX_ROWS (default 5000),
AREAL_SINK_MAX_WAIT_MS (default 500) and AREAL_SINK_IDLE_MS (default 50; 0: off,
wait out MAX_WAIT): the batching policy;
AREAL_SINK_INSTANCE_ID (default <group>@<host>): the static member id
of this sink in its consumer group (give each sink of one group its own);
AREAL_SINK_STOP_MERGES=1 (audits, tests): no background merges, so the raw
row count shows every stored block; AREAL_SINK_HTTP_PORT (default 0: a free
port): the loopback port of the ClickHouse HTTP interface of an embedded store;
AREAL_POISON_CRASHES (default 2): a message in flight in that many crashes is
dead-lettered and skipped ($AREAL_HOME/sink/<member id>/).
"""

from __future__ import annotations

import logging
import re
import signal
import socket
import sys

from areal_metrics.producers.contract.errors import ArealError, one_line
from areal_metrics.producers.runtime.poison import CrashGuard, crash_marker
from areal_metrics.producers.runtime.log_repeats import bound_repeated_lines
from areal_metrics.producers.runtime.service_gc import settle_gc
from areal_metrics.producers.contract.limits import StructureLimits, install_limits
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.sinks.settings import SinkSettings

from areal_metrics.sinks.batching import BatchPolicy
from areal_metrics.sinks.sink import Sink


def _crash_guard(settings: Settings, own: SinkSettings) -> CrashGuard:
    """The positions in flight and the suspects of this sink (one folder per static member id)."""
    from areal_metrics.sinks.sink import consumer_group

    member = own.sink_instance_id or f"{consumer_group(settings)}@{socket.gethostname()}"
    guard = CrashGuard(settings.state_dir / "sink" / re.sub(r"[^A-Za-z0-9._@-]", "_", member), settings.poison_crashes,
                       "sink")
    guard.start()
    return guard


def main() -> int:
    try:
        settings = Settings.from_env()
        own = SinkSettings.from_env()  # the sink's own (AREAL_LOG_LEVEL, AREAL_SINK_*, AREAL_HTTP_*)
    except ArealError as exc:  # a variable that cannot be used: one line
        print(f"areal-sink: {one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    install_limits(StructureLimits.from_settings(settings))  # every message's structure limits (AREAL_MAX_*)
    logging.basicConfig(level=own.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    bound_repeated_lines(settings.log_repeat_s)  # a failure that repeats (Kafka gone) is one line a minute
    policy = BatchPolicy(
        max_rows=own.sink_max_rows,
        max_wait_s=own.sink_max_wait_ms / 1000,
        idle_s=own.sink_idle_ms / 1000,
        replan_wait_s=own.sink_replan_wait_ms / 1000,
    )
    try:
        from areal_metrics.sinks.http.server import QueryLimits

        sink = Sink(settings, policy=policy, stop_merges=own.sink_stop_merges, http_port=own.sink_http_port,
                    guard=_crash_guard(settings, own), crash_marker=crash_marker("sink", settings.test_crash_on),
                    instance_id=own.sink_instance_id, query_limits=QueryLimits.from_settings(own),
                    stall_s=own.sink_stall_ms / 1000)
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

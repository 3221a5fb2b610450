"""The sink's own settings (AREAL_LOG_LEVEL, AREAL_SINK_*, AREAL_HTTP_*): read by `python -m
areal_metrics.sinks` alone, by the contract's one parser (docs/SETTINGS.md)."""

from __future__ import annotations

from dataclasses import dataclass

from areal_metrics.producers.contract.settings import LOG_LEVELS, SettingGroup, setting


@dataclass(frozen=True)
class SinkSettings(SettingGroup):
    """The sink (`python -m areal_metrics.sinks`) and its ClickHouse HTTP endpoint"""

    log_level: str = setting("AREAL_LOG_LEVEL", "info", "the sink's log level", choices=LOG_LEVELS,
                             readers="sink")
    sink_max_rows: int = setting("AREAL_SINK_MAX_ROWS", 5000, "rows buffered before a flush, and of one partition "
                                 "in an insert, at most (an insert holds a topic's partitions)", ge=1,
                                 le=10_000_000, readers="sink")
    sink_max_wait_ms: int = setting("AREAL_SINK_MAX_WAIT_MS", 500, "the longest a row waits in the buffer, ms",
                                    ge=0, le=3_600_000, readers="sink")
    sink_idle_ms: int = setting("AREAL_SINK_IDLE_MS", 50, "flush once a poll this long brought nothing, ms",
                                ge=0, le=3_600_000, readers="sink")
    sink_replan_wait_ms: int = setting("AREAL_SINK_REPLAN_WAIT_MS", 30_000, "after a crash, how long a block of "
                                       "recorded plans waits for its other partitions to be read again before "
                                       "each of its chunks is stored alone, ms", ge=0, le=3_600_000, readers="sink")
    sink_stall_ms: int = setting("AREAL_SINK_STALL_MS", 30_000, "how often the sink compares its partitions' "
                                 "positions with their end offsets: one behind at two checks in a row, at the same "
                                 "position, with the sink polling in between, makes it replace its consumer (a "
                                 "kafka-python fault); 0: never, ms", ge=0, le=3_600_000,
                                 readers="sink")
    sink_instance_id: str | None = setting("AREAL_SINK_INSTANCE_ID", None, "the sink's static group member id",
                                           readers="sink", default_doc="`<group>@<hostname>`")
    sink_stop_merges: bool = setting("AREAL_SINK_STOP_MERGES", False, "keep inserted blocks unmerged (audits, "
                                     "tests)", readers="sink")
    sink_http_port: int = setting("AREAL_SINK_HTTP_PORT", 0, "port of the embedded store's HTTP endpoint (0: a "
                                  "free one, recorded in the store's owner.json)", ge=0, le=65535,
                                  readers="sink")
    # -- the sink's ClickHouse HTTP endpoint (the embedded store): bounds of one `reader` query, so
    # that a heavy panel or a typo cannot take the CPU or memory of the process that ingests
    http_query_timeout_s: float = setting("AREAL_HTTP_QUERY_TIMEOUT_S", 30.0, "a reader query's time limit, "
                                          "seconds (max_execution_time)", ge=0.001, le=86_400,
                                          readers="sink")
    http_query_memory_bytes: int = setting("AREAL_HTTP_QUERY_MEMORY_BYTES", 1 << 30, "a reader query's memory "
                                           "limit, bytes (max_memory_usage)", ge=1, readers="sink")
    http_max_reader_queries: int = setting("AREAL_HTTP_MAX_READER_QUERIES", 8, "reader queries that run at once; "
                                           "past it one waits AREAL_HTTP_READER_QUEUE_S, then fails with "
                                           "TOO_MANY_SIMULTANEOUS_QUERIES", ge=1, le=1024, readers="sink")
    http_reader_queue_s: float = setting("AREAL_HTTP_READER_QUEUE_S", 10.0, "how long a reader query waits for a "
                                         "free place, seconds", ge=0, le=3600, readers="sink")

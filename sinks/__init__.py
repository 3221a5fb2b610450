"""The ClickHouse sink: every topic projected into its table, exactly once.

schema.py (DDL, migrations, views), batching.py / rows.py / decode.py (the pure
core), writer.py (inserts), sink.py (the loop, `python -m areal_metrics.sinks`), query.py
(`connect()`: the one way readers reach the store), http/ (server.py,
protocol.py, native.py: the embedded store served over ClickHouse's HTTP
interface), replay.py (rebuild from the Kafka log).
See docs/CLICKHOUSE.md.
"""

"""The ClickHouse sink: every topic projected into its table, exactly once.

schema.py (DDL, migrations, views), batching.py / rows.py / decode.py (the pure
core), writer.py (inserts), sink.py (the loop, `python -m sinks`), query.py
(`connect()`: the one way readers reach the store), owner.py (the embedded
store's query endpoint), replay.py (rebuild from the Kafka log).
See docs/CLICKHOUSE.md.
"""

"""Validated records -> column-oriented insert data (pure).

The same records always give the same columns, in the same order: a batch
retried after a crash is rebuilt identically, which is what lets ClickHouse
drop it by its deduplication token.

A projected table (generations) takes its rows from another table's events:
one row per sample of each eval event, `sample` being its index in `samples`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from areal_metrics.producers.contract.events import Event
from areal_metrics.sinks.schema import PROJECTIONS, TABLES_BY_EVENT_TYPE, Table


@dataclass(frozen=True, slots=True)
class Located:
    """A record and where it was read from in the Kafka log."""

    event: Event
    topic: str
    partition: int
    offset: int


def table_for(event: Event) -> Table:
    return TABLES_BY_EVENT_TYPE[event.type]


def projections_for(table: Table) -> tuple[Table, ...]:
    """The tables projected from this table's events (evals -> generations)."""
    return () if table.projected else PROJECTIONS.get(table.event_type, ())


_INT_RANGES = {"UInt16": 2**16, "UInt32": 2**32, "UInt64": 2**64}


_BOUNDED: dict[str, tuple[tuple[str, str, int], ...]] = {}


def _bounded_columns(table: Table) -> tuple[tuple[str, str, int], ...]:
    """(column, type, limit) of the table's unsigned integer columns an event fills."""
    found = _BOUNDED.get(table.name)
    if found is not None:
        return found
    out = []
    for column in table.columns:
        kind = column.type.removeprefix("Nullable(").rstrip(")")
        limit = _INT_RANGES.get(kind)
        if limit is not None and column.server_default is None and not column.name.startswith("_"):
            out.append((column.name, kind, limit))
    found = _BOUNDED[table.name] = tuple(out)
    return found


def unstorable(event: Event) -> str | None:
    """Why a valid event cannot be stored (an integer beyond its column's type), or None.

    The contract bounds most integers from below only; a value the column
    cannot hold would make every retry of its batch fail, so it goes to the
    dead-letter topic instead.
    """
    table = table_for(event)
    for name, kind, limit in _bounded_columns(table):
        v = getattr(event, name)
        if v is not None and not (0 <= v < limit):
            return f"{table.name}.{name}: {v} does not fit the column type {kind}"
    if event.ts >= 2**32:  # DateTime64(3) holds dates up to the year 2299; stay far inside
        return f"{table.name}.ts: {event.ts} is beyond the storable range"
    return None


def _ticks(seconds: float) -> int:
    """A DateTime64(3) value as its integer milliseconds since the epoch (what the column stores, and
    what clickhouse-connect writes as given): the value of `datetime.fromtimestamp(round(seconds, 3))`
    without building it. Rounded here, so a retry cannot differ."""
    return round(round(seconds, 3) * 1000)


def _json_text(value: Any) -> str:
    """A free-form JSON object as canonical text (sorted keys, no spaces): one value, one text, on every retry."""
    return json.dumps(dict(value), sort_keys=True, separators=(",", ":"), allow_nan=False)


def _column(name: str, rows: Sequence[Located]) -> list[Any]:
    """One column's values, in row order (a comprehension per column: the hot path of the sink)."""
    if name == "_topic":
        return [loc.topic for loc in rows]
    if name == "_partition":
        return [loc.partition for loc in rows]
    if name == "_offset":
        return [loc.offset for loc in rows]
    values = [getattr(loc.event, name) for loc in rows]
    if name == "ts":
        return [_ticks(v) for v in values]
    if name in ("args", "config"):  # free-form object: stored as canonical JSON text
        return [_json_text(v) for v in values]
    if name == "summary":  # run.summary: the same text, NULL when the event carries none
        return [None if v is None else _json_text(v) for v in values]
    if name == "metrics":
        return [dict(v) for v in values]
    if name in ("verdicts", "dissenters", "tags", "non_finite", "sample_ids"):
        return [list(v) if v is not None else [] for v in values]
    return values


def build_columns(table: Table, rows: Sequence[Located]) -> tuple[tuple[str, ...], list[list[Any]]]:
    """(column names, one list per column) for `client.insert(..., column_oriented=True)`.

    Every row must belong to `table` (or to the table it is projected from);
    the provenance columns `_topic`, `_partition`, `_offset` come from the log
    position.
    """
    for loc in rows:
        if loc.event.type != table.event_type:
            raise ValueError(f"a {loc.event.type!r} event cannot go into table {table.name}")
    names = table.insert_columns
    if table.projected:
        return names, _sample_columns(names, rows)
    return names, [_column(name, rows) for name in names]


SAMPLE_COLUMNS = ("sample", "prompt", "response", "verdict", "reward", "gold", "error_type")


def _sample_columns(names: Sequence[str], rows: Sequence[Located]) -> list[list[Any]]:
    """One row per sample; the event's own fields repeat on each of its samples."""
    located = [loc for loc in rows for _ in (loc.event.samples or ())]  # type: ignore[attr-defined]
    samples = [(i, s) for loc in rows for i, s in enumerate(loc.event.samples or ())]  # type: ignore[attr-defined]
    out = []
    for name in names:
        if name == "sample":
            out.append([i for i, _ in samples])
        elif name in ("prompt", "response", "gold", "error_type"):
            out.append([s.get(name, "") for _, s in samples])
        elif name in ("verdict", "reward"):
            out.append([s.get(name) for _, s in samples])
        else:
            out.append(_column(name, located))
    return out

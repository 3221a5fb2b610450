"""A typed step column is in every place it must be (docs/ARCHITECTURE.md, "Add a typed step column").

The one list is `TYPED_STEP_COLUMNS` (producers/contract/events.py), derived from `StepEvent`'s
fields. Derived from it, so not checked here by name: the names `run.log` fills a column by and
the column's integer rounding and bounds (producers/client/aliases.py), the rank means of
`step_aggregates` / `v_step_means` (sinks/step_means.py) and the report's step keys. What cannot
be derived is held to it here: the `steps` table (sinks/schema.py), the migration that brings an
existing store to it (sinks/migrations.py), the golden wire files, and the pages that name every
column (docs/CONTRACT.md, docs/CLICKHOUSE.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from areal_metrics.producers.client.aliases import BOUNDS, COLUMN_ALIASES, FRAMEWORK_NAMES, INT_COLUMNS
from areal_metrics.producers.client.coerce import split_step
from areal_metrics.producers.contract.events import TYPED_STEP_COLUMNS, StepEvent
from areal_metrics.analysis.report import STEP_COLUMNS
from areal_metrics.sinks.migrations import migrations
from areal_metrics.sinks.schema import TABLES_BY_NAME, SchemaOptions
from areal_metrics.sinks.step_means import MEAN_COLUMNS, backfill_sql, output_columns
from areal_metrics.sinks.step_means import create_statements as step_means_statements
from areal_metrics.sinks.step_means import drop_statements as step_means_drops

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GOLDEN_EVENTS = ROOT / "tests" / "data" / "golden" / "events.jsonl"

# History, fixed: the typed columns of the `steps` table migration 1 created, and those whose rank
# means migration 9's `step_aggregates` holds. A column added later reaches a store made before by
# a later migration (ADD COLUMN for the first, the aggregates rebuilt for the second).
MIGRATION_1_COLUMNS = frozenset({
    "reward", "reward_std", "entropy", "advantage_mean", "advantage_std", "kl", "clip_ratio", "loss", "lr",
    "grad_norm", "response_length", "tokens", "throughput", "latency_ms", "gpu_mem_bytes",
})
MIGRATION_9_MEANS = MIGRATION_1_COLUMNS | {"epoch"}


def _field_types() -> dict[str, msgspec.inspect.Type]:
    return {f.name: next(t for t in f.type.types if not isinstance(t, msgspec.inspect.NoneType))  # type: ignore[attr-defined]
            for f in msgspec.inspect.type_info(StepEvent).fields  # type: ignore[union-attr]
            if f.name in TYPED_STEP_COLUMNS}


def test_the_list_is_the_optional_numbers_of_a_step() -> None:
    types = _field_types()
    assert set(types) == set(TYPED_STEP_COLUMNS) and len(TYPED_STEP_COLUMNS) >= 16
    for name, t in types.items():
        assert isinstance(t, (msgspec.inspect.FloatType, msgspec.inspect.IntType)), name
        assert getattr(StepEvent(run_id="r", step=0, epoch=0), name) is None, f"{name} is optional"


def test_the_client_fills_every_column_by_its_own_name() -> None:
    assert tuple(COLUMN_ALIASES) == TYPED_STEP_COLUMNS
    assert set(FRAMEWORK_NAMES) <= set(TYPED_STEP_COLUMNS)
    parts = split_step({c: 1 for c in TYPED_STEP_COLUMNS})
    assert parts.columns == {c: 1 for c in TYPED_STEP_COLUMNS} and not parts.metrics
    assert INT_COLUMNS == {c for c, t in _field_types().items() if isinstance(t, msgspec.inspect.IntType)}
    assert set(BOUNDS) == set(TYPED_STEP_COLUMNS)  # every column's bounds, read from StepEvent
    assert BOUNDS["clip_ratio"] == (0, 1) and BOUNDS["tokens"] == (0, 2**63 - 1) and BOUNDS["n_samples"] == (0, 2**32 - 1)
    assert BOUNDS["reward"] == (-1e100, 1e100)


def test_the_steps_table_has_a_nullable_column_of_the_fields_kind() -> None:
    columns = {c.name: c.type for c in TABLES_BY_NAME["steps"].columns}
    for name, t in _field_types().items():
        kind = "UInt64" if isinstance(t, msgspec.inspect.IntType) else "Float64"
        assert columns.get(name) == f"Nullable({kind})", (
            f"sinks/schema.py: steps has no `{name} Nullable({kind})` (it has {columns.get(name)})")


def test_the_rank_means_cover_every_column_but_the_weight() -> None:
    assert set(MEAN_COLUMNS) == (set(TYPED_STEP_COLUMNS) - {"n_samples"}) | {"epoch"}
    assert set(STEP_COLUMNS) == set(MEAN_COLUMNS)
    out = set(output_columns())
    for c in TYPED_STEP_COLUMNS:
        assert c in out, f"v_step_means has no {c}"


def _statements() -> list[tuple[int, str]]:
    return [(version, stmt) for version, _, stmts in migrations(SchemaOptions()) for stmt in stmts
            if isinstance(stmt, str)]


def test_a_store_made_before_a_column_gets_it_from_a_migration() -> None:
    added = {m for _, s in _statements()
             for m in re.findall(r"ALTER TABLE \w+\.steps ADD COLUMN IF NOT EXISTS `(\w+)`", s)}
    missing = set(TYPED_STEP_COLUMNS) - MIGRATION_1_COLUMNS - added
    assert not missing, f"sinks/migrations.py: no migration adds {sorted(missing)} to steps (_add_columns)"


def test_aggregates_made_before_a_column_are_rebuilt_by_a_later_migration() -> None:
    o = SchemaOptions()
    rebuilt = [v for v, _, stmts in migrations(o) if v > 9
               and all(s in stmts for s in [*step_means_drops(o), *step_means_statements(o), backfill_sql(o)])]
    new = set(MEAN_COLUMNS) - MIGRATION_9_MEANS
    assert not new or rebuilt, (
        f"sinks/migrations.py: {sorted(new)} came after migration 9's step_aggregates; a later migration must "
        "drop and rebuild them (step_means drop_statements, create_statements, backfill_sql)")


def test_the_golden_step_events_set_every_column() -> None:
    lines = [json.loads(line) for line in GOLDEN_EVENTS.read_bytes().splitlines()]
    written = {k for line in lines if line["type"] == "step" for k in line}
    missing = set(TYPED_STEP_COLUMNS) - written
    assert not missing, f"tests/data/golden/events.jsonl: no step line sets {sorted(missing)}"


def _paragraph(page: str, start: str) -> str:
    text = (DOCS / page).read_text()
    at = text.index(start)
    return text[at:text.find("\n\n", at)]


@pytest.mark.parametrize(("page", "start", "pattern"), [
    ("CONTRACT.md", "`step`: `step` (int", "`{c}`"),
    ("CLICKHOUSE.md", "| `steps` | `v_steps` |", "`{c}` Nullable({kind})"),
])
def test_the_pages_name_every_column(page: str, start: str, pattern: str) -> None:
    where = _paragraph(page, start).split("\n| `evals`")[0]
    for c, t in _field_types().items():
        kind = "UInt64" if isinstance(t, msgspec.inspect.IntType) else "Float64"
        assert pattern.format(c=c, kind=kind) in where, f"docs/{page}: the step columns do not name `{c}`"

"""The ClickHouse datasource as the Grafana foundation SDK sees it.

The SDK (grafana-foundation-sdk, Grafana 11.6 types) ships no types for the
`grafana-clickhouse-datasource` plugin, so this module adds them the way the
SDK adds its own: a `Dataquery` variant (the query model the plugin stores in
a panel target: `editorType`, `rawSql`, `format`, ...), a builder for it, and
a registration with the SDK runtime so `Dashboard.from_json` revives our
targets as typed objects instead of an untyped bag.

Each query also carries `expects`: the column names the panel reads from its
result. It is not part of the JSON Grafana stores; tests run every query
against ClickHouse and check that these columns come back.
"""

from __future__ import annotations

import enum
import typing

from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import runtime as cogruntime
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import dashboard

PLUGIN_ID = "grafana-clickhouse-datasource"
PLUGIN_VERSION = "4.10.2"  # pinned in compose.yaml (GF_INSTALL_PLUGINS) as well
DATASOURCE_UID = "areal-clickhouse"  # fixed uid: provisioning and dashboards agree on it
DATASOURCE_NAME = "ClickHouse (areal)"
DATABASE = "areal"  # the database every dashboard query names (provisioning's default database too)


def view(table: str) -> str:
    """What a dashboard reads for a table: its deduplicated view (`areal_metrics.sinks.views`), in DATABASE."""
    return f"{DATABASE}.v_{table}"


def view_of_chosen_runs(name: str, when: str | None = None) -> str:
    """A parameterized view (`v_<name>_of(runs = [...])`) given the dashboard's chosen runs: every read
    inside it, its check for rows delivered twice included, narrowed to them. `when`: a condition (constant
    for the query) under which it gets them, else no run: a branch of a query that is not taken then reads
    nothing, where a false WHERE would still build the view's IN sets."""
    runs = "[${run:singlequote}]"
    return f"{view(name + '_of')}(runs = {runs if when is None else f'if({when}, {runs}, [])'})"


def stored(name: str) -> str:
    """A table itself, in DATABASE (for reads that need no deduplication: which run ids exist)."""
    return f"{DATABASE}.{name}"


def datasource_ref() -> dashboard.DataSourceRef:
    return dashboard.DataSourceRef(type_val=PLUGIN_ID, uid=DATASOURCE_UID)


class Format(enum.IntEnum):
    """sqlds result formats the plugin understands (`format` in the target)."""

    TIME_SERIES = 0  # long frames with a time column become wide series
    TABLE = 1


class ClickHouseQuery(cogvariants.Dataquery):
    """One SQL query of the ClickHouse plugin, as stored in a panel target."""

    ref_id: str
    raw_sql: str
    format: Format
    editor_type: str
    hide: bool | None
    datasource: dashboard.DataSourceRef | None
    expects: tuple[str, ...]

    def __init__(
        self,
        ref_id: str = "A",
        raw_sql: str = "",
        format: Format = Format.TABLE,
        editor_type: str = "sql",
        hide: bool | None = None,
        datasource: dashboard.DataSourceRef | None = None,
        expects: tuple[str, ...] = (),
    ) -> None:
        self.ref_id = ref_id
        self.raw_sql = raw_sql
        self.format = Format(format)
        self.editor_type = editor_type
        self.hide = hide
        self.datasource = datasource
        self.expects = tuple(expects)

    def to_json(self) -> dict[str, object]:
        payload: dict[str, object] = {
            "refId": self.ref_id,
            "editorType": self.editor_type,
            "rawSql": self.raw_sql,
            "format": int(self.format),
            "pluginVersion": PLUGIN_VERSION,
        }
        if self.datasource is not None:
            payload["datasource"] = self.datasource
        if self.hide is not None:
            payload["hide"] = self.hide
        return payload

    @classmethod
    def from_json(cls, data: dict[str, typing.Any]) -> typing.Self:
        datasource = data.get("datasource")
        return cls(
            ref_id=data.get("refId", "A"),
            raw_sql=data.get("rawSql", ""),
            format=Format(data.get("format", Format.TABLE)),
            editor_type=data.get("editorType", "sql"),
            hide=data.get("hide"),
            datasource=dashboard.DataSourceRef.from_json(datasource) if datasource is not None else None,
        )


class SQL(cogbuilder.Builder[ClickHouseQuery]):
    """Builder: `SQL("SELECT ...", expects=("time", "reward")).ref_id("B")`."""

    def __init__(self, raw_sql: str, *, expects: tuple[str, ...], format: Format = Format.TABLE) -> None:
        self._internal = ClickHouseQuery(raw_sql=raw_sql, format=format, datasource=datasource_ref(), expects=expects)

    def build(self) -> ClickHouseQuery:
        return self._internal

    def ref_id(self, ref_id: str) -> typing.Self:
        self._internal.ref_id = ref_id
        return self


class ClickHouseAnnotationTarget(dashboard.AnnotationTarget):
    """An annotation whose events come from a ClickHouse query.

    The SDK's AnnotationTarget only knows the fields of Grafana's built-in
    annotation store; a datasource annotation stores a normal query there
    (columns `time`, `title`, `text`, `tags`), so this subclass serialises the
    ClickHouse query instead.
    """

    def __init__(self, query: ClickHouseQuery) -> None:
        super().__init__()
        self.query = query

    def to_json(self) -> dict[str, object]:
        return self.query.to_json()


class AnnotationTarget(cogbuilder.Builder[dashboard.AnnotationTarget]):
    def __init__(self, query: SQL) -> None:
        self._internal = ClickHouseAnnotationTarget(query.ref_id("Anno").build())

    def build(self) -> dashboard.AnnotationTarget:
        return self._internal


def variant_config() -> cogruntime.DataqueryConfig:
    return cogruntime.DataqueryConfig(identifier=PLUGIN_ID, from_json_hook=ClickHouseQuery.from_json)


def register() -> None:
    """Teach the SDK runtime our query type (and its own panel types) for from_json."""
    register_default_plugins()
    cogruntime.register_dataquery_variant(variant_config())

"""Macro and template-variable expansion, compared with what Grafana and the ClickHouse plugin produce.

Expected strings follow the plugin's pkg/macros/macros.go and its frontend
tests (CHDatasource.test.ts, 'Conditional All'), and Grafana's variable
formats (singlequote, csv, sqlstring, ...).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_metrics.grafana.macros import (
    ALL,
    MacroError,
    QueryContext,
    Variable,
    apply_conditional_all,
    auto_interval,
    expand,
    expand_macros,
    interval_text,
    replace_variables,
)

START = datetime(2026, 11, 30, 12, 0, 0, 123000, tzinfo=timezone.utc)
END = datetime(2026, 11, 30, 13, 0, 0, 456000, tzinfo=timezone.utc)
S, E = int(START.timestamp()), int(END.timestamp())
MS_S, MS_E = int(START.timestamp() * 1000), int(END.timestamp() * 1000)


def ctx(interval: timedelta = timedelta(seconds=10), **variables: Variable) -> QueryContext:
    return QueryContext(START, END, interval, variables)


# ------------------------------------------------------------ backend macros


def test_time_filter_macros_match_the_plugin() -> None:
    c = ctx()
    assert expand_macros("$__timeFilter(ts)", c) == f"ts >= toDateTime({S}) AND ts <= toDateTime({E})"
    assert expand_macros("$__timeFilter_ms(ts)", c) == (
        f"ts >= fromUnixTimestamp64Milli({MS_S}) AND ts <= fromUnixTimestamp64Milli({MS_E})"
    )
    assert expand_macros("$__fromTime", c) == f"toDateTime({S})"
    assert expand_macros("$__toTime", c) == f"toDateTime({E})"
    assert expand_macros("$__fromTime_ms AND $__toTime_ms", c) == (
        f"fromUnixTimestamp64Milli({MS_S}) AND fromUnixTimestamp64Milli({MS_E})"
    )
    assert expand_macros("$__dateFilter(d)", c) == "d >= toDate('2026-11-30') AND d <= toDate('2026-11-30')"
    assert expand_macros("$__timeFrom(ts) AND $__timeTo(ts)", c) == f"ts >= toDateTime({S}) AND ts <= toDateTime({E})"
    assert expand_macros("$__dateTimeFilter(d, t)", c) == (
        "(d >= toDate('2026-11-30') AND d <= toDate('2026-11-30')) AND "
        f"(t >= toDateTime({S}) AND t <= toDateTime({E}))"
    )


def test_interval_macros_match_the_plugin() -> None:
    assert expand_macros("$__timeInterval(ts)", ctx()) == "toStartOfInterval(toDateTime(ts), INTERVAL 10 second)"
    assert expand_macros("$__timeInterval_ms(ts)", ctx(timedelta(milliseconds=250))) == (
        "toStartOfInterval(toDateTime64(ts, 3), INTERVAL 250 millisecond)"
    )
    # below one second the plugin still buckets by whole seconds, at least 1
    assert expand_macros("$__timeInterval(ts)", ctx(timedelta(milliseconds=200))) == (
        "toStartOfInterval(toDateTime(ts), INTERVAL 1 second)"
    )
    assert expand_macros("count() / $__interval_s", ctx(timedelta(minutes=2))) == "count() / 120"
    assert expand_macros("$__interval_s", ctx(timedelta(milliseconds=20))) == "1"
    assert expand_macros("$__timeGroup(ts, '5m')", ctx()) == "toStartOfInterval(toDateTime(ts), INTERVAL 300 second)"


def test_macro_arguments_may_hold_expressions_and_nested_macros() -> None:
    got = expand_macros("$__timeInterval(toDateTime64(ts, 3)) AND $__timeFilter(coalesce(a, b))", ctx())
    assert got == (
        "toStartOfInterval(toDateTime(toDateTime64(ts, 3)), INTERVAL 10 second) AND "
        f"coalesce(a, b) >= toDateTime({S}) AND coalesce(a, b) <= toDateTime({E})"
    )
    assert expand_macros("$__timeFilter($__fromTime)", ctx()).startswith(f"toDateTime({S}) >= ")


def test_macros_in_strings_and_comments_stay_and_unknown_macros_are_left_alone() -> None:
    sql = "SELECT '$__timeFilter(x)' AS s -- $__fromTime\n, $__nope(x) /* $__toTime */ FROM t"
    assert expand_macros(sql, ctx()) == sql


def test_wrong_argument_counts_are_errors_like_the_plugin() -> None:
    with pytest.raises(MacroError, match="timeFilter expected 1"):
        expand_macros("$__timeFilter(a, b)", ctx())
    with pytest.raises(MacroError, match="timeInterval expected 1"):
        expand_macros("$__timeInterval", ctx())
    with pytest.raises(MacroError, match="unbalanced"):
        expand_macros("$__timeFilter(ts", ctx())


# ------------------------------------------------------- template variables

RUNS = Variable("run", ("r1", "r2"), options=("r1", "r2", "r3"))
ONE = Variable("node", "n1", options=("n1", "n2"))
EVERY = Variable("dataset", ALL, options=("math500", "aime24"))


def test_variable_syntaxes_and_the_plugins_default_format() -> None:
    c = ctx(run=RUNS, node=ONE, dataset=EVERY)
    assert replace_variables("$node ${node} [[node]]", c) == "n1 n1 n1"  # single value: raw
    assert replace_variables("IN ($run)", c) == "IN ('r1','r2')"  # multi value: the plugin quotes
    assert replace_variables("IN (${dataset})", c) == "IN ('math500','aime24')"  # All: every option


def test_named_formats() -> None:
    tricky = Variable("v", ("it's", "b"))
    c = ctx(v=tricky, node=ONE)
    assert replace_variables("${v:singlequote}", c) == "'it\\'s','b'"
    assert replace_variables("${v:sqlstring}", c) == "'it''s','b'"
    assert replace_variables("${v:doublequote}", c) == '"it\'s","b"'
    assert replace_variables("${v:csv} ${v:raw} ${v:pipe}", c) == "it's,b it's,b it's|b"
    assert replace_variables("${node:singlequote} [[node:sqlstring]]", c) == "'n1' 'n1'"
    assert replace_variables("${v:json}", c) == '["it\'s", "b"]'
    with pytest.raises(MacroError, match="unknown variable format"):
        replace_variables("${v:nosuch}", c)


def test_all_with_a_custom_all_value_is_inserted_raw() -> None:
    var = Variable("node", ALL, options=("a", "b"), all_value=".*")
    assert replace_variables("match(node, '${node:singlequote}')", ctx(node=var)) == "match(node, '.*')"


def test_unknown_variables_and_backend_macros_are_left_for_later() -> None:
    c = ctx()
    assert replace_variables("$nosuch ${other} $__timeFilter(ts) $__interval_s", c) == (
        "$nosuch ${other} $__timeFilter(ts) $__interval_s"
    )


def test_grafana_builtins() -> None:
    c = ctx(timedelta(seconds=30))
    assert replace_variables("$__from ${__to}", c) == f"{MS_S} {MS_E}"
    assert replace_variables("${__from:date:seconds}", c) == str(S)
    assert replace_variables("${__from:date:iso}", c) == "2026-11-30T12:00:00.123Z"
    assert replace_variables("$__interval $__interval_ms $__range_s", c) == "30s 30000 3600"


def test_interval_text_and_auto_interval() -> None:
    assert [interval_text(timedelta(milliseconds=m)) for m in (200, 1000, 90_000, 7_200_000)] == ["200ms", "1s", "1m", "2h"]
    assert auto_interval(START, START + timedelta(hours=1), 1000) == timedelta(seconds=5)  # 3.6 s -> 5 s
    assert auto_interval(START, START + timedelta(minutes=1), 1000, timedelta(seconds=1)) == timedelta(seconds=1)


# --------------------------------------------------------- $__conditionalAll


def test_conditional_all_like_the_plugin_frontend() -> None:
    sql = "select stuff from table where $__conditionalAll(fieldVal in ($fieldVal), $fieldVal);"
    all_selected = {"fieldVal": Variable("fieldVal", ALL)}
    some = {"fieldVal": Variable("fieldVal", ("val1", "val2"))}
    assert apply_conditional_all(sql, all_selected) == "select stuff from table where 1=1;"
    assert apply_conditional_all(sql, some) == "select stuff from table where fieldVal in ($fieldVal);"
    both = (
        "where $__conditionalAll(fieldVal in ($fieldVal), $fieldVal) and "
        "$__conditionalAll(fieldVal in ($fieldVal2), ${fieldVal2});"
    )
    mixed = {"fieldVal": Variable("fieldVal", ("a",)), "fieldVal2": Variable("fieldVal2", ALL)}
    assert apply_conditional_all(both, mixed) == "where fieldVal in ($fieldVal) and 1=1;"
    empty = {"v": Variable("v", ())}
    assert apply_conditional_all("$__conditionalAll(x IN ($v), $v)", empty) == "1=1"


def test_full_pipeline_order_conditional_all_then_variables_then_macros() -> None:
    sql = (
        "SELECT $__timeInterval(ts) AS time FROM t WHERE $__timeFilter(ts) "
        "AND run_id IN (${run:singlequote}) AND $__conditionalAll(node IN (${node:singlequote}), $node) "
        "AND $__conditionalAll(dataset IN (${dataset:singlequote}), $dataset)"
    )
    got = expand(sql, ctx(run=RUNS, node=ONE, dataset=EVERY))
    assert got == (
        "SELECT toStartOfInterval(toDateTime(ts), INTERVAL 10 second) AS time FROM t "
        f"WHERE ts >= toDateTime({S}) AND ts <= toDateTime({E}) "
        "AND run_id IN ('r1','r2') AND node IN ('n1') AND 1=1"
    )
    assert "$" not in got


def test_context_needs_aware_times() -> None:
    with pytest.raises(ValueError):
        QueryContext(datetime(2026, 1, 1), END)


def _parse_quoted_list(text: str) -> list[str]:
    """Read 'a','b\\'c' the way ClickHouse reads string literals with backslash escapes."""
    values, i = [], 0
    while i < len(text):
        assert text[i] == "'", text
        i, value = i + 1, []
        while text[i] != "'":
            if text[i] == "\\":
                i += 1
            value.append(text[i])
            i += 1
        values.append("".join(value))
        i += 1
        if i < len(text):
            assert text[i] == ",", text
            i += 1
    return values


@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="\\", blacklist_categories=("Cs",)), min_size=1),
                min_size=1, max_size=5))
def test_singlequote_values_read_back_as_the_same_values(values: list[str]) -> None:
    """`${v:singlequote}` is a list of literals that a SQL reader turns back into exactly the values."""
    got = replace_variables("${v:singlequote}", ctx(v=Variable("v", tuple(values))))
    assert _parse_quoted_list(got) == values

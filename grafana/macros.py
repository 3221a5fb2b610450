"""Turn a panel's SQL into the SQL ClickHouse runs, the way Grafana does.

A ClickHouse panel query passes through three hands before it reaches the
server, and this module repeats each one so tests can run every panel's query
against a real ClickHouse engine:

1. the plugin's frontend resolves ``$__conditionalAll(condition, $var)`` to
   ``1=1`` when ``$var`` is "All" (or empty), else to ``condition``
   (``CHDatasource.applyConditionalAll``);
2. Grafana's template service replaces ``$var``, ``${var}``, ``${var:fmt}``
   and ``[[var]]`` with the current values, formatting multi-value variables
   with the plugin's default (``'a','b'``) unless a format is named, and the
   built-ins ``$__from``, ``$__to``, ``$__interval``, ``$__interval_ms``,
   ``$__range_s``;
3. the plugin's backend expands the ``$__`` macros (``pkg/macros/macros.go``):
   ``$__timeFilter(col)`` -> ``col >= toDateTime(from) AND col <= toDateTime(to)``,
   ``$__timeFilter_ms``, ``$__fromTime``/``$__toTime`` (and ``_ms``),
   ``$__timeInterval(col)`` (and ``_ms``), ``$__interval_s``, ``$__dateFilter``,
   ``$__timeFrom``/``$__timeTo``, ``$__timeGroup``. Unknown macros stay as
   they are, as in the plugin (and then fail in ClickHouse, loudly).

Pure functions, no Grafana and no ClickHouse needed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from areal_metrics.producers.contract.errors import UserError

ALL = "$__all"  # the value Grafana stores when "All" is selected


class MacroError(UserError, ValueError):
    """A macro or variable the plugin would reject (bad arguments, unknown format)."""


@dataclass(frozen=True)
class Variable:
    """A dashboard variable with its current selection.

    `value` is a string for a single-value variable, a tuple for a multi-value
    one (Grafana stores a list), or ``ALL``. `options` are the values the
    variable's query returned; "All" without a custom `all_value` means them.
    """

    name: str
    value: str | tuple[str, ...]
    options: tuple[str, ...] = ()
    all_value: str | None = None

    @property
    def is_all(self) -> bool:
        return self.value == ALL or self.value == (ALL,)


@dataclass(frozen=True)
class QueryContext:
    """What Grafana sends with a query: time range, interval and variables."""

    start: datetime
    end: datetime
    interval: timedelta = timedelta(seconds=1)
    variables: Mapping[str, Variable] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.start.tzinfo is None or self.end.tzinfo is None:
            raise ValueError("QueryContext times must be timezone-aware")


def expand(raw_sql: str, ctx: QueryContext) -> str:
    """The SQL that ClickHouse receives for `raw_sql` in context `ctx`."""
    return expand_macros(frontend(raw_sql, ctx), ctx)


def frontend(raw_sql: str, ctx: QueryContext) -> str:
    """Steps 1 and 2 only: what the browser sends to Grafana's /api/ds/query (macros still in)."""
    return replace_variables(apply_conditional_all(raw_sql, ctx.variables), ctx)


# ------------------------------------------------- 1. $__conditionalAll (frontend)

_CONDITIONAL_ALL = "$__conditionalAll("
_VAR_IN_ARG = re.compile(r"(?<=\$\{)\w+(?=\})|(?<=\$)\w+")


def apply_conditional_all(sql: str, variables: Mapping[str, Variable]) -> str:
    """Resolve ``$__conditionalAll(cond, $var)``, innermost-last as the plugin does."""
    index = sql.rfind(_CONDITIONAL_ALL)
    while index != -1:
        open_paren = index + len(_CONDITIONAL_ALL) - 1
        args, close = _frontend_macro_args(sql, open_paren)
        if len(args) != 2:
            raise MacroError(f"$__conditionalAll expects 2 arguments, received {len(args)}")
        phrase = args[0]
        named = _VAR_IN_ARG.search(args[1].strip())
        if named:
            variable = variables.get(named.group(0))
            if variable is not None and (variable.is_all or variable.value in ("", ())):
                phrase = "1=1"
        sql = sql[:index] + phrase + sql[close + 1 :]
        index = sql.rfind(_CONDITIONAL_ALL)
    return sql


def _frontend_macro_args(sql: str, open_paren: int) -> tuple[list[str], int]:
    """Arguments split at top-level commas (the plugin ignores quotes here)."""
    depth, start, args = 0, open_paren + 1, []
    for pos in range(open_paren, len(sql)):
        ch = sql[pos]
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                args.append(sql[start:pos])
                return args, pos
        elif ch == "," and depth == 1:
            args.append(sql[start:pos])
            start = pos + 1
    raise MacroError(f"unbalanced parentheses after {sql[open_paren - 20:open_paren + 1]!r}")


# --------------------------------------------- 2. template variables (Grafana)

# Grafana's variableRegex: $var | [[var:fmt]] | ${var.path:fmt}
_VARIABLE = re.compile(r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\$\{(\w+)(?:\.([^:^\}]+))?(?::([^\}]+))?\}")


def _quote_each(values: list[str], quote: str, escaped: str) -> str:
    return ",".join(f"{quote}{v.replace(quote, escaped)}{quote}" for v in values)


_FORMATS: dict[str, Callable[[list[str], bool], str]] = {
    # name -> formatter(values, was_multi)
    "raw": lambda vs, multi: ",".join(vs),
    "csv": lambda vs, multi: ",".join(vs),
    "text": lambda vs, multi: " + ".join(vs),
    "pipe": lambda vs, multi: "|".join(vs),
    "singlequote": lambda vs, multi: _quote_each(vs, "'", "\\'"),
    "doublequote": lambda vs, multi: _quote_each(vs, '"', '\\"'),
    "sqlstring": lambda vs, multi: _quote_each(vs, "'", "''"),
    "json": lambda vs, multi: json.dumps(vs if multi else vs[0]),
}


def _plugin_default_format(values: list[str], multi: bool) -> str:
    """CHDatasource.format: arrays become 'a','b' (unescaped); strings stay raw."""
    return "'" + "','".join(values) + "'" if multi else values[0]


def replace_variables(sql: str, ctx: QueryContext) -> str:
    def substitute(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(4)
        fmt = match.group(3) or match.group(6)
        if name.startswith("__"):
            return _builtin(name, fmt, ctx) or match.group(0)
        variable = ctx.variables.get(name)
        if variable is None:
            return match.group(0)  # Grafana leaves unknown variables as written
        if variable.is_all:
            if variable.all_value is not None and fmt != "text":
                return replace_variables(variable.all_value, ctx)
            values, multi = list(variable.options), True
        elif isinstance(variable.value, tuple):
            values, multi = list(variable.value), True
        else:
            values, multi = [variable.value], False
        if not values:
            return ""
        if fmt is None:
            return _plugin_default_format(values, multi)
        formatter = _FORMATS.get(fmt)
        if formatter is None:
            raise MacroError(f"unknown variable format {fmt!r} in {match.group(0)}")
        return formatter(values, multi)

    return _VARIABLE.sub(substitute, sql)


def _builtin(name: str, fmt: str | None, ctx: QueryContext) -> str | None:
    span = ctx.end - ctx.start
    if name in ("__from", "__to"):
        moment = ctx.start if name == "__from" else ctx.end
        if fmt is None:
            return str(_ms(moment))
        if fmt == "date:seconds":
            return str(int(moment.timestamp()))
        if fmt in ("date", "date:iso"):
            return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
        raise MacroError(f"unsupported format {fmt!r} for ${name}")
    if name == "__interval":
        return interval_text(ctx.interval)
    if name == "__interval_ms":
        return str(int(ctx.interval / timedelta(milliseconds=1)))
    if name == "__range_s":
        return str(int(span.total_seconds()))
    if name == "__range_ms":
        return str(int(span / timedelta(milliseconds=1)))
    if name == "__range":
        return interval_text(span)
    return None  # a backend macro such as $__timeFilter: left for step 3


def interval_text(interval: timedelta) -> str:
    """Grafana's short interval text: 500ms, 10s, 2m, 1h, 1d."""
    ms = int(interval / timedelta(milliseconds=1))
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def _ms(moment: datetime) -> int:
    return int(round(moment.timestamp() * 1000))


# ------------------------------------------------ 3. $__ macros (plugin backend)


def _date_time(moment: datetime) -> str:
    return f"toDateTime({int(moment.timestamp())})"


def _date_time64(moment: datetime) -> str:
    return f"fromUnixTimestamp64Milli({_ms(moment)})"


def _date(moment: datetime) -> str:
    return f"toDate('{moment.astimezone(timezone.utc):%Y-%m-%d}')"


def _seconds(ctx: QueryContext) -> int:
    return int(max(ctx.interval.total_seconds(), 1))


def _one(name: str, args: list[str]) -> str:
    if len(args) != 1:
        raise MacroError(f"$__{name} expected 1 argument(s), received {len(args)}")
    return args[0]


def _time_group(ctx: QueryContext, args: list[str]) -> str:
    if len(args) != 2:
        raise MacroError(f"$__timeGroup expected 2 argument(s), received {len(args)}")
    seconds = _go_duration_seconds(args[1].strip().strip("'\""))
    return f"toStartOfInterval(toDateTime({args[0].strip()}), INTERVAL {seconds} second)"


def _go_duration_seconds(text: str) -> int:
    parts = re.fullmatch(r"((?:\d+(?:\.\d+)?(?:ms|s|m|h))+)", text)
    if not parts:
        raise MacroError(f"$__timeGroup: invalid interval {text!r}")
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    total = sum(float(n) * scale[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text))
    if total <= 0:
        raise MacroError(f"$__timeGroup: interval must be positive, got {text!r}")
    return int(round(total))


def _date_time_filter(ctx: QueryContext, args: list[str]) -> str:
    if len(args) != 2:
        raise MacroError(f"$__dateTimeFilter expected 2 argument(s), received {len(args)}")
    d, t = args
    return (
        f"({d} >= {_date(ctx.start)} AND {d} <= {_date(ctx.end)}) AND "
        f"({t} >= {_date_time(ctx.start)} AND {t} <= {_date_time(ctx.end)})"
    )


def _filter(col: str, low: str, high: str) -> str:
    return f"{col} >= {low} AND {col} <= {high}"


Macro = Callable[[QueryContext, list[str]], str]

MACROS: dict[str, Macro] = {
    "fromTime": lambda c, a: _date_time(c.start),
    "toTime": lambda c, a: _date_time(c.end),
    "fromTime_ms": lambda c, a: _date_time64(c.start),
    "toTime_ms": lambda c, a: _date_time64(c.end),
    "timeFilter": lambda c, a: _filter(_one("timeFilter", a), _date_time(c.start), _date_time(c.end)),
    "timeFilter_ms": lambda c, a: _filter(_one("timeFilter_ms", a), _date_time64(c.start), _date_time64(c.end)),
    "dateFilter": lambda c, a: _filter(_one("dateFilter", a), _date(c.start), _date(c.end)),
    "dateTimeFilter": _date_time_filter,
    "dt": _date_time_filter,
    "timeFrom": lambda c, a: f"{_one('timeFrom', a)} >= {_date_time(c.start)}",
    "timeTo": lambda c, a: f"{_one('timeTo', a)} <= {_date_time(c.end)}",
    "timeInterval": lambda c, a: (
        f"toStartOfInterval(toDateTime({_one('timeInterval', a)}), INTERVAL {_seconds(c)} second)"
    ),
    "timeInterval_ms": lambda c, a: (
        f"toStartOfInterval(toDateTime64({_one('timeInterval_ms', a)}, 3), "
        f"INTERVAL {max(int(c.interval / timedelta(milliseconds=1)), 1)} millisecond)"
    ),
    "interval_s": lambda c, a: str(_seconds(c)),
    "interval_ms": lambda c, a: str(int(c.interval / timedelta(milliseconds=1))),
    "timeGroup": _time_group,
}

_MACRO = re.compile(r"\$__(\w+)")


def expand_macros(sql: str, ctx: QueryContext) -> str:
    """Expand ``$__name`` / ``$__name(args)``, leaving strings and comments alone."""
    out: list[str] = []
    i, n = 0, len(sql)
    while i < n:
        ch = sql[i]
        if ch in "'\"`":
            j = _end_of_quoted(sql, i)
            out.append(sql[i:j])
            i = j
            continue
        if sql.startswith("--", i):
            j = sql.find("\n", i)
            j = n if j == -1 else j
            out.append(sql[i:j])
            i = j
            continue
        if sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            j = n if j == -1 else j + 2
            out.append(sql[i:j])
            i = j
            continue
        match = _MACRO.match(sql, i)
        if match is None:
            out.append(ch)
            i += 1
            continue
        handler = MACROS.get(match.group(1))
        if handler is None:
            out.append(match.group(0))  # unknown: unchanged, as the plugin does
            i = match.end()
            continue
        args: list[str] = []
        end = match.end()
        if end < n and sql[end] == "(":
            close = _closing_paren(sql, end)
            inner = expand_macros(sql[end + 1 : close], ctx)  # nested macros first
            args = [a.strip() for a in _split_top_level(inner)]
            end = close + 1
        out.append(handler(ctx, args))
        i = end
    return "".join(out)


def _end_of_quoted(sql: str, start: int) -> int:
    quote, i = sql[start], start + 1
    while i < len(sql):
        if sql[i] == "\\":
            i += 2
            continue
        if sql[i] == quote:
            if i + 1 < len(sql) and sql[i + 1] == quote:  # doubled quote escape
                i += 2
                continue
            return i + 1
        i += 1
    raise MacroError(f"unterminated {quote} quote at offset {start}")


def _closing_paren(sql: str, open_paren: int) -> int:
    depth, i = 0, open_paren
    while i < len(sql):
        ch = sql[i]
        if ch in "'\"`":
            i = _end_of_quoted(sql, i)
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise MacroError(f"unbalanced parentheses at offset {open_paren}")


def _split_top_level(text: str) -> list[str]:
    if not text.strip():
        return []
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch in "'\"`":
            i = _end_of_quoted(text, i)
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return parts


def auto_interval(start: datetime, end: datetime, max_data_points: int = 1000, min_interval: timedelta = timedelta(0)) -> timedelta:
    """Grafana's query interval: range / max data points, rounded to a nice step."""
    raw = (end - start) / max(max_data_points, 1)
    nice_ms = _round_interval_ms(raw / timedelta(milliseconds=1))
    return max(timedelta(milliseconds=nice_ms), min_interval)


def _round_interval_ms(ms: float) -> int:
    # rangeutil.roundInterval's table, condensed: the next "nice" step above ms
    steps = [1, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 15_000, 20_000, 30_000, 60_000, 120_000,
             300_000, 600_000, 900_000, 1_200_000, 1_800_000, 3_600_000, 7_200_000, 10_800_000, 21_600_000,
             43_200_000, 86_400_000]
    for step in steps:
        if ms <= step * 1.5:
            return step
    return int(math.ceil(ms / 86_400_000)) * 86_400_000

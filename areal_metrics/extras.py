"""Which extra installs a module, and what each verb needs of them: one line naming the extra,
exit 2, where the thin install (`pip install areal-metrics`: the client alone) meets a verb that
needs more (README: "each verb names the extra it needs").

`EXTRA_OF` holds the third-party modules the verbs import, by the extra of pyproject.toml that
installs them (tests/test_cli_first_week.py holds it to pyproject.toml). `VERB_NEEDS` is
checked before a verb runs; a module imported deeper (chdb for the embedded store, torch for
`train`) is named when its import fails (`from_import_error`).
"""

from __future__ import annotations

import importlib.util
import sys

from areal_metrics.producers.contract.errors import UserError

EXTRA_OF: dict[str, str] = {
    "faust": "stack", "clickhouse_connect": "stack", "chdb": "stack", "numpy": "stack", "rich": "stack",
    "matplotlib": "stack", "grafana_client": "stack", "grafana_foundation_sdk": "stack", "psutil": "stack",
    "torch": "train",
}

# verb (or "verb action") -> the modules it cannot start without
VERB_NEEDS: dict[str, tuple[str, ...]] = {
    "watch": ("rich",),
    "sql": ("clickhouse_connect",),
    "report": ("clickhouse_connect", "numpy", "matplotlib"),
    "compare": ("clickhouse_connect",),
    "replay": ("clickhouse_connect",),
    "grafana provision": ("grafana_foundation_sdk", "grafana_client"),
    "grafana generate": ("grafana_foundation_sdk",),
    "grafana check": ("grafana_foundation_sdk", "clickhouse_connect"),
    "train": ("torch",),
    "demo": ("faust", "clickhouse_connect", "chdb", "numpy", "rich", "matplotlib", "torch"),
}


def importable(module: str) -> bool:
    if module in sys.modules:  # imported already, or blocked with None (find_spec refuses an unset __spec__)
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install_hint(extras: list[str]) -> str:
    return f"pip install 'areal-metrics[{','.join(extras)}]'"


def missing_error(what: str, modules: list[str]) -> UserError:
    """`<what>` needs the `stack` extra (missing: rich): pip install 'areal-metrics[stack]'"""
    extras = list(dict.fromkeys(EXTRA_OF.get(m, "stack") for m in modules))
    named = " and ".join(f"`{e}`" for e in extras)
    return UserError(f"{what} needs the {named} extra{'s' if len(extras) > 1 else ''} "
                     f"(missing: {', '.join(modules)}): {install_hint(extras)}")


def check_verb(verb: str, action: str | None = None) -> None:
    """UserError naming the extra when a module the verb needs is not installed."""
    key = f"{verb} {action}" if action and f"{verb} {action}" in VERB_NEEDS else verb
    missing = [m for m in VERB_NEEDS.get(key, ()) if not importable(m)]
    if missing:
        raise missing_error(f"`{key}`", missing)


def from_import_error(exc: ImportError, verb: str) -> UserError | None:
    """The UserError for an import of an extra's module that failed inside a verb, else None (a real bug)."""
    top = (getattr(exc, "name", None) or "").split(".")[0]
    return missing_error(f"`{verb}`", [top]) if top in EXTRA_OF else None

"""One error tree: every exception class the project defines is an ArealError.

The CLI catches ArealError once (areal_metrics/cli.py) and exits with the class's
`exit_code`: 2 for bad input (UserError), 1 for a service that did not answer
(ServiceUnavailable); so every error raised on purpose must be under it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from areal_metrics.producers.contract.errors import ArealError, ServiceUnavailable, UserError

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("producers", "streams", "sinks", "areal_train", "grafana", "areal_metrics")


def exception_classes() -> list[tuple[str, str]]:
    """(module, class) of every class in the installed rooms that names an exception among its bases."""
    found = []
    for top in ROOMS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name == "__main__.py":
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            module = ".".join(parts if top == "areal_metrics" else ("areal_metrics", *parts)).removesuffix(".__init__")
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef) and any(
                        (getattr(b, "id", None) or getattr(b, "attr", "")).endswith(("Error", "Exception", "Locked",
                                                                                    "Refused", "Stopped", "Unavailable"))
                        for b in node.bases):
                    found.append((module, node.name))
    return found


def test_the_scan_finds_the_classes_it_must() -> None:
    names = {name for _, name in exception_classes()}
    assert {"StoreError", "SendError", "CheckpointError", "MacroError", "StateDecodeError", "ValidationError"} <= names


@pytest.mark.parametrize(("module", "name"), exception_classes())
def test_every_exception_class_is_an_areal_error(module: str, name: str) -> None:
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, ArealError), f"{module}.{name} is outside ArealError"


def test_exit_codes_follow_the_kind_of_error() -> None:
    from areal_metrics.producers.delivery.backends import SendError
    from areal_metrics.sinks.query import QueryError, StoreError, StoreUnavailable

    assert UserError.exit_code == 2 and QueryError.exit_code == 2 and issubclass(QueryError, UserError)
    assert StoreUnavailable.exit_code == 1 and issubclass(StoreUnavailable, ServiceUnavailable)
    assert issubclass(QueryError, StoreError) and issubclass(StoreUnavailable, StoreError)  # one to catch both
    assert ServiceUnavailable.exit_code == 1 and SendError.exit_code == 1


def test_one_line_is_written_once() -> None:
    """One helper per concern: every room puts a message on one line with the contract's `one_line`."""
    defined = [(path.relative_to(ROOT).as_posix(), node.name)
               for top in ROOMS for path in sorted((ROOT / top).rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef) and node.name == "one_line"]
    assert defined == [("producers/contract/errors.py", "one_line")]


def test_the_store_and_the_sink_escape_control_characters_as_the_cli_does() -> None:
    from areal_metrics.sinks.isolate import DataError
    from areal_metrics.sinks.query import store_message

    cause = ValueError("bad\x00value\n  here\x1b")
    assert str(DataError(cause)) == "ValueError: bad\\x00value here\\x1b"
    driver = Exception("HTTPDriver for http://h:8123 received ClickHouse error code 62\n server response: "
                       "Code: 62. DB::Exception: Syntax error\x07 FORMAT Native (version 24.1) (for url http://h)")
    assert store_message(driver) == "Code: 62. DB::Exception: Syntax error\\x07"

"""The verbs' errors as the README says them (issue 44, item 4).

- The sink's ClickHouse endpoint: a query with a syntax error is answered with an error that
  quotes the user's SQL, not the endpoint's `formatQuerySingleLine(...)` wrapper.
"""

from __future__ import annotations

from tests.test_clickhouse_http import Served, served  # noqa: F401 - the module's fixture: the real endpoint


def test_a_syntax_error_quotes_the_users_query_not_the_wrapper(served: Served) -> None:  # noqa: F811
    r = served.http({"query": "SELEC 1\n"})
    text = r.data.decode()
    assert r.status == 400 and r.getheader("X-ClickHouse-Exception-Code") == "62", text
    assert "formatQuerySingleLine" not in text, text
    assert text.startswith("Code: 62. DB::Exception: Syntax error") and ": in query: SELEC 1 (version" in text, text

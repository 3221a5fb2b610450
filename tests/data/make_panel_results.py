"""Record tests/data/panel_results.json: what every dashboard query and the report return on the demo run.

    PYTHONPATH=. .venv/bin/python tests/data/make_panel_results.py

Run it on the code whose numbers are the reference (tests/test_grafana_panel_numbers.py
says which commit the committed file comes from); that test compares the current code to it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from areal_metrics.grafana.queries import QueryRunner  # noqa: E402
from tests.test_grafana_data import fixture_events, fixture_span, loaded_store  # noqa: E402
from tests.test_grafana_panel_numbers import GOLDEN, capture  # noqa: E402


def main() -> int:
    start, end = fixture_span(fixture_events())
    span = (start - timedelta(minutes=5), end + timedelta(minutes=5))
    with tempfile.TemporaryDirectory() as directory, loaded_store(Path(directory)) as store:
        results = capture(QueryRunner.of_store(store), store, span)
    lines = [f"{json.dumps(key)}: {json.dumps(results[key], sort_keys=True)}" for key in sorted(results)]
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one query per line: readable diffs
    print(f"{GOLDEN}: {len(results)} queries")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The counts the docs give in words (dashboards, topics) are the code's: a dashboard or a topic
added without the docs following fails here. Also: SCALING.md advises no layout `replay` refuses."""

from __future__ import annotations

import re

from areal_metrics.grafana.catalog import BUILDERS, repo_root
from areal_metrics.producers.contract.topics import Topics

ROOT = repo_root()
WORDS = {w: i for i, w in enumerate(("zero one two three four five six seven eight nine ten eleven twelve").split())}
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "compose.yaml"]


def _counts(pattern: str) -> list[tuple[str, int]]:
    found = []
    for path in DOCS:
        for match in re.finditer(pattern, path.read_text(), flags=re.IGNORECASE):
            found.append((f"{path.name}: {match.group(0)!r}", WORDS[match.group(1).lower()]))
    return found


def test_the_docs_count_the_dashboards_and_topics_there_are() -> None:
    number = "(" + "|".join(WORDS) + ")"
    dashboards = _counts(rf"\b{number} (?:Grafana )?dashboards\b")
    topics = _counts(rf"\b{number} (?:`areal\.\*` )?topics\b")
    assert dashboards and topics  # the phrases this test reads are still there
    assert [(where, n) for where, n in dashboards if n != len(BUILDERS)] == []
    assert [(where, n) for where, n in topics if n != len(Topics("areal.").all())] == []


def test_compose_creates_every_topic() -> None:
    text = (ROOT / "compose.yaml").read_text()
    (loop,) = re.findall(r"for t in ([\w. ]+); do", text)
    assert sorted(f"areal.{t}" for t in loop.split()) == sorted(Topics("areal.").all())


def test_scaling_advises_no_layout_that_replay_refuses() -> None:
    scaling = (ROOT / "docs" / "SCALING.md").read_text()
    replay = (ROOT / "sinks" / "replay.py").read_text()
    assert "shards > 1" in replay  # replay refuses a cluster of several shards (no Distributed tables)...
    assert not re.search(r"\b([2-9]|two|three|four) shards\b", scaling)  # ...so the sizing advises none


def test_every_file_the_docs_name_is_there() -> None:
    """A file named in backticks (`grafana/alerting.py`) or linked is at that path: no stale links after a move."""
    top = "producers|streams|sinks|areal_train|grafana|areal_metrics|tests|tools|benchmarks|docs|deploy|docker|examples"
    named = rf"`((?:{top})/[\w./-]+\.(?:py|md|yaml|yml|json|jsonl|sh|toml))`"
    missing = []
    for path in DOCS:
        text = path.read_text()
        missing += [f"{path.name}: {m}" for m in re.findall(named, text) if not (ROOT / m).exists()]
        links = re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text)
        missing += [f"{path.name}: {m}" for m in links if "://" not in m and not (path.parent / m).exists()]
    assert missing == []

"""The report's evaluation details: figure 1 with pass@k, maj@k and greedy accuracy on request, and the
"what changed" table (prompts whose verdict flipped between a run's first and last round), from the
real embedded store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_metrics.cli import main
from areal_metrics.producers.contract.events import Event, EvalEvent
from areal_metrics.analysis.report import FILES, write_report
from areal_metrics.analysis.eval_details import CHANGES_FILE, load_consensus_metrics, load_flips, write_what_changed
from areal_metrics.sinks.query import DirectStore
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.processor import RunState, on_eval
from tests.test_grafana_data import loaded_store
from tests.test_report import recorded

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def with_consensus_of_today(events: list[Event]) -> list[Event]:
    """The recorded workload with its consensus results voted again by today's processor (which carries
    pass@K, maj@K and greedy_accuracy from the results' metrics)."""
    kept = [e for e in events if e.type != "eval_consensus"]
    states: dict[str, RunState] = {}
    derived: list[Event] = []
    for ev in sorted((e for e in kept if isinstance(e, EvalEvent)), key=lambda e: e.ts):
        state = states.get(ev.run_id) or RunState(ev.run_id)
        states[ev.run_id], outputs = on_eval(state, ev, ev.ts, RunConfig())
        derived.extend(o.event for o in outputs if o.event.type == "eval_consensus")
    return kept + derived


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectStore]:
    events = with_consensus_of_today(recorded()) + flipping_rounds()  # one chdb store per process
    with loaded_store(tmp_path_factory.mktemp("details-store"), events) as opened:
        yield opened


def test_figure_1_draws_pass_maj_and_greedy_on_request(store: DirectStore, tmp_path: Path) -> None:
    details = load_consensus_metrics(store, "1")
    assert set(details) == {"math_id", "math_hard"}
    points = details["math_id"]["wl-mt4-s1"]
    assert len(points) >= 2 and all({"pass@2", "maj@2"} <= set(m) for _, m in points)
    plain = write_report(tmp_path / "plain", None, store)
    drawn = write_report(tmp_path / "details", None, store, eval_details=True)
    assert [p.name for p in drawn] == [*FILES, CHANGES_FILE]
    figure = drawn[0].read_bytes()
    assert figure.startswith(PNG_MAGIC) and len(figure) > plain[0].stat().st_size  # a second row was drawn


def test_the_cli_flag_asks_for_the_details(store: DirectStore, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("areal_metrics.analysis.report.write_report.__defaults__", (None, store))
    assert main(["report", "--out", str(tmp_path), "--eval-details"]) == 0
    assert (tmp_path / FILES[0]).exists() and (tmp_path / CHANGES_FILE).exists()


def flipping_rounds() -> list[Event]:
    """Two nodes, two rounds of the same shown prompts: '2+2' right then wrong, '3+4' wrong then right,
    '5+5' right both times, '1+1' split 1-1 in the last round (undecided: no flip)."""
    def ev(node: str, step: int, verdicts: dict[str, int]) -> EvalEvent:
        golds = {"2+2": "4", "3+4": "7", "5+5": "10", "1+1": "2"}
        samples = [{"prompt": p, "response": golds[p] if v else "9", "verdict": v, "gold": golds[p],
                    "error_type": "" if v else "arithmetic"} for p, v in verdicts.items()]
        return EvalEvent(run_id="flip", node=node, eval_id=f"flip:{step}", step=step, dataset="d", accuracy=0.5,
                         verdicts=list(verdicts.values()), samples=samples, replicas=2, ts=1_700_000_000.0 + step)

    first = {"2+2": 1, "3+4": 0, "5+5": 1, "1+1": 1}
    return [ev("n0", 0, first), ev("n1", 0, first),
            ev("n0", 9, {"2+2": 0, "3+4": 1, "5+5": 1, "1+1": 0}), ev("n1", 9, {"2+2": 0, "3+4": 1, "5+5": 1, "1+1": 1})]


def test_what_changed_lists_the_prompts_whose_verdict_flipped(store: DirectStore, tmp_path: Path) -> None:
    flips = load_flips(store, "run_id = 'flip'")
    assert [(f.prompt, f.first_verdict, f.last_verdict, f.gold) for f in flips] == [("2+2", 1, 0, "4"),
                                                                                  ("3+4", 0, 1, "7")]
    assert flips[0].last_error == "arithmetic" and flips[1].first_error == "arithmetic"
    table = write_what_changed(flips, tmp_path / CHANGES_FILE).read_text()
    assert "| flip | d | 2+2 | 4 | step 0: right | step 9: wrong (arithmetic) | 9 |" in table
    assert "1 prompts became right, 1 became wrong." in table


def test_the_error_figure_has_a_row_per_round_that_adds_up_to_the_pooled_counts(store: DirectStore) -> None:
    from areal_metrics.analysis.report import load_errors
    from areal_metrics.analysis.eval_details import load_errors_by_round

    pooled, by_round = load_errors(store, "1"), load_errors_by_round(store, "1")
    assert sorted(by_round["math_id"]) == [0, 15, 20]  # the full rounds (the failed one at 10 has no result)
    for dataset, per_run in pooled.items():
        kinds = {k for counts in per_run.values() for k in counts}
        for kind in kinds:
            assert sum(r.get(kind, 0.0) for r in by_round[dataset].values()) == sum(
                c.get(kind, 0.0) for c in per_run.values())

"""`areal-metrics compare` against the real embedded store: the recorded workload, and groups built
so that the answer is known."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_metrics.cli import main
from areal_metrics.comparison import RunRound, compare, paired
from areal_metrics.producers.contract.events import Event, event_from_dict
from areal_metrics.sinks.query import DirectStore
from tests.test_grafana_data import loaded_store
from tests.test_report import recorded

N = 64


def _event(kind: str, run_id: str, node: str = "n0", **fields: Any) -> Event:
    return event_from_dict({"schema": 1, "type": kind, "event_id": uuid.uuid4().hex, "run_id": run_id,
                            "node": node, "rank": 0, "ts": 1_800_000_000.0, **fields})


def built_runs() -> list[Event]:
    """good/s1, good/s2 right on samples 0..39; base/s1 right on 0..29 plus 60..63, base/s2 like base/s1.
    Each run: 2 nodes; at step 20 the last full round; a stale repeat at step 30 that compare ignores."""
    events: list[Event] = []
    right = {"good": set(range(40)), "base": set(range(30)) | set(range(60, 64))}
    for group, ok in right.items():
        for seed in (1, 2):
            run = f"cmp-{group}-s{seed}"
            events.append(_event("run", run, status="running", group=group, world_size=2, config={"seed": seed}))
            for step in (10, 20):
                verdicts = [int(i in ok) if step == 20 else 0 for i in range(N)]
                eval_id = f"{run}:{step}:math:full"
                for r, node in enumerate(("n0", "n1")):
                    # n1 holds the second half first: a rotated window the `metrics` layout describes
                    order = list(range(N)) if r == 0 else [(i + N // 2) % N for i in range(N)]
                    turns = {"first_attempt_accuracy": sum(verdicts) / N}
                    if group == "good":  # a 4-turn strategy: later attempts solve 8 more samples
                        turns["solved_within_4_turns"] = (sum(verdicts) + 8 + seed) / N
                    events.append(_event("eval", run, node, eval_id=eval_id, step=step, dataset="math", stage="full",
                                         accuracy=sum(verdicts) / N, n_samples=N, replicas=2,
                                         verdicts=[verdicts[i] for i in order], dataset_fingerprint="fp",
                                         metrics={"shard_offset": float(order[0]), "shard_total": float(N),
                                                  "pass@4": 0.9, **turns}))
                events.append(_event("eval_consensus", run, "worker", eval_id=eval_id, step=step, dataset="math",
                                     stage="full", accuracy=sum(verdicts) / N, votes=2, replicas=2, agreement=1.0))
            events.append(_event("eval_consensus", run, "worker", eval_id=f"{run}:30:math:full", step=30,
                                 dataset="math", stage="full", accuracy=0.0, votes=0, replicas=2, agreement=0.0,
                                 stale=True))
    return events


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DirectStore, Path]]:
    directory = tmp_path_factory.mktemp("compare-store")
    with loaded_store(directory, recorded() + built_runs()) as opened:
        yield opened, directory


def test_known_groups(store: tuple[DirectStore, Path]) -> None:
    result = compare(store[0], "good", "base", "math", "full")
    good, base = result["groups"]
    assert (good["group"], good["runs"], good["mean"]) == ("good", 2, 40 / 64)
    assert good["ci_low"] == good["ci_high"] == 40 / 64  # two identical seeds: no spread
    assert math.isclose(base["mean"], 34 / 64)
    assert set(good["metrics"]) == {"first_attempt_accuracy", "solved_within_4_turns"}  # not pass@4
    solved = good["metrics"]["solved_within_4_turns"]
    assert solved["runs"] == 2 and math.isclose(solved["mean"], (40 + 8 + 1.5) / 64)
    assert solved["ci_low"] < solved["mean"] < solved["ci_high"]
    assert set(base["metrics"]) == {"first_attempt_accuracy"}
    paired = result["paired"]
    # discordant samples: 30..39 good only (10), 60..63 base only (4): exact sign test p = P(|X-7| >= 3), X~B(14,.5)
    expected = 2 * sum(math.comb(14, i) for i in range(5)) / 2**14
    assert (paired["n"], paired["a_better"], paired["b_better"]) == (64, 10, 4)
    assert math.isclose(paired["p_value"], expected)


def test_recorded_workload_json(store: tuple[DirectStore, Path], monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AREAL_CLICKHOUSE_URL", f"chdb://{store[1]}")
    assert main(["compare", "mt4-grpo", "mt2-grpo", "--dataset", "math_hard", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"dataset", "stage", "groups", "paired"}
    assert (out["dataset"], out["stage"]) == ("math_hard", "full")
    for g in out["groups"]:
        assert g["runs"] == 2 and 0 <= g["ci_low"] <= g["mean"] <= g["ci_high"] <= 1
    assert out["paired"]["n"] == 64 and 0 < out["paired"]["p_value"] <= 1
    assert main(["compare", "mt4-grpo", "mt2-grpo", "--dataset", "math_hard"]) == 0
    assert "paired" in capsys.readouterr().out


def test_bad_input_exits_2(store: tuple[DirectStore, Path], monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AREAL_CLICKHOUSE_URL", f"chdb://{store[1]}")
    assert main(["compare", "no-such", "mt2-grpo"]) == 2
    assert "GROUP_A 'no-such'" in capsys.readouterr().err
    assert main(["compare", "mt4-grpo", "mt2-grpo"]) == 2  # two shared datasets: which one?
    err = capsys.readouterr().err
    assert "--dataset" in err and "math_hard" in err and "Traceback" not in err
    assert main(["compare", "mt4-grpo", "mt2-grpo", "--dataset", "nope"]) == 2
    assert main(["compare", "good", "o'brien"]) == 2  # quotes are data, not SQL


def test_an_unreachable_store_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AREAL_CLICKHOUSE_URL", "http://127.0.0.1:9/areal")
    assert main(["compare", "a", "b"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


@given(st.lists(st.dictionaries(st.integers(0, 20), st.integers(0, 1), max_size=21), min_size=1, max_size=3),
       st.lists(st.dictionaries(st.integers(0, 20), st.integers(0, 1), max_size=21), min_size=1, max_size=3))
def test_the_paired_test_is_symmetric_and_counts_only_shared_samples(a: list[dict], b: list[dict]) -> None:
    ra = [RunRound(f"a{i}", 0.5, "e", 1, v, {"fp"}) for i, v in enumerate(a)]
    rb = [RunRound(f"b{i}", 0.5, "e", 1, v, {"fp"}) for i, v in enumerate(b)]
    ab, ba = paired(ra, rb), paired(rb, ra)
    shared = set().union(*a) & set().union(*b)
    assert ab["n"] == ba["n"] == len(shared)
    assert (ab["a_better"], ab["b_better"]) == (ba["b_better"], ba["a_better"])
    assert ab["p_value"] == ba["p_value"] and (ab["p_value"] is None) == (not shared)
    assert paired(ra, [RunRound("x", 0.5, "e", 1, dict(b[0]), {"other"})])["n"] == 0  # different sets: no test

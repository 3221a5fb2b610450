"""The report's intervals: figure 1's error bars from the store, figure 2's band over seeds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import scipy.stats

from areal_metrics.analysis.report import eval_interval, load_evals
from areal_metrics.analysis.figures import band
from areal_metrics.sinks.query import DirectStore
from areal_metrics.producers.contract.statistics import wilson
from tests.test_grafana_data import loaded_store
from tests.test_report import recorded


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectStore]:
    with loaded_store(tmp_path_factory.mktemp("intervals"), recorded()) as opened:
        yield opened


def test_every_full_round_of_the_recording_has_its_wilson_interval(store: DirectStore) -> None:
    evals = load_evals(store, "1")
    points = [p for per_run in evals.values() for pts in per_run.values() for p in pts if p.state != "stale"]
    assert points  # a stale round repeats an earlier result: no samples of its own, no bar
    for p in points:  # 32 prompts x 2 samples = 64 samples behind each round of the recording
        assert (p.ci_low, p.ci_high) == pytest.approx(wilson(p.accuracy, 64))
        assert p.ci_low <= p.accuracy <= p.ci_high


def test_the_consensus_interval_wins_over_wilson() -> None:
    assert eval_interval(0.3, 0.2, 0.45, 64) == (0.2, 0.45)
    assert eval_interval(0.3, None, None, 100) == pytest.approx(wilson(0.3, 100))
    assert eval_interval(0.3, None, None, None) == (None, None)


def test_the_reward_band_is_a_t_interval_over_seeds_not_the_range() -> None:
    seeds = [[(1, 0.2), (2, 0.3)], [(1, 0.3), (2, 0.3)], [(1, 0.25), (2, 0.3)]]
    steps, mean, low, high = band(seeds)
    assert steps == [1, 2] and mean[0] == pytest.approx(0.25)
    assert low[0] < 0.2 and high[0] > 0.3  # 4.303 * 0.05 / sqrt(3) = 0.124 on either side
    assert high[0] - mean[0] == pytest.approx(scipy.stats.t.ppf(0.975, 2) * 0.05 / 3 ** 0.5)
    assert low[1] == high[1] == pytest.approx(0.3)  # the seeds agree: no spread

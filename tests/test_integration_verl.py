"""verl's real `Tracking` (verl 0.9.1 from PyPI) with the areal-metrics backend, against the real broker and sink.

`install()` is called as the snippet says, then a process creates `Tracking`
as verl's trainer does (console backend beside ours) and logs verl's metric
names: each `log` is a step row with the names in the typed columns (the
seconds and GiB scaled), `group` the project and `run_id` the experiment, the
config verl's; `finish()` ends the run `finished`, `finish(exit_code=1)`
`failed`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from areal_metrics.producers.contract.topics import Topics
from tests import test_client_broker
from tests.integration_support import OFFLINE
from tests.support import ROOT, child_env, wait_for

sink = test_client_broker.sink  # the fixture: the real sink as a process, queried through its endpoint

pytestmark = [pytest.mark.broker, pytest.mark.timeout(600)]

SCRIPT = """
    from verl.utils.tracking import Tracking
    from areal_metrics.integrations import verl as am_verl

    am_verl.install(tags=["verl"], git=False)
    am_verl.install()  # twice: still one backend
    config = {"trainer": {"total_training_steps": 3, "logger": ["console"]}, "algorithm": {"adv_estimator": "grpo"}}
    tracking = Tracking(project_name="verl-proj", experiment_name="verl-exp", default_backend="console", config=config)
    for step in (1, 2, 3):  # verl's global_steps start at 1
        tracking.log(data={"critic/score/mean": 0.2 * step, "actor/entropy": 1.5, "actor/ppo_kl": 0.001 * step,
                           "actor/pg_clipfrac": 0.02, "actor/lr": 1e-6, "actor/grad_norm": 0.5,
                           "response_length/mean": 120.0, "perf/throughput": 900.0, "timing_s/step": 2.5,
                           "perf/max_memory_allocated_gb": 1.5, "timing_s/gen": 1.25}, step=step)
    tracking.finish()
    crashed = Tracking(project_name="verl-proj", experiment_name="verl-crash", default_backend="console")
    crashed.log(data={"critic/score/mean": 0.0}, step=1)
    crashed.finish(exit_code=1)
    print("logged", sorted(tracking.logger), sorted(crashed.logger))
"""


def test_what_verl_tracking_logs_reaches_clickhouse(stack_env: dict[str, str], topics: Topics, tmp_path: Path,
                                                    sink) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], cwd=ROOT, env=child_env(stack_env, **OFFLINE),
                         capture_output=True, text=True, timeout=400, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "logged ['areal_metrics', 'console'] ['areal_metrics', 'console']" in out.stdout, out.stdout[-2000:]

    wait_for(lambda: sink("SELECT count() FROM v_steps WHERE run_id = 'verl-exp'") == [(3,)], 120, "3 step rows")
    rows = sink("SELECT step, reward, entropy, kl, clip_ratio, lr, grad_norm, response_length, throughput, latency_ms, "
                "gpu_mem_bytes, metrics FROM v_steps WHERE run_id = 'verl-exp' ORDER BY step")
    assert [r[0] for r in rows] == [1, 2, 3]
    for step, reward, entropy, kl, clip, lr, grad_norm, length, throughput, latency_ms, mem, metrics in rows:
        assert reward == pytest.approx(0.2 * step) and kl == pytest.approx(0.001 * step)
        assert (entropy, clip, lr, grad_norm, length, throughput) == (1.5, 0.02, 1e-6, 0.5, 120.0, 900.0)
        assert latency_ms == 2500.0 and mem == int(1.5 * 2**30)  # seconds -> ms, GiB -> bytes
        assert metrics == {"timing_s/gen": 1.25}
    runs = wait_for(lambda: len(sink("SELECT 1 FROM v_runs WHERE run_id IN ('verl-exp', 'verl-crash') "
                                     "AND status != 'running'")) == 2, 60, "both runs to end")
    assert runs
    ended = sink("SELECT run_id, status, exit_code, framework, `group`, tags, config FROM v_runs "
                 "WHERE run_id IN ('verl-exp', 'verl-crash') ORDER BY run_id")
    assert [r[:6] for r in ended] == [("verl-crash", "failed", 1, "verl", "verl-proj", ["verl"]),
                                      ("verl-exp", "finished", 0, "verl", "verl-proj", ["verl"])]
    assert json.loads(ended[1][6])["algorithm"] == {"adv_estimator": "grpo"}  # verl's config is the run's config

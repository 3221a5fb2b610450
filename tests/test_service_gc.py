"""The services settle the garbage collector once started; a trainer's process is left alone.

Each check runs in a fresh interpreter: freezing the collector here would change the test
process itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, tmp_path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), AREAL_HOME=str(tmp_path / "home"), AREAL_EXIT_TIMEOUT_S="0.5")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_settle_gc_freezes_what_lives_and_collects_the_young_generation_less_often(tmp_path: Path) -> None:
    seen = run_python("""
        import gc, json
        from areal_metrics.producers.runtime.service_gc import YOUNG_THRESHOLD, settle_gc
        before = {"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()}
        kept = [[i] for i in range(1000)]  # alive at the call: frozen with the rest
        settle_gc()
        after = {"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold(), "young": YOUNG_THRESHOLD}
        a = []; a.append(a); del a  # a cycle made afterwards is still the collector's
        print(json.dumps({"before": before, "after": after, "collected": gc.collect()}))
    """, tmp_path)
    assert seen["before"]["frozen"] == 0 and seen["before"]["threshold"][0] == 700
    assert seen["after"]["frozen"] >= 1000
    assert seen["after"]["threshold"] == [seen["after"]["young"], *seen["before"]["threshold"][1:]]
    assert seen["collected"] >= 1


def test_the_sink_process_settles_the_gc_before_it_runs(tmp_path: Path) -> None:
    seen = run_python("""
        import gc, json
        import areal_metrics.sinks.__main__ as entry

        class Recorded:  # stands in for the Sink: the entry point's wiring is under test
            def __init__(self, *args, **kwargs): pass
            def stop(self): pass
            def run(self):
                print(json.dumps({"frozen": gc.get_freeze_count(), "young": gc.get_threshold()[0]}))

        entry.Sink = Recorded
        entry.main()
    """, tmp_path)
    assert seen["frozen"] > 0 and seen["young"] == 20_000


def test_the_client_leaves_a_trainers_gc_as_it_was(tmp_path: Path) -> None:
    seen = run_python("""
        import gc, json
        import areal_metrics
        run = areal_metrics.init(run_id="gc-check", kafka_bootstrap="127.0.0.1:1", journal_dir="journal")
        run.log({"reward": 0.5}, step=0)
        print(json.dumps({"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()}))
        run.finish()
    """, tmp_path)
    assert seen == {"frozen": 0, "threshold": [700, 10, 10]}


@pytest.mark.broker
def test_the_worker_process_settles_the_gc_before_faust_runs(tmp_path: Path, kafka_bootstrap: str) -> None:
    """`python -m areal_metrics.streams`'s main against the real broker, up to the moment Faust's worker
    would start: by then the collector is settled."""
    prefix = f"gc{uuid.uuid4().hex[:6]}."
    seen = run_python(f"""
        import gc, json, os
        os.environ.update(AREAL_KAFKA_BOOTSTRAP={kafka_bootstrap!r}, AREAL_TOPIC_PREFIX={prefix!r})
        import faust
        import areal_metrics.streams.__main__ as entry

        def started(self):  # where Faust's worker would take over the process
            print(json.dumps({{"frozen": gc.get_freeze_count(), "young": gc.get_threshold()[0]}}))

        faust.Worker.execute_from_commandline = started
        entry.main()
    """, tmp_path)
    assert seen["frozen"] > 0 and seen["young"] == 20_000

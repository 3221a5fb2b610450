"""The client in real processes, with the broker away: what lands in the journal at every kind of exit.

No broker is needed: with an unreachable bootstrap everything the client
sends goes to its journal (`<AREAL_HOME>/journal/<run>/rank-<r>/journal.log`),
which is what a later process re-sends. Each test runs a small script in a
fresh interpreter and reads the journal it left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from areal_metrics.stack.kafka_broker import free_port

ROOT = Path(__file__).resolve().parents[1]


def env_for(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AREAL_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_"))}
    env.update({"AREAL_HOME": str(home), "AREAL_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}",
                "AREAL_EXIT_TIMEOUT_S": "5", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **extra})
    return env


def run_script(code: str, home: Path, timeout: float = 60, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env_for(home, **extra), capture_output=True,
                          text=True, timeout=timeout)


def journaled(home: Path, run_id: str, rank: int = 0) -> list[dict]:
    path = home / "journal" / run_id / f"rank-{rank}" / "journal.log"
    return [json.loads(line.split(b"\t", 2)[2]) for line in path.read_bytes().splitlines()]


def statuses(events: list[dict]) -> list[tuple[str, object]]:
    return [(e["status"], e.get("exit_code")) for e in events if e["type"] == "run"]


def test_importing_the_package_and_init_pull_in_nothing_heavy(tmp_path: Path) -> None:
    out = run_script("""
        import sys
        import areal_metrics as am
        run = am.init(run_id="light", config={"lr": 0.1})
        run.log({"reward": 0.5}, step=0)
        heavy = sorted(m for m in ("faust", "chdb", "clickhouse_connect", "torch", "matplotlib", "rich", "numpy",
                                    "aiokafka", "grafana_foundation_sdk") if m in sys.modules)
        print("HEAVY", heavy)
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout


def test_a_normal_exit_without_finish_delivers_to_the_journal(tmp_path: Path) -> None:
    out = run_script("""
        import areal_metrics as am
        run = am.init(run_id="plain-exit", config={"lr": 0.1}, tags=["t"], group="g")
        for step in range(100):
            run.log({"reward": step / 100, "epoch": step / 50}, step=step)
        run.log_eval("math", 99, verdicts=[1, 0, 1])
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    events = journaled(tmp_path, "plain-exit")
    assert [e["step"] for e in events if e["type"] == "step"] == list(range(100))
    assert statuses(events) == [("running", None), ("finished", None)]
    assert [e["accuracy"] for e in events if e["type"] == "eval"] == [pytest.approx(2 / 3)]
    assert events[0]["config"] == {"lr": 0.1} and events[0]["tags"] == ["t"] and events[0]["group"] == "g"


def test_an_uncaught_exception_marks_the_run_failed_and_still_prints(tmp_path: Path) -> None:
    out = run_script("""
        import areal_metrics as am
        run = am.init(run_id="crash")
        run.log({"loss": 1.0}, step=0)
        raise RuntimeError("boom in the training loop")
    """, tmp_path)
    assert out.returncode == 1 and "RuntimeError: boom in the training loop" in out.stderr
    assert statuses(journaled(tmp_path, "crash")) == [("running", None), ("failed", 1)]


def test_the_with_block_marks_an_exception_failed(tmp_path: Path) -> None:
    out = run_script("""
        import areal_metrics as am
        try:
            with am.init(run_id="ctx") as run:
                run.log({"loss": 1.0}, step=0)
                raise ValueError("bad batch")
        except ValueError:
            pass
        print("after", run.stats().journaled)
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert statuses(journaled(tmp_path, "ctx")) == [("running", None), ("failed", 1)]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_sigterm_and_sigint_mark_the_run_killed(tmp_path: Path, signum: int, code: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time, areal_metrics as am
        run = am.init(run_id="sig")
        run.log({"loss": 1.0}, step=0)
        print("ready", flush=True)
        time.sleep(60)
    """)], env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        proc.send_signal(signum)
        assert proc.wait(30) == code  # still "killed by the signal" (Python re-raises SIGINT after KeyboardInterrupt)
    finally:
        proc.kill()
    assert statuses(journaled(tmp_path, "sig")) == [("running", None), ("killed", 128 + signum)]


def test_a_sigterm_during_finish_waits_for_it_then_kills(tmp_path: Path) -> None:
    """The signal lands inside finish(), before the terminal status is sent: the status is still journaled."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, signal, areal_metrics as am
        run = am.init(run_id="sig-finish")
        run.log({"loss": 1.0}, step=0)
        publish_run = run._publish_run

        def signalled_then_publish(*args):
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, in the middle of finish()
            publish_run(*args)

        run._publish_run = signalled_then_publish
        run.finish()
        print("not reached: the deferred SIGTERM ends the process", flush=True)
    """)], env=env_for(tmp_path), capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "not reached" not in proc.stdout
    assert statuses(journaled(tmp_path, "sig-finish")) == [("running", None), ("finished", None)]


def test_a_sigterm_while_a_full_queue_goes_to_the_journal_waits_for_it_then_kills(tmp_path: Path) -> None:
    """The signal lands while `log` moves a full queue's oldest chunk to the journal on the caller's thread,
    holding the publisher's locks. Its handler (on that thread) finished the run there and took the same lock
    again: the process hung until SIGKILL, its terminal status lost. Now it waits for the chunk, then ends."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, signal, areal_metrics as am
        from areal_metrics.producers.delivery import publisher_core
        run = am.init(run_id="sig-full", exit_timeout_s=1)
        run.log({"loss": 1.0}, step=0)
        make_room = publisher_core.PublisherCore.make_room

        def signalled_then_make_room(self, item):
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, the locks held
            make_room(self, item)

        publisher_core.PublisherCore.make_room = signalled_then_make_room
        run._publisher._core.enqueue = lambda item: False  # the queue is full: the slow path
        run.log({"loss": 0.5}, step=1)
        print("not reached: the deferred SIGTERM ends the process", flush=True)
    """)], env=env_for(tmp_path), capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "not reached" not in proc.stdout
    assert statuses(journaled(tmp_path, "sig-full")) == [("running", None), ("killed", 128 + signal.SIGTERM)]


def test_a_sigterm_during_a_finish_on_another_thread_still_ends_the_process(tmp_path: Path) -> None:
    """Only the main thread can restore the default disposition: the signal is not deferred to a worker thread."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, signal, threading, time, areal_metrics as am
        run = am.init(run_id="sig-thread")
        publish_run = run._publish_run

        def signalled_then_publish(*args):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # the main thread takes the signal meanwhile
            publish_run(*args)

        run._publish_run = signalled_then_publish
        finisher = threading.Thread(target=run.finish)
        finisher.start()
        finisher.join()
        time.sleep(2)
        print("not reached: SIGTERM ends the process", flush=True)
    """)], env=env_for(tmp_path), capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "not reached" not in proc.stdout and "Traceback" not in proc.stderr


def test_a_previous_sigterm_handler_is_chained(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda s, f: (print("user handler", flush=True), sys.exit(3)))
        import areal_metrics as am
        run = am.init(run_id="chain")
        print("ready", flush=True)
        time.sleep(60)
    """)], env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 3
        assert "user handler" in proc.stdout.read()
    finally:
        proc.kill()
    assert statuses(journaled(tmp_path, "chain")) == [("running", None), ("killed", 128 + signal.SIGTERM)]


def test_ranks_on_one_host_with_default_settings_get_their_own_journal_and_node(tmp_path: Path) -> None:
    code = """
        import time, areal_metrics as am
        run = am.init(run_id="two-ranks")
        for step in range(5):
            run.log({"reward": 0.1}, step=step)
        time.sleep(1)  # both processes hold their journal at once
        print(run.node, run.rank, run.world_size)
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env_for(tmp_path, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r)))
             for r in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len({o[0] for o in outs}) == 2  # two node names
    for rank in range(2):
        events = journaled(tmp_path, "two-ranks", rank)
        assert {e["rank"] for e in events} == {rank} and all(e["world_size"] == 2 for e in events)


def test_a_forked_child_sends_nothing_for_the_parent(tmp_path: Path) -> None:
    out = run_script("""
        import os, sys, areal_metrics as am
        run = am.init(run_id="forked")
        pid = os.fork()
        if pid == 0:
            run.log({"from_child": 1.0}, step=5)  # ignored: the child is not the run
            sys.exit(0)  # runs the child's atexit
        os.waitpid(pid, 0)
        run.log({"reward": 1.0}, step=0)
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    events = journaled(tmp_path, "forked")
    assert statuses(events) == [("running", None), ("finished", None)]
    assert [e["step"] for e in events if e["type"] == "step"] == [0]


def test_a_generated_run_id_is_printed(tmp_path: Path) -> None:
    out = run_script("import areal_metrics as am; am.init()", tmp_path)
    assert out.returncode == 0 and out.stderr.startswith("areal-metrics: run run-"), out.stderr


def test_programming_errors_raise_values_never(tmp_path: Path) -> None:
    out = run_script("""
        import areal_metrics as am
        run = am.init(run_id="errors")
        for call in (lambda: run.log([1, 2]), lambda: run.log({"a": 1}, step=1.5), lambda: run.log({"a": 1}, step=-1),
                     lambda: run.log({"a": 1}, step=2**63),
                     lambda: am.init(tags="one"), lambda: am.init(no_such_setting=1), lambda: am.init(run_id="bad id"),
                     lambda: run.finish("done"), lambda: run.log_eval("math", 1, stage="final")):
            try:
                call()
                print("NO ERROR")
            except (TypeError, ValueError) as exc:
                print(type(exc).__name__)
        run.log({"a": "text", "b": None, "c": float("nan"), "d": [1]}, step=0)
        print("values ok")
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "NO ERROR" not in out.stdout and "values ok" in out.stdout


def test_a_step_logged_twice_is_one_row_with_both_calls_values(tmp_path: Path) -> None:
    """What the journal holds, stored the way the sink stores it: the later (merged) event replaces the first."""
    from areal_metrics.producers.contract.topics import Topics
    from areal_metrics.sinks.decode import decode
    from areal_metrics.sinks.migrations import apply_schema
    from areal_metrics.sinks.query import Target, open_client
    from areal_metrics.sinks.writer import insert_rows

    out = run_script("""
        import areal_metrics as am
        run = am.init(run_id="twice")
        run.log({"reward": 0.5, "mine": 1.0}, step=3)
        run.log({"loss": 0.2, "mine": 2.0}, step=3)  # a second call for the same step (TRL logs eval and train so)
        run.log({"reward": 0.7}, step=4)
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    path = tmp_path / "journal" / "twice" / "rank-0" / "journal.log"

    class Msg:
        def __init__(self, offset: int, line: bytes) -> None:
            topic, key, value = line.split(b"\t", 2)
            self.topic, self.partition, self.offset, self.key, self.value, self.timestamp = (
                topic.decode(), 0, offset, key, value, 0)

    messages = [Msg(i, line) for i, line in enumerate(path.read_bytes().splitlines())]
    client = open_client(Target.parse(f"chdb://{tmp_path / 'store'}"), readonly=False, use_database=False)
    try:
        apply_schema(client)
        for topic in {m.topic for m in messages}:
            insert_rows(client, "areal", decode([m for m in messages if m.topic == topic], Topics("areal.")).rows, topic)
        rows = client.query("SELECT step, reward, loss, metrics FROM areal.v_steps ORDER BY step").result_rows
    finally:
        client.close()
    assert rows == [(3, 0.5, 0.2, {"mine": 2.0}), (4, 0.7, None, {})]


def test_a_forked_child_of_a_publisher_does_not_wait_for_it_at_exit(tmp_path: Path) -> None:
    """The child has no sender thread: waiting for it (here up to 300 s) would hang the child's exit."""
    out = run_script(f"""
        import os, sys
        from areal_metrics.producers.contract.events import StepEvent
        from areal_metrics.producers.delivery.publisher import Publisher
        from areal_metrics.producers.contract.topics import Topics
        p = Publisher("127.0.0.1:{free_port()}", Topics(), {str(tmp_path / "j")!r}, exit_timeout_s=300)
        p.publish(StepEvent(run_id="f", step=0, epoch=0))
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print("child exited", os.waitstatus_to_exitcode(status))
    """, tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "child exited 0" in out.stdout

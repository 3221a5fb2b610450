"""The client on a bad day, none of which may raise into the training loop or lose what it could keep:
Ctrl-C while exit waits for a broker that does not answer, a full disk under the journal, a `log`
on another thread racing `finish`, a read-only home, `init` run again, a resume whose broker does not
answer, and a broker away for a long time (said once, not every few seconds). No broker: a closed
port, or a TCP server that accepts and never speaks Kafka."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_metrics.producers.delivery.publisher import Publisher
from areal_metrics.producers.delivery import publisher as publisher_module
from tests import support
from tests.support import logger_warnings
from tests.test_client_process import env_for, journaled


@pytest.fixture()
def silent_broker() -> Iterator[str]:
    """host:port of a server that accepts connections and never answers (a broker still starting, a
    port-forward to a pod that is down)."""
    with support.silent_server() as port:
        yield f"127.0.0.1:{port}"


def start_script(code: str, home: Path, **extra: str) -> subprocess.Popen[str]:
    # SIGINT as a terminal gives it: a session started in the background (`make test &`, CI) ignores it,
    # and a child inherits that, so Python would install no KeyboardInterrupt for it
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env_for(home, **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("how", ["at exit", "in finish()"])
def test_ctrl_c_while_exit_waits_for_the_broker_keeps_every_step_in_the_journal(
        tmp_path: Path, silent_broker: str, how: str) -> None:
    child = start_script(f"""
        import areal_metrics as am
        run = am.init(run_id="ctrl-c", git=False)
        for i in range(1000):
            run.log({{"reward": 0.5}}, step=i)
        print("logged", flush=True)
        if {how == "in finish()"}:
            run.finish()
    """, tmp_path, AREAL_KAFKA_BOOTSTRAP=silent_broker, AREAL_EXIT_TIMEOUT_S="30")
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "logged"
    time.sleep(2)  # inside the exit's wait
    sent = time.monotonic()
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert time.monotonic() - sent < 10, "the interrupt ended the wait"
    steps = sorted(e["step"] for e in journaled(tmp_path, "ctrl-c") if e["type"] == "step")
    assert steps == list(range(1000))
    if how == "at exit":  # the process's own exit: one line, no traceback, status 0
        assert child.returncode == 0 and "Traceback" not in err, err
        assert "interrupted while delivering at exit" in err
    else:  # the caller's own finish(): the interrupt is the caller's to handle, as any other
        assert child.returncode != 0


def test_a_full_disk_under_the_journal_never_raises_and_counts_what_is_lost(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        import areal_metrics as am
        run = am.init(run_id="full", git=False)
        raised = 0
        for i in range(20_000):
            try:
                run.log({"reward": 0.5, "kl": 0.1}, step=i)
            except BaseException:
                raised += 1
        run._publisher.flush(30, journaled_ok=True)
        stats = run.stats()
        print("RESULT", raised, run._publisher._thread.is_alive(), stats.journaled, stats.lost, flush=True)
        run.finish()
        print("finished")
    """)], env=env_for(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    raised, alive, journaled_n, lost = out.stdout.split("RESULT ")[1].split("\n")[0].split()
    assert (raised, alive) == ("0", "True")
    assert int(journaled_n) > 0 and int(lost) > 0 and int(journaled_n) + int(lost) >= 20_000
    assert "finished" in out.stdout and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("cannot write the journal") == 1, out.stderr
    # what reached the journal is whole lines of whole events: a failed write left no part of its line
    events = journaled(tmp_path, "full")
    assert len(events) >= int(journaled_n) - 1 and all(e["run_id"] == "full" for e in events)


def test_an_event_published_after_close_is_dropped_and_counted_not_raised(tmp_path: Path) -> None:
    from areal_metrics.producers.contract.events import AlertEvent

    publisher = Publisher("127.0.0.1:1", journal_dir=tmp_path / "j", close_at_exit=False)
    publisher.close(1)
    with logger_warnings(publisher_module.log) as said:
        for _ in range(3):  # a logging thread that passed its check as finish() began
            publisher.publish(AlertEvent(run_id="late", node="n", kind="test", message="m"))
    assert publisher.stats().lost == 3
    assert [r.getMessage() for r in said if "after close()" in r.getMessage()] != []
    assert len(said) == 1


def test_the_sender_survives_a_failed_round(tmp_path: Path) -> None:
    from areal_metrics.producers.contract.events import AlertEvent

    publisher = Publisher("127.0.0.1:1", journal_dir=tmp_path / "j", close_at_exit=False)
    step, failures = publisher._step, []

    def failing_once() -> bool:
        if not failures:
            failures.append(1)
            raise OSError("a journal read failed")
        return step()

    publisher._step = failing_once  # type: ignore[method-assign]
    publisher.publish(AlertEvent(run_id="on", node="n", kind="test", message="m"))
    assert publisher.flush(20, journaled_ok=True)
    assert failures == [1] and publisher._thread.is_alive()
    assert publisher.stats().spilled == 1
    publisher.close(1)


def test_a_read_only_home_journals_in_the_temp_folder(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.write_text("a file where the home folder should be")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import areal_metrics as am
        run = am.init(run_id="ro-home", git=False)
        run.log({"reward": 0.5}, step=0)
        print("JOURNAL", run.journal_directory)
        run.finish()
    """)], env=env_for(home), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    journal = Path(out.stdout.split("JOURNAL ")[1].split()[0])
    assert journal.parts[-3:] == ("journal", "ro-home", "rank-0") and not journal.is_relative_to(home)
    assert "cannot make the journal" in out.stderr
    lines = (journal / "journal.log").read_bytes().splitlines()
    assert any(json.loads(line.split(b"\t", 2)[2]).get("step") == 0 for line in lines)


def test_init_of_the_same_run_again_finishes_the_first(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import threading
        import areal_metrics as am
        runs = [am.init(run_id="again", git=False) for _ in range(70)]  # more than the journal's 64 slots
        other = am.init(run_id="another", git=False)  # another run: both stay open
        unnamed = [am.init(git=False) for _ in range(3)]  # a cell run again without a run id: a new id each time
        print("RESULT", sum(not r._done for r in runs), threading.active_count(), runs[-1]._done,
              len({str(r.journal_directory) for r in runs}), sum(not r._done for r in unnamed), other._done)
    """)], env=env_for(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    open_runs, threads, last_done, journals, unnamed_open, other_done = out.stdout.split("RESULT ")[1].split()
    # the last of "again", "another" and the last unnamed one are open: three sender threads beside the main one
    assert (open_runs, last_done, journals, threads) == ("1", "False", "1", "4")
    assert (unnamed_open, other_done) == ("1", "False")  # before: every unnamed run stayed open
    assert out.stderr.count("is still open in this process; finishing it first") == 69 + 2


def test_a_second_training_under_the_same_launcher_job_id_is_told_it_replaces_the_first(tmp_path: Path) -> None:
    """Two trainings one after the other in one SLURM allocation (a sweep in one sbatch script) get the job's
    run id, and the second's steps replace the first's: said once, with the way out (run_id=, resume=True).
    A run id given, or a resume, says nothing."""
    env = {**env_for(tmp_path), "SLURM_JOB_ID": "4242"}
    code = textwrap.dedent("""
        import sys, areal_metrics as am
        run = am.init(git=False, **({"resume": True} if sys.argv[1] == "resume" else
                                    {"run_id": "mine"} if sys.argv[1] == "given" else {}))
        print("RUN", run.run_id)
        run.finish()
    """)
    said = []
    for how in ("job", "job", "resume", "given", "given"):
        out = subprocess.run([sys.executable, "-c", code, how], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        said.append((out.stdout.split("RUN ")[1].split()[0], "steps replace that run's" in out.stderr))
    assert said == [("slurm-4242", False), ("slurm-4242", True), ("slurm-4242", False), ("mine", False),
                    ("mine", False)]
    chosen = {**env, "AREAL_RUN_ID": "chosen"}  # an id the user set: a re-run of it is theirs to choose
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code, "job"], env=chosen, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and "RUN chosen" in out.stdout and "steps replace" not in out.stderr, out.stderr


def test_a_resume_whose_broker_does_not_answer_keeps_to_its_timeout(tmp_path: Path, silent_broker: str) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import threading, time
        import areal_metrics as am
        began = time.monotonic()
        run = am.init(run_id="resumed", git=False, resume=True, resume_timeout_s=2, exit_timeout_s=1)
        took = time.monotonic() - began
        print("RESULT", f"{took:.1f}", sorted(t.name for t in threading.enumerate() if "resume" in t.name))
    """)], env=env_for(tmp_path, AREAL_KAFKA_BOOTSTRAP=silent_broker), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    took, threads = out.stdout.split("RESULT ")[1].split(" ", 1)
    assert float(took) < 6, "kafka-python's own bootstrap wait is 30 s"
    assert threads.strip() == "[]", "the failed consumer's I/O thread is stopped"


def test_a_broker_away_for_long_is_said_once(tmp_path: Path, silent_broker: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """kafka-python bootstraps for 5 s a try against a port that never answers: a warning each try was
    about 11,000 lines a day on a trainer's stderr."""
    publisher = Publisher(silent_broker, journal_dir=tmp_path / "j", close_at_exit=False, kafka_client="kafka-python")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    log = publisher_module.log  # the module's own (tests/support.py logger_warnings says why)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        from areal_metrics.producers.contract.events import AlertEvent

        publisher.publish(AlertEvent(run_id="away", node="n", kind="test", message="m"))
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and sum("no producer" in r.getMessage() for r in records) < 3:
            time.sleep(0.2)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        publisher.close(1)
    tries = [r for r in records if "no producer" in r.getMessage()]
    assert len(tries) >= 3, "three tries to connect"
    assert [r.levelno for r in tries].count(logging.WARNING) == 1

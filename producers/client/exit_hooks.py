"""How a run ends when the program does not call `finish()`: atexit, uncaught exceptions, signals.

Installed once, at the first `init`:

- atexit: every open run finishes (`finished`, or what an exception or a
  signal marked), waiting a bounded time: delivered, or journaled when the
  broker is away;
- sys.excepthook (chained): an uncaught exception marks the open runs
  `failed` (KeyboardInterrupt: `killed`), then the previous hook prints it;
- SIGTERM and SIGINT (main thread only, previous handlers chained): mark the
  runs `killed`. Where the previous disposition is the default (SIGTERM
  kills the process without running atexit), the runs finish first and the
  signal is then re-delivered with the default disposition, so the exit
  status stays "killed by SIGTERM". An ignored signal marks nothing;
- a terminating signal that arrives while a run is inside `finish()` (its
  handler runs on the main thread, possibly in the middle of that finish)
  waits for the finish to end, then ends the process the same way;
- fork: a child process (a DataLoader worker) forgets the parent's runs, so
  it never sends their terminal status.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Ending(Protocol):
    def mark_exit(self, status: str, exit_code: int) -> None: ...
    def finish_at_exit(self, wait: bool = True) -> None: ...
    @property
    def journal_directory(self) -> Path | None: ...
    def forget_after_fork(self) -> None: ...


_RUNS: list[Ending] = []
_LOCK = threading.Lock()
_INSTALLED = False
_PREVIOUS_HANDLERS: dict[int, Any] = {}
_previous_excepthook: Any = None
_finishing = 0  # finish() calls under way
_deferred_signal: int | None = None  # a signal that arrived during one: delivered once they end


def register(run: Ending) -> None:
    with _LOCK:
        _install()
        _RUNS.append(run)


def unregister(run: Ending) -> None:
    with _LOCK:
        if run in _RUNS:
            _RUNS.remove(run)


def open_runs() -> list[Ending]:
    with _LOCK:
        return list(_RUNS)


@contextlib.contextmanager
def finishing() -> Any:
    """Around a run's finish(): a terminating signal meanwhile waits for it instead of cutting it short.

    Only on the main thread, where the handler runs (and where the default
    disposition can be restored to end the process)."""
    global _finishing, _deferred_signal
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _finishing += 1
    try:
        yield
    finally:
        _finishing -= 1
        if _finishing == 0 and _deferred_signal is not None:
            signum, _deferred_signal = _deferred_signal, None
            _end_by(signum)


def _install() -> None:
    global _INSTALLED, _previous_excepthook
    if _INSTALLED:
        return
    _INSTALLED = True
    atexit.register(_at_exit)
    _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                _PREVIOUS_HANDLERS[signum] = signal.getsignal(signum)
                signal.signal(signum, _on_signal)
            except (ValueError, OSError) as exc:  # an embedded interpreter without signals
                log.debug("cannot handle signal %s: %s", signum, exc)
    else:
        log.debug("init outside the main thread: SIGTERM/SIGINT are not watched")
    os.register_at_fork(after_in_child=_forget_in_child)


def _at_exit() -> None:
    # A Ctrl-C while exit waits for the broker ends the wait, this run's and the next ones': what is
    # unsent is journaled, said in one line (no traceback), and the process exits.
    interrupted = False
    for run in open_runs():
        try:
            run.finish_at_exit(wait=not interrupted)
        except KeyboardInterrupt:
            interrupted = True
            print(f"areal-metrics: interrupted while delivering at exit; what is unsent is kept in the journal "
                  f"{run.journal_directory} (areal-metrics sync sends it)", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - exit must go on
            log.exception("finishing a run at exit failed")


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    killed = issubclass(exc_type, KeyboardInterrupt)
    for run in open_runs():
        run.mark_exit("killed" if killed else "failed", 130 if killed else 1)
    hook = _previous_excepthook or sys.__excepthook__
    hook(exc_type, exc, tb)


def _on_signal(signum: int, frame: Any) -> None:
    previous = _PREVIOUS_HANDLERS.get(signum, signal.SIG_DFL)
    if previous is signal.SIG_IGN:
        return
    for run in open_runs():
        run.mark_exit("killed", 128 + signum)
    if callable(previous):
        previous(signum, frame)  # e.g. SIGINT's default_int_handler raises KeyboardInterrupt
        return
    # the default disposition ends the process without atexit: finish now, then die by the signal
    if _finishing:  # this handler may have interrupted that finish(): it ends the process when done
        global _deferred_signal
        _deferred_signal = signum
        return
    _end_by(signum)


def _end_by(signum: int) -> None:
    _at_exit()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _forget_in_child() -> None:
    global _RUNS, _LOCK
    _LOCK = threading.Lock()  # another thread may have held it at the fork
    for run in _RUNS:
        run.forget_after_fork()
    _RUNS = []

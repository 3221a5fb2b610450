"""`python -m areal_metrics.stack.supervisor <service>`: run a service of the local stack and
restart it when it dies (CONTRACT.md, "No input stops the pipeline").

`areal-metrics up` starts one supervisor per service (its pid is the service's in
stack.json). The supervisor runs the service as its child, its output in the same log, and:

- a clean exit (0) or a configuration error (2: a setting, a missing package; no restart
  can pass it) ends the supervisor with the same status;
- any other death (a crash, a signal) restarts the service after `Backoff.delay` (from
  AREAL_RESTART_BACKOFF_S, doubled per restart in a row, at most 30 s); a run of a minute or
  more starts the count again; after AREAL_RESTART_MAX restarts in a row the supervisor gives up;
- SIGTERM / SIGINT are passed to the service, whose exit ends the supervisor.

The service itself finds the message it died on (producers/runtime/poison.py), so a crash
never loops: the second death at one input position dead-letters that message. The
supervisor records `restarts` (since `up`), the child's pid and its last exit status in
`$AREAL_HOME/services/<service>.json`, which `areal-metrics status` shows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.settings import state_dir
from areal_metrics.producers.runtime.backoff import Backoff
from areal_metrics.stack.settings import StackSettings

MODULES = {"worker": "areal_metrics.streams", "sink": "areal_metrics.sinks"}
FINAL_EXITS = (0, 2)  # stopped, or a configuration error: a restart cannot pass it
HEALTHY_S = 60.0  # a run this long starts the count of restarts in a row again


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_in_a_row: int = 10
    backoff: Backoff = Backoff(initial_s=1.0, factor=2.0, max_s=30.0)
    healthy_s: float = HEALTHY_S

    @classmethod
    def from_settings(cls, stack: StackSettings) -> RestartPolicy:
        """The policy AREAL_RESTART_MAX and AREAL_RESTART_BACKOFF_S make."""
        return cls(stack.restart_max, Backoff(stack.restart_backoff_s, 2.0, 30.0))


def next_step(policy: RestartPolicy, exit_code: int, ran_s: float, in_a_row: int) -> tuple[bool, float, int]:
    """After the service exited with `exit_code` having run `ran_s` seconds, with `in_a_row`
    restarts in a row before: (restart?, seconds to wait first, restarts in a row now)."""
    if exit_code in FINAL_EXITS:
        return False, 0.0, in_a_row
    in_a_row = 1 if ran_s >= policy.healthy_s else in_a_row + 1
    if in_a_row > policy.max_in_a_row:
        return False, 0.0, in_a_row - 1
    return True, policy.backoff.delay(in_a_row), in_a_row


def record_path(home: str | Path, name: str) -> Path:
    return Path(home) / "services" / f"{name}.json"


def read_record(home: str | Path, name: str) -> dict[str, object]:
    """What the service's supervisor recorded ({} when nothing readable)."""
    try:
        found = json.loads(record_path(home, name).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _write_record(path: Path, record: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def supervise(name: str, policy: RestartPolicy, home: Path) -> int:
    path = record_path(home, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, object] = {"service": name, "supervisor_pid": os.getpid(), "restarts": 0, "pid": None,
                                 "last_exit": None}
    stopping = threading.Event()
    child: subprocess.Popen[bytes] | None = None

    def stop(signum: int, _frame: object) -> None:
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    in_a_row = 0
    while True:
        started = time.monotonic()
        child = subprocess.Popen([sys.executable, "-m", MODULES[name]], stdin=subprocess.DEVNULL)
        record.update(pid=child.pid, since=time.time())
        _write_record(path, record)
        if stopping.is_set():  # a signal that came before the child existed
            child.terminate()
        code = child.wait()
        record["last_exit"] = code
        _write_record(path, record)
        if stopping.is_set():
            return code
        again, delay, in_a_row = next_step(policy, code, time.monotonic() - started, in_a_row)
        if not again:
            if code not in FINAL_EXITS:
                print(f"supervisor: {name} exited with status {code}, {in_a_row} restarts in a row; "
                      "giving up (AREAL_RESTART_MAX)", flush=True)
            return code
        print(f"supervisor: {name} exited with status {code}; restart {in_a_row} in a row in {delay:.1f} s",
              flush=True)
        if stopping.wait(delay):
            return code
        record["restarts"] = int(record["restarts"]) + 1  # type: ignore[call-overload]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in MODULES:
        print(f"usage: python -m areal_metrics.stack.supervisor {{{','.join(MODULES)}}}", file=sys.stderr)
        return 2
    try:
        stack = StackSettings.from_env()  # this process's entry: the one read of its settings
    except ConfigError as exc:  # a variable that cannot be used: one line, and no restart
        print(f"supervisor: {exc}", file=sys.stderr)
        return 2
    return supervise(args[0], RestartPolicy.from_settings(stack), state_dir())


if __name__ == "__main__":
    sys.exit(main())

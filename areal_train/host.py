"""The ranks of one local run, forked from one interpreter: `python -m areal_metrics.areal_train.host`.

Every rank is a process of its own (gloo wants that), but the ranks need not
each start Python and import torch, seconds of CPU per rank on a small
machine. This host imports the trainer once,
then forks one child per rank before it starts any thread; each child runs
`areal_metrics.areal_train.worker.main` with RANK and LOCAL_RANK set, its output in its own
log file when the launcher passes one.

The host then only waits. When a rank fails, it stops the others (a run
never hangs on a dead peer); a SIGTERM or SIGINT to the host reaches every
rank; if the host itself dies, the kernel kills the ranks (PR_SET_PDEATHSIG).
Its exit status is the first failing rank's (128 + the signal for one a
signal killed), or 0.

The ranks and the host exit without tearing down the interpreter (other
threads joined, exit handlers run and output flushed first, as at a normal
exit): for torch's modules the teardown costs CPU for nothing.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

PR_SET_PDEATHSIG = 1


def main(argv: list[str] | None = None) -> NoReturn:
    args, worker_argv = _parse(sys.argv[1:] if argv is None else argv)
    log_fds = [int(fd) for fd in args.log_fds.split(",")] if args.log_fds else []
    if log_fds and len(log_fds) != args.ranks:
        raise SystemExit(f"--log-fds: {len(log_fds)} file descriptors for {args.ranks} ranks")

    # A CUDA context does not survive a fork: ask NVML, not the driver, if anything asks for devices.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    from areal_metrics.areal_train import worker  # the import each rank would otherwise repeat
    _preload_lazy_imports()
    import torch

    if torch.cuda.is_initialized():
        raise SystemExit("areal_metrics.areal_train.host: CUDA was initialized before the ranks were forked")
    sys.stdout.flush()
    sys.stderr.flush()

    host = os.getpid()
    ranks: dict[int, int] = {}  # pid -> rank
    for rank in range(args.ranks):
        pid = os.fork()
        if pid == 0:
            _become_rank(rank, host, log_fds)
            _exit_quickly(_run_rank(worker.main, worker_argv))
        ranks[pid] = rank
    for fd in log_fds:
        os.close(fd)
    if args.pid_file:
        _write_atomically(Path(args.pid_file), json.dumps({str(r): pid for pid, r in ranks.items()}))
    _exit_quickly(_wait(ranks, grace=args.grace))


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The host's own options, then `--` and the worker's arguments (given to every rank)."""
    if "--" not in argv:
        raise SystemExit("usage: python -m areal_metrics.areal_train.host --ranks N [options] -- WORKER-ARGS")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m areal_metrics.areal_train.host")
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--log-fds", default="", help="one inherited file descriptor per rank, comma-separated")
    parser.add_argument("--pid-file", default=None, help="write {rank: pid} here as JSON once every rank started")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds a stopped rank gets before SIGKILL")
    return parser.parse_args(argv[:split]), argv[split + 1:]


def _preload_lazy_imports() -> None:
    # `torch.optim.Optimizer.add_param_group` imports torch._dynamo on its first call
    # (a second of CPU or so): done here once instead of in every rank.
    import torch._dynamo  # noqa: F401


def _become_rank(rank: int, host: int, log_fds: list[int]) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a fresh interpreter (the worker sets its own)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != host:  # the host died before the line above
            os._exit(1)
    if log_fds:
        os.dup2(log_fds[rank], 1)
        os.dup2(log_fds[rank], 2)
        for fd in log_fds:
            os.close(fd)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))


def _run_rank(worker_main: Callable[[list[str]], int], argv: list[str]) -> int:
    """The rank's exit status, as Python would give it, for an error too (its traceback printed)."""
    try:
        return worker_main(argv)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the worker's answer to SIGTERM
        traceback.print_exc()
        return 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        return 1


def _exit_quickly(status: int) -> NoReturn:
    """Exit as at the end of a program (other threads joined, exit handlers run, output flushed),
    but without tearing down the interpreter's modules (costly for torch's)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _wait(ranks: dict[int, int], grace: float) -> int:
    """Reap the ranks; stop the rest at the first failure or signal; the run's exit status."""
    stopping: list[float] = []  # when the others were told to stop

    def stop(*_: object) -> None:
        if stopping:  # once: a second SIGTERM would interrupt the ranks' own clean-up
            return
        stopping.append(time.monotonic())
        for pid in ranks:
            _signal(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    status = 0
    while ranks:
        pid, wait_status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if stopping and time.monotonic() - stopping[0] > grace:
                for other in ranks:
                    _signal(other, signal.SIGKILL)
            time.sleep(0.05)
            continue
        if pid not in ranks:
            continue
        del ranks[pid]
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            stop()
    return status


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


if __name__ == "__main__":
    main()

"""Run a module under cProfile timed by CPU time; write the costliest functions to a file.

    python -m benchmarks.profiling OUT.txt MODULE [ARGS...]

CPU time (time.process_time: every thread of the process) rather than wall time, because
on a shared machine a wall-clock profile mostly shows where the process waited for a core
(a socket write that lets the broker run shows up as the worker's cost). cProfile sees the
main thread only (Faust's event loop and our code); the process's total CPU, consumer
thread included, is what the benchmarks read from /proc. OUT.txt gets the top functions by
own time and by cumulative time; OUT.txt.pstats the raw profile.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import runpy
import sys
import time
from pathlib import Path


def report(profile: cProfile.Profile, out: Path, top: int = 45) -> None:
    profile.dump_stats(str(out) + ".pstats")
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    out.write_text(text.getvalue())


def main() -> int:
    out, module, *rest = sys.argv[1:]
    sys.argv = [module, *rest]
    profile = cProfile.Profile(time.process_time)
    profile.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        profile.disable()
        report(profile, Path(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Opt-in system metrics (`AREAL_SYSTEM_METRICS_S`, `init(system_metrics_s=...)`): CPU, memory and,
where `pynvml` imports, each GPU's utilisation and memory, sampled on a background thread.

The names are W&B's (`system/cpu`, `system/memory`, `system/proc.memory.rssMB`,
`system/gpu.0.gpu`, ...), so dashboards and habits carry over. The newest sample goes into the
`metrics` of the next step logged after it was taken (once: steps between two samples carry
none), on the sender thread; the training loop pays nothing.

CPU and memory come from psutil when it is installed, else from Linux's /proc; what neither
gives is left out. Nothing here raises: a source that fails is dropped from the samples (NVML
failing, e.g. without a driver, leaves CPU and memory, with one warning).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from areal_metrics.producers.client.coerce import text_of

log = logging.getLogger("areal_metrics.client")

Sample = dict[str, float]


class _Cpu:
    """System-wide CPU utilisation in % since the previous call (psutil's, else /proc/stat's)."""

    def __init__(self) -> None:
        try:
            import psutil

            self._psutil: Any = psutil
            psutil.cpu_percent(None)  # the first call sets the baseline
        except Exception:  # noqa: BLE001 - not installed: /proc
            self._psutil = None
        self._last = _proc_stat()

    def percent(self) -> float | None:
        if self._psutil is not None:
            return float(self._psutil.cpu_percent(None))
        now = _proc_stat()
        if now is None or self._last is None:
            return None
        busy, total = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        return 100.0 * busy / total if total > 0 else None


def _proc_stat() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            values = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


def _memory() -> Sample:
    """System memory in use (%) and this process's resident memory (MB)."""
    out: Sample = {}
    try:
        import psutil

        out["system/memory"] = float(psutil.virtual_memory().percent)
        out["system/proc.memory.rssMB"] = psutil.Process().memory_info().rss / 2**20
        return out
    except Exception:  # noqa: BLE001 - not installed: /proc
        pass
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split()[1:]}
        out["system/memory"] = 100.0 * (1 - info["MemAvailable"] / info["MemTotal"])
    except (OSError, ValueError, KeyError, ZeroDivisionError):
        pass
    try:
        with open("/proc/self/statm") as f:
            out["system/proc.memory.rssMB"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return out


class _Gpus:
    """Each GPU's utilisation (%) and memory through NVML, when `pynvml` (nvidia-ml-py) imports and a driver answers.

    Without pynvml there are no GPU metrics, silently (a machine without GPUs). With pynvml but NVML failing
    (no driver, no permission: `nvmlInit` and the device calls raise `NVMLError`) the samples hold CPU and
    memory only, after one warning; a GPU that stops answering later is left out of the samples, after one
    warning too."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._warned = False
        try:
            import pynvml  # pyright: ignore[reportMissingImports]  (optional: nvidia-ml-py, where a GPU is)
        except Exception:  # noqa: BLE001 - not installed: no GPU metrics, nothing to say
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - no driver: CPU and memory only
            self._warn(f"no GPU metrics: NVML did not start ({_reason(exc)}); CPU and memory only")
            return
        try:
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as exc:  # noqa: BLE001 - NVML started but lists no device it can open
            self._warn(f"no GPU metrics: NVML could not list the GPUs ({_reason(exc)}); CPU and memory only")
            self._handles = []
        self._nvml = pynvml
        if not self._handles:
            self.close()

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("system metrics: %s", message)

    def sample(self) -> Sample:
        out: Sample = {}
        for i, handle in enumerate(self._handles):
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:  # noqa: BLE001 - a GPU that stopped answering: left out of this sample
                self._warn(f"GPU {i} did not answer NVML ({_reason(exc)}); left out of the samples while it does not")
                continue
            out[f"system/gpu.{i}.gpu"] = float(util.gpu)
            out[f"system/gpu.{i}.memory"] = float(util.memory)
            out[f"system/gpu.{i}.memoryAllocated"] = 100.0 * mem.used / mem.total if mem.total else 0.0
            out[f"system/gpu.{i}.memoryAllocatedBytes"] = float(mem.used)
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self._nvml = None


def _reason(exc: BaseException) -> str:
    """An exception in a few words for a warning (NVMLError's text is NVML's own, e.g. "Driver Not Loaded")."""
    return f"{type(exc).__name__}: {text_of(exc, 200)}"


class Sampler:
    """A daemon thread that samples every `interval_s`; `take()` hands the newest sample over once."""

    def __init__(self, interval_s: float, sources: Callable[[], Sample] | None = None) -> None:
        self.interval_s = interval_s
        self._cpu = _Cpu() if sources is None else None
        self._gpus = _Gpus() if sources is None else None
        self._sources = sources or self._sample
        self._latest: Sample | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="areal-metrics-system", daemon=True)
        self._thread.start()

    def _sample(self) -> Sample:
        out: Sample = {}
        assert self._cpu is not None and self._gpus is not None
        cpu = self._cpu.percent()
        if cpu is not None:
            out["system/cpu"] = cpu
        out.update(_memory())
        out.update(self._gpus.sample())
        return out

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._latest = self._sources()
            except Exception:  # noqa: BLE001 - never into training: log once and stop sampling
                log.warning("system metrics stopped: a sample failed", exc_info=True)
                return
        if self._gpus is not None:
            self._gpus.close()

    def take(self) -> Sample | None:
        """The newest sample not handed over yet (None when there is none); on the sender thread."""
        found, self._latest = self._latest, None
        return found

    def close(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def started(interval_s: float) -> Sampler | None:
    """A sampler every `interval_s` seconds, or None when 0 (off)."""
    return Sampler(interval_s) if interval_s > 0 else None


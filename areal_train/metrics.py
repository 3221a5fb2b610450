"""Small measurements the trainer reports: device choice and memory."""

from __future__ import annotations

import psutil
import torch


def choose_device(preference: str = "auto") -> torch.device:
    """CUDA when asked for or available (auto), else CPU."""
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return torch.device("cpu")


def memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on a GPU; the process resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return rss_bytes()


_PROCESS = psutil.Process()


def rss_bytes() -> int:
    """This process's resident set size (host memory), on any device."""
    return int(_PROCESS.memory_info().rss)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)

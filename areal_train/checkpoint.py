"""Checkpoints on disk: what every rank shares, what each rank has of its own, and `latest`.

    <root>/<run_id>/step-000030/shared.pt   model, reference, optimizer, schedulers (rank 0 writes)
                               /rank0.pt    that rank's RNG states and data cursor
                               /rank1.pt
                               /meta.json   step, attempt, world size, time
    <root>/<run_id>/latest                  "step-000030", replaced atomically last

A checkpoint counts only once `latest` names it, and `latest` is written
after every rank has written its file (the caller's barrier), so a crash
mid-save leaves the previous checkpoint in charge. The two newest are kept.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from areal_metrics.producers.contract.errors import UserError

KEEP = 2


class CheckpointError(UserError, RuntimeError):
    """No usable checkpoint, or one that does not fit this run; str says which and why."""


@dataclass(frozen=True)
class Loaded:
    meta: dict[str, Any]
    shared: dict[str, Any]
    own: dict[str, Any]  # this rank's


def run_dir(root: Path, run_id: str) -> Path:
    return Path(root) / run_id


def save(root: Path, run_id: str, step: int, rank: int, *, shared: Callable[[], dict[str, Any]] | None,
         own: dict[str, Any], meta: dict[str, Any], barrier: Callable[[], None]) -> Path:
    """Write this rank's part; rank 0 (which passes `shared`) also the rest, then `latest`."""
    directory = run_dir(root, run_id) / f"step-{step:06d}"
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_save(own, directory / f"rank{rank}.pt")
    if shared is not None:
        _atomic_save(shared(), directory / "shared.pt")
        (directory / "meta.json").write_text(json.dumps({**meta, "step": step, "saved_at": time.time()}))
    barrier()  # every rank's file is on disk
    if shared is not None:
        latest = run_dir(root, run_id) / "latest"
        tmp = latest.with_suffix(".tmp")
        tmp.write_text(directory.name)
        os.replace(tmp, latest)
        _prune(run_dir(root, run_id), keep=directory.name)
    barrier()  # nobody reads `latest` before it is there
    return directory


def load_latest(root: Path, run_id: str, rank: int, world_size: int, device: torch.device | str = "cpu") -> Loaded:
    base = run_dir(root, run_id)
    try:
        name = (base / "latest").read_text().strip()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint of run {run_id} in {base}") from None
    directory = base / name
    try:
        meta = json.loads((directory / "meta.json").read_text())
        shared = torch.load(directory / "shared.pt", map_location=device, weights_only=False)
        own_path = directory / f"rank{rank}.pt"
        if meta.get("world_size") != world_size:
            raise CheckpointError(f"checkpoint {directory} was written by {meta.get('world_size')} ranks, "
                                  f"this run has {world_size}")
        own = torch.load(own_path, map_location="cpu", weights_only=False)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {directory} is unreadable ({exc})") from None
    return Loaded(meta, shared, own)


def latest_meta(root: Path, run_id: str) -> dict[str, Any] | None:
    """The newest checkpoint's meta (step, attempt, world size), or None."""
    base = run_dir(root, run_id)
    try:
        return json.loads((base / (base / "latest").read_text().strip() / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def _atomic_save(obj: dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _prune(base: Path, keep: str) -> None:
    steps = sorted(p for p in base.glob("step-*") if p.is_dir())
    for old in steps[:-KEEP]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)

"""What a run says about itself in its `run` events: id, framework, git commit, tags (best effort)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
import unicodedata
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from areal_metrics.producers.contract.ids import is_valid_run_id

# checked in this order: the first one imported names the framework
FRAMEWORKS = ("trl", "verl", "areal", "transformers", "torch")
TAGS_MAX = 256
TAG_MAX_CHARS = 256
GROUP_MAX_CHARS = 256
_SHA = re.compile(r"[0-9a-f]{7,64}")


NAME_MAX_CHARS = 256
_NOT_ID = re.compile(r"[^A-Za-z0-9._:-]+")


def run_id_for(name: str) -> str:
    """A valid run id for a free-form name (an experiment name): the name itself when it is one, else its
    ASCII slug and a short hash of the whole name, e.g. `proj/exp lr=1e-6` -> `proj-exp-lr-1e-6-3f2a9c1b`.
    The same name gives the same id on every rank and every host."""
    if is_valid_run_id(name):
        return name
    ascii_text = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    slug = _NOT_ID.sub("-", ascii_text).strip("-.")[:119] or "run"
    return f"{slug}-{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


def clean_name(name: object) -> str | None:
    """`init(name=...)`: a display name of any Unicode, at most 256 characters; None when empty."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise TypeError(f"name: expected a string, got {type(name).__name__}")
    text = name.encode("utf-8", "replace").decode("utf-8").strip()[:NAME_MAX_CHARS]  # no lone surrogates
    return text or None


def clean_notes(notes: object) -> str | None:
    """`init(notes=...)`: free text, at most 4,096 characters; None when empty."""
    if notes is None:
        return None
    if not isinstance(notes, str):
        raise TypeError(f"notes: expected a string, got {type(notes).__name__}")
    text = notes.encode("utf-8", "replace").decode("utf-8").strip()[:4096]
    return text.replace("\x00", "\ufffd") or None


def new_run_id(now: float | None = None) -> str:
    """`run-YYYYmmdd-HHMMSS-xxxxxx`: sortable by start time, unique enough to never collide."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"run-{stamp}-{uuid.uuid4().hex[:6]}"


def detect_framework(modules: Mapping[str, Any] | None = None) -> str:
    """The RL framework this process has imported (never imports one): trl, verl, areal, ..., else `python`."""
    modules = sys.modules if modules is None else modules
    return next((name for name in FRAMEWORKS if name in modules), "python")


def source_dir() -> Path:
    """The directory of the training script (`__main__`), else the working directory."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return Path(path).resolve().parent if path else Path.cwd()


def git_commit(directory: Path | None = None, timeout_s: float = 2.0) -> str | None:
    """`git rev-parse HEAD` of the training code, or None (no git, not a repository, too slow). Never raises."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory or source_dir(), capture_output=True,
                             text=True, timeout=timeout_s, env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and _SHA.fullmatch(sha) else None


def clean_tags(tags: Iterable[Any] | None) -> tuple[str, ...]:
    """Tags as the contract holds them: strings, unique, at most 256 of at most 256 chars (None: none, W&B's
    default)."""
    if tags is None:
        return ()
    if isinstance(tags, (str, bytes)):
        raise TypeError("tags: expected a list of strings, got a single string (write tags=[...])")
    if not isinstance(tags, Iterable):
        raise TypeError(f"tags: expected a list of strings, got {type(tags).__name__}")
    out = dict.fromkeys(str(t)[:TAG_MAX_CHARS] for t in tags)
    out.pop("", None)
    return tuple(out)[:TAGS_MAX]

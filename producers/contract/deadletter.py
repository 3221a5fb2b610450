"""Turning input that failed validation into a `rejected` event.

Every reader (stream worker, sink, CLI) uses this, so a dead letter always
looks the same: the reason names the field, the raw bytes are kept.
"""

from __future__ import annotations

import base64
import json

from areal_metrics.producers.contract.events import RejectedEvent
from areal_metrics.producers.contract.field_rules import TS_MAX, fit_message, storage_safe, text_problem
from areal_metrics.producers.contract.ids import is_valid_run_id

UNKNOWN_RUN = "unknown"
MAX_RAW_CHARS = 256 * 1024  # a dead letter keeps at most this much of the input


def raw_as_text(raw: bytes | str) -> str:
    """The original bytes as a string: UTF-8 text, or base64 when they are not UTF-8 or
    the text could not be stored (a NUL, a lone surrogate in a string given)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or text_problem(text) is not None:
        text = "base64:" + base64.b64encode(data[: MAX_RAW_CHARS]).decode("ascii")
    return text[:MAX_RAW_CHARS]


def guess_run_id(raw: bytes | str, key: bytes | None = None) -> str:
    """The run a bad message probably belongs to (its key, or its run_id), so it stays with its run."""
    candidates: list[object] = []
    if key:
        candidates.append(key.decode("utf-8", "replace"))
    try:
        data = json.loads(raw) if len(raw) < MAX_RAW_CHARS else None
        if isinstance(data, dict):
            candidates.append(data.get("run_id"))
    except (ValueError, RecursionError, UnicodeDecodeError):
        pass
    for c in candidates:
        if is_valid_run_id(c):
            return c
    return UNKNOWN_RUN


def letter_ts(seconds: float | None) -> float | None:
    """A message's log time (s) as a dead letter's `ts`: within what `ts` holds (a producer sets
    the Kafka timestamp it likes: year 3000 too), so that no dead letter can fail to be made;
    None for none (-1)."""
    if seconds is None or not seconds >= 0:
        return None
    return min(float(seconds), TS_MAX)


def rejected(raw: bytes | str, reason: str, source_topic: str, *, node: str, key: bytes | None = None) -> RejectedEvent:
    return RejectedEvent(
        run_id=guess_run_id(raw, key),
        node=node,
        reason=storage_safe(fit_message(reason)) or "rejected",
        source_topic=source_topic[:256],
        raw=raw_as_text(raw),
    )

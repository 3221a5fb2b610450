"""Limits on the shape of a message, checked on its bytes before the full decode (CONTRACT.md,
'No input stops the pipeline').

A reader refuses a message larger than `max_bytes`, nested deeper than `max_depth`, with an
object of more than `max_keys` names or an array of more than `max_items` entries, before any
parser builds it: no message can exhaust a reader's stack (a 5,000-deep JSON made every
recursive decoder raise RecursionError) or its memory. The decision is made in C (counts,
`bytes.translate`, regular expressions); only a refused message is walked again in Python,
to name the field at fault. Each limit is a setting (settings.py, docs/SETTINGS.md): the entry
point of a process (the worker's and the sink's mains, the CLI, `init`) reads them with its
Settings and installs them (`install_limits`); nothing here reads the environment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, ClassVar

from areal_metrics.producers.contract.field_rules import ValidationError


@dataclass(frozen=True, slots=True)
class StructureLimits:
    """The four limits; `from_settings()` takes them from their settings (AREAL_MAX_*)."""

    max_bytes: int = 1 << 20
    max_depth: int = 64
    max_keys: int = 10_000
    max_items: int = 100_000
    # the Settings fields (AREAL_MAX_MESSAGE_BYTES, _JSON_DEPTH, _OBJECT_KEYS, _ARRAY_ITEMS) of the four, in order
    SETTINGS: ClassVar[tuple[str, ...]] = ("max_message_bytes", "max_json_depth", "max_object_keys", "max_array_items")

    @classmethod
    def from_settings(cls, settings: Any) -> StructureLimits:
        """From a `Settings` (settings.py imports the events, so it is not named here)."""
        return cls(*(getattr(settings, name) for name in cls.SETTINGS))


_installed = StructureLimits()


def install_limits(limits: StructureLimits) -> None:
    """The limits every reader of this process uses from now on where it is given none: an entry
    point's, from the Settings it read (`StructureLimits.from_settings`)."""
    global _installed
    _installed = limits


def default_limits() -> StructureLimits:
    """The limits the process's entry point installed (AREAL_MAX_*), else the defaults."""
    return _installed


# A JSON string (escapes included); structure characters inside strings are not structure.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_KEEP = frozenset(b"{}[],")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in _KEEP)
_DELTA = tuple(1 if b in b"{[" else -1 if b in b"}]" else 0 for b in range(256))
_INNERMOST = re.compile(rb"[\[{],*[\]}]")  # a container that holds no container (only its commas)


def check_structure(raw: bytes | str, where: str = "event", limits: StructureLimits | None = None) -> None:
    """Raise ValidationError (naming the field) when `raw` breaks a structure limit; else nothing.

    Malformed JSON is left to the decoder, which names what is wrong with it."""
    lim = limits or default_limits()
    if len(raw) > lim.max_bytes:
        raise ValidationError(where, f"message too large ({len(raw)} bytes > {lim.max_bytes})")
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    opens = data.count(b"{") + data.count(b"[")
    if opens <= lim.max_depth and data.count(b",") < min(lim.max_keys, lim.max_items):
        return  # the common case: no container can break a limit
    shape = _STRING.sub(b"", data).translate(None, _NOT_STRUCTURE)
    if max(accumulate(map(_DELTA.__getitem__, shape)), default=0) > lim.max_depth or _too_many(shape, lim):
        where_, problem = locate(data, where, lim)
        raise ValidationError(where_, problem)


def _too_many(shape: bytes, lim: StructureLimits) -> bool:
    """Does a container hold too many entries? Innermost containers are checked, then removed,
    level by level (at most max_depth + 1 rounds: the depth is within the limit here)."""
    over_keys = re.compile(rb"\{,{%d,}\}" % lim.max_keys)  # n commas: n + 1 names
    over_items = re.compile(rb"\[,{%d,}\]" % lim.max_items)
    for _ in range(lim.max_depth + 1):
        if not shape:
            return False
        if over_keys.search(shape) or over_items.search(shape):
            return True
        smaller = _INNERMOST.sub(b"", shape)
        if smaller == shape:  # unbalanced: not JSON, the decoder says why
            return False
        shape = smaller
    return False


_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},:]')


def locate(data: bytes, where: str, lim: StructureLimits) -> tuple[str, str]:
    """(field, problem) of the first place `data` breaks a limit: the top-level field it is in
    (``runs.config``), or `where` itself when the message as a whole breaks it."""
    stack: list[list[int]] = []  # [kind ("{" or "["), entries so far (commas + 1)]
    field: str | None = None
    key: bytes | None = None
    expect_key = False
    for m in _TOKEN.finditer(data):
        tok = m.group()
        c = tok[0]
        if c == 0x22:  # a string
            if expect_key and len(stack) == 1:
                key = tok
            expect_key = False
        elif c in b"{[":
            if len(stack) == 1:
                field = _name(key)
            stack.append([c, 1])
            expect_key = c == 0x7B
            if len(stack) > lim.max_depth:
                return _at(where, field), f"nested too deeply (more than {lim.max_depth} levels)"
        elif c in b"]}":
            if stack:
                stack.pop()
            if len(stack) <= 1:
                field = None
        elif c == 0x2C and stack:  # a comma
            top = stack[-1]
            top[1] += 1
            expect_key = top[0] == 0x7B
            if top[0] == 0x7B and top[1] > lim.max_keys:
                return _at(where, field), f"an object has more than {lim.max_keys} names"
            if top[0] == 0x5B and top[1] > lim.max_items:
                return _at(where, field), f"an array has more than {lim.max_items} entries"
    return where, "breaks a structure limit"  # not reached for a message check_structure refused


def _name(key: bytes | None) -> str | None:
    if key is None:
        return None
    text = key[1:-1].decode("utf-8", "replace")
    return text if text.isidentifier() and len(text) <= 64 else None


def _at(where: str, field: str | None) -> str:
    return f"{where}.{field}" if field else where

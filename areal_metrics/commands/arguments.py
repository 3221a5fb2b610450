"""Argument types the verbs share: one rule per kind of value, checked by argparse (a bad value is
one line and exit 2, before anything is opened)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from urllib.parse import urlsplit

from areal_metrics.errors import UserError
from areal_metrics.producers.contract.settings import mask_url


def seconds(text: str) -> float:
    """A duration in seconds: a finite number above 0 (`nan`, `inf`, 0 and below are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text[:40]!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0 (got {text[:40]!r})")
    return value


def folder(text: str) -> Path:
    """A folder to write into: not empty (argparse's `Path('')` is the current folder, written into unasked)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("give a folder (an empty path would be the current one)")
    return Path(text)


def check_http_url(flag: str, url: str, expected: str) -> str:
    """`url` when it is an http(s) URL with a host, else UserError (exit 2) naming `flag` (the URL's
    password masked): an unclosed IPv6 bracket or a bad port is found here, not inside a request."""
    shown = repr(mask_url(url)[:80])
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - read for its check
    except ValueError as exc:
        raise UserError(f"{flag} {shown}: {exc}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise UserError(f"{flag} {shown}: expected {expected}")
    return url

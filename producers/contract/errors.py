"""One base class for every error this project raises on purpose.

A caller catches `ArealError` to catch them all. The CLI maps them to exit
codes: `UserError` (bad input, a typo, a missing precondition) exits 2,
`ServiceUnavailable` (a broker or store that does not answer, an event that was
not delivered) exits 1. Messages are printed on one line by `one_line`.
"""

from __future__ import annotations


class ArealError(Exception):
    """Base of every error the project raises deliberately."""

    exit_code = 1


class UserError(ArealError):
    """Bad input or a missing precondition; the message says what and where."""

    exit_code = 2


class ConfigError(UserError):
    """A settings or config-file value that cannot be used."""


class ServiceUnavailable(ArealError):
    """A service (Kafka, ClickHouse, the sink's endpoint) did not answer, or did not acknowledge."""

    exit_code = 1


def one_line(message: object, limit: int = 2000) -> str:
    """`message` on one printable line: whitespace runs collapsed, control characters escaped."""
    text = " ".join(str(message).split())
    text = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return text[:limit]

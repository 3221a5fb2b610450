"""Which insert errors a retry can pass, and finding the rows that no retry can store (pure).

A chunk is inserted as one block. When the insert fails with an error that a retry can
pass (the store away, a timeout, too many parts, a table being created), the sink retries
it with backoff, holding its position. When it fails with a *data* error, no retry can
pass, so `isolate` splits the rows in halves, inserting each half as its own block, down
to the single rows that fail; those are returned, to go to the dead-letter topic with the
error, and the rest of the chunk is stored. Any error not known to be a data error counts
as one a retry can pass (the sink waits rather than dead-letters good rows).

Each part's deduplication token is derived from the block's token and the part's log positions,
so a block bisected again after a crash gives the same blocks, which deduplicate.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from areal_metrics.producers.contract.errors import ArealError, one_line
from areal_metrics.sinks.rows import Located

T = TypeVar("T")

# ClickHouse error codes of a value its column cannot take: the same rows fail on every try.
DATA_ERROR_CODES = frozenset({
    6,  # CANNOT_PARSE_TEXT
    27,  # CANNOT_PARSE_INPUT_ASSERTION_FAILED
    38, 41,  # CANNOT_PARSE_DATE, CANNOT_PARSE_DATETIME
    53,  # TYPE_MISMATCH
    69,  # ARGUMENT_OUT_OF_BOUND
    70,  # CANNOT_CONVERT_TYPE
    72,  # CANNOT_PARSE_NUMBER
    117,  # INCORRECT_DATA
    131,  # TOO_LARGE_STRING_SIZE
    321,  # VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE
    349,  # CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN
})
_CODE = re.compile(r"\bCode: (\d+)\b")


class DataError(ArealError):
    """An insert failed for a reason that retrying the same rows cannot change."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(one_line(f"{type(cause).__name__}: {cause}", limit=1000))
        self.cause = cause


def is_data_error(exc: BaseException) -> bool:
    """True when retrying the insert of the same rows cannot pass `exc`.

    Client-side: a value the driver cannot serialise (UnicodeError for a lone surrogate,
    TypeError, a ValueError or OverflowError of a number). Server-side: the data error codes
    above. Everything else (connection errors, timeouts, memory, unknown tables) is retried.
    """
    if isinstance(exc, DataError):
        return True
    if isinstance(exc, OSError):  # connection refused, reset, timed out
        return False
    if isinstance(exc, (UnicodeError, TypeError, OverflowError)):
        return True
    if type(exc) is ValueError:  # the clickhouse_connect errors are not ValueErrors
        return True
    match = _CODE.search(str(exc))
    return match is not None and int(match.group(1)) in DATA_ERROR_CODES


def part_token(token: str, rows: Sequence[Located]) -> str:
    """The deduplication token of a part of a block: the block's, and the log positions of the part's first
    and last rows (a block holds a topic's chunks of several partitions, whose offsets overlap)."""
    first, last = rows[0], rows[-1]
    return f"{token}:{first.partition}.{first.offset}-{last.partition}.{last.offset}"


def isolate(rows: Sequence[Located], token: str, insert: Callable[[Sequence[Located], str], int],
            ) -> tuple[int, list[tuple[Located, DataError]]]:
    """Insert `rows` (as one block with `token`); on a data error, bisect.

    `insert(rows, token)` stores one block and returns its row count; it retries what a
    retry can pass itself and raises `DataError` for the rest. Returns (rows stored, the
    rows that failed alone with their error), in log order.
    """
    if not rows:
        return 0, []
    try:
        return insert(rows, token), []
    except DataError as exc:
        if len(rows) == 1:
            return 0, [(rows[0], exc)]
    mid = len(rows) // 2
    stored, bad = 0, []
    for half in (rows[:mid], rows[mid:]):
        n, failed = isolate(half, part_token(token, half), insert)
        stored += n
        bad += failed
    return stored, bad

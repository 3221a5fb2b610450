"""The one codec of the stream worker's state: its msgspec Structs <-> JSON bytes.

Every piece of state (areal_metrics.streams.core.processor.RunState and what it holds) is a
frozen Struct with typed fields (areal_metrics.streams.core.stored), so msgspec encodes it and
decodes it by its type: no hand-written to_dict/from_dict per class and no key built by
joining strings (a structured key such as voting.RoundKey, or a tuple, stays structured).

Encoding
- Struct -> JSON object of its fields, in order (a field missing on decode takes its
  default, so state written by an older worker still loads; an unknown one is ignored);
- tuple -> JSON array (so is a waiting step's `Reports`, areal_metrics.streams.core.ranks); a `Pairs` mapping -> a JSON array of [key, value] pairs (keys may be
  Structs or tuples: nothing is ever parsed out of a string);
- str, int, float, bool, None -> themselves; `Any` -> the JSON value as is.

`loads` checks every value against its declared type and raises `StateDecodeError` (its
message ends with the path of the bad field, msgspec's "- at `$...`") for anything else, so a
corrupt or foreign record is refused as a whole instead of producing a half-valid state. A
non-finite float is written as null, which then does not decode (a number is expected): such
a state is never taken back silently.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any, TypeVar, get_args, get_origin

import msgspec

from areal_metrics.producers.contract.errors import ArealError
from areal_metrics.streams.core.ranks import RankReport, Reports
from areal_metrics.streams.core.stored import Pairs

T = TypeVar("T")


class StateDecodeError(ArealError, ValueError):
    """A stored state record that does not decode to its type; the message names the field."""


def _enc_hook(obj: Any) -> Any:
    if type(obj) is Pairs:
        return list(obj.items())
    if type(obj) is Reports:
        return list(obj)
    raise NotImplementedError(f"stream state: cannot encode {type(obj).__name__}")


def _dec_hook(tp: Any, obj: Any) -> Any:
    if get_origin(tp) is Pairs:
        key, value = get_args(tp)
        try:
            return Pairs(dict(msgspec.convert(obj, list[tuple[key, value]], dec_hook=_dec_hook)))
        except msgspec.ValidationError as exc:
            # msgspec adds the mapping's own path when a hook raises ValueError (see _one_path)
            raise ValueError(str(exc)) from None
    if tp is Reports:
        try:
            return Reports(msgspec.convert(obj, list[RankReport]))
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc)) from None
    raise NotImplementedError(f"stream state: no decoder for {tp!r}")


_AT = re.compile(r" - at `(\$[^`]*)`")


def _one_path(message: str) -> str:
    """msgspec's message of an error inside a mapping: 'what - at `$inner` - at `$outer`'
    -> 'what - at `$outer<inner>`' (each mapping's hook reports the path from itself)."""
    paths = _AT.findall(message)
    if len(paths) < 2:
        return message
    whole = paths[-1] + "".join(p[1:] for p in reversed(paths[:-1]))
    return f"{_AT.split(message, maxsplit=1)[0]} - at `{whole}`"


dumps = msgspec.json.Encoder(enc_hook=_enc_hook).encode


@cache
def _decoder(tp: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(tp, dec_hook=_dec_hook)


def loads(tp: type[T], raw: bytes | str, where: str = "") -> T:
    """JSON bytes -> an instance of `tp`; StateDecodeError for anything that does not fit
    (its message names `where`, the record's place in the state, when given)."""
    try:
        return _decoder(tp).decode(raw)
    except msgspec.ValidationError as exc:
        raise StateDecodeError(f"stream state{' ' + where if where else ''}: {_one_path(str(exc))}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise StateDecodeError(f"stream state{' ' + where if where else ''}: not JSON ({exc})") from None


def parse(raw: bytes | str) -> Any:
    """JSON bytes -> plain data; StateDecodeError when they are not JSON."""
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, TypeError) as exc:
        raise StateDecodeError(f"stream state: not JSON ({exc})") from None


def convert(tp: type[T], data: Any, where: str) -> T:
    """Plain data (a part of a record that was parsed already) -> an instance of `tp`;
    StateDecodeError naming `where` for anything that does not fit."""
    try:
        return msgspec.convert(data, tp, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        raise StateDecodeError(f"stream state {where}: {_one_path(str(exc))}") from None

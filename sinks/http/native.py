"""ClickHouse's Native format in the layout a client's protocol revision expects.

chdb writes Native as ClickHouse does for revision 0: per block, the column
and row counts, then per column its name, type and data. A client that names
its `client_protocol_version` (clickhouse-go always does, clickhouse-connect
after a probe) decodes blocks the way a server writes them for that revision:

- revision > 0: the block info first (field 1 `is_overflows` = 0, field 2
  `bucket_num` = -1, from revision 54480 field 3 `out_of_order_buckets` = [],
  then the end mark 0);
- revision >= 54454: after each column's type name one byte, 0 = no custom
  serialization.

Inserting that byte means knowing where each column's data ends, so this
module walks the data of every type the store can return (fixed-width
numbers, dates and times, strings, Nullable, Array, Map, Tuple,
LowCardinality, Enum, Decimal, UUID, IP, Nothing, the geo types). The
self-describing types (Dynamic, Variant, JSON, Object, AggregateFunction)
raise `UnsupportedType`: ask for another FORMAT for them.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from areal_metrics.producers.contract.errors import ArealError

BLOCK_INFO_REVISION = 1  # any revision > 0 (51903 in ClickHouse's sources; every client sends more)
CUSTOM_SERIALIZATION_REVISION = 54454
OUT_OF_ORDER_BUCKETS_REVISION = 54480

_FIXED = {
    "UInt8": 1, "Int8": 1, "Bool": 1, "Enum8": 1, "Nothing": 1,
    "UInt16": 2, "Int16": 2, "Date": 2, "Enum16": 2, "BFloat16": 2,
    "UInt32": 4, "Int32": 4, "Float32": 4, "DateTime": 4, "Date32": 4, "IPv4": 4, "Time": 4, "Decimal32": 4,
    "UInt64": 8, "Int64": 8, "Float64": 8, "DateTime64": 8, "Time64": 8, "Decimal64": 8,
    "UInt128": 16, "Int128": 16, "UUID": 16, "IPv6": 16, "Decimal128": 16,
    "UInt256": 32, "Int256": 32, "Decimal256": 32,
}
_ALIASES = {  # geo types are named tuples and arrays of them
    "Point": "Tuple(Float64, Float64)",
    "Ring": "Array(Tuple(Float64, Float64))",
    "LineString": "Array(Tuple(Float64, Float64))",
    "MultiLineString": "Array(Array(Tuple(Float64, Float64)))",
    "Polygon": "Array(Array(Tuple(Float64, Float64)))",
    "MultiPolygon": "Array(Array(Array(Tuple(Float64, Float64))))",
}
_UNSUPPORTED = ("Dynamic", "Variant", "JSON", "Object", "AggregateFunction", "Nested")
_NAMED_ELEMENT = re.compile(r"^(`[^`]*`|[A-Za-z_][A-Za-z0-9_]*)\s+(\S.*)$", re.DOTALL)


class UnsupportedType(ArealError, ValueError):
    """A column type whose Native data this module cannot delimit."""


class Truncated(ArealError, ValueError):
    """The Native bytes end inside a block."""


@dataclass(frozen=True, slots=True)
class Type:
    """A parsed ClickHouse type: its name and, for compound types, the element types."""

    name: str
    args: tuple[Type, ...] = ()
    size: int = 0  # bytes per value of a fixed-width type, else 0


@lru_cache(maxsize=1024)
def parse_type(text: str) -> Type:
    text = text.strip()
    if text in _ALIASES:
        return parse_type(_ALIASES[text])
    head, _, rest = text.partition("(")
    head = head.strip()
    inner = rest[:-1] if rest.endswith(")") else ""
    if head in _UNSUPPORTED:
        raise UnsupportedType(f"Native output of {text} is not supported here; ask for another FORMAT")
    if head in ("Nullable", "Array", "LowCardinality"):
        return Type(head, (parse_type(inner),))
    if head == "Map":
        key, value = split_top_level(inner)
        return Type("Map", (parse_type(key), parse_type(value)))
    if head == "Tuple":
        return Type("Tuple", tuple(parse_type(_element_type(e)) for e in split_top_level(inner)))
    if head == "SimpleAggregateFunction":
        return parse_type(split_top_level(inner)[-1])
    if head == "FixedString":
        return Type(head, size=int(inner))
    if head == "Decimal":
        precision = int(split_top_level(inner)[0])
        return Type(head, size=4 if precision <= 9 else 8 if precision <= 18 else 16 if precision <= 38 else 32)
    if head.startswith("Interval"):
        return Type(head, size=8)
    if head in _FIXED:
        return Type(head, size=_FIXED[head])
    if head == "String":
        return Type(head)
    raise UnsupportedType(f"Native output of type {text} is not supported here; ask for another FORMAT")


def _element_type(element: str) -> str:
    """`name Type` in a named tuple -> `Type`; a bare type stays (its first space, if any, follows a '(')."""
    element = element.strip()
    space, paren = element.find(" "), element.find("(")
    if space < 0 or 0 <= paren < space:
        return element
    match = _NAMED_ELEMENT.match(element)
    return match.group(2) if match else element


def split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    i = 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'`\"":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
        i += 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


# ------------------------------------------------------------------ reading


class Reader:
    """A position in a bytes buffer; every read checks the bounds."""

    def __init__(self, data: bytes | memoryview, pos: int = 0) -> None:
        self.data = data
        self.pos = pos

    def need(self, n: int) -> int:
        start = self.pos
        if start + n > len(self.data):
            raise Truncated(f"Native data ends at byte {len(self.data)}, needed {start + n}")
        self.pos = start + n
        return start

    def varuint(self) -> int:
        shift = value = 0
        while True:
            byte = self.data[self.need(1)]
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise ValueError("malformed variable-length integer in Native data")

    def string(self) -> bytes:
        n = self.varuint()
        start = self.need(n)
        return bytes(self.data[start:start + n])

    def uint64(self) -> int:
        start = self.need(8)
        return int(struct.unpack_from("<Q", self.data, start)[0])

    def skip_strings(self, rows: int) -> None:
        data, pos, end = self.data, self.pos, len(self.data)
        for _ in range(rows):
            if pos >= end:
                raise Truncated("Native data ends inside a String column")
            first = data[pos]
            if first < 0x80:  # the common case: a length under 128
                pos += 1 + first
            else:
                self.pos = pos
                n = self.varuint()
                pos = self.pos + n
        if pos > end:
            raise Truncated("Native data ends inside a String column")
        self.pos = pos


_LC_KEYS_SIZE = (1, 2, 4, 8)
_LC_HAS_ADDITIONAL_KEYS = 1 << 9
_LC_NEEDS_GLOBAL_DICTIONARY = 1 << 8


def skip_prefix(r: Reader, t: Type) -> None:
    """The serialization state prefix of a column (LowCardinality's key version, nested ones first)."""
    if t.name == "LowCardinality":
        r.uint64()
        return
    for arg in t.args:
        skip_prefix(r, arg)


def skip_data(r: Reader, t: Type, rows: int) -> None:
    """Advance past `rows` values of type `t`."""
    if t.size:
        r.need(t.size * rows)
    elif t.name == "String":
        r.skip_strings(rows)
    elif t.name == "Nullable":
        r.need(rows)
        skip_data(r, t.args[0], rows)
    elif t.name in ("Array", "Map"):
        nested = 0
        if rows:
            start = r.need(8 * rows)
            nested = int(struct.unpack_from("<Q", r.data, start + 8 * (rows - 1))[0])
        for arg in t.args:  # Map(K, V) is Array(Tuple(K, V)): keys, then values
            skip_data(r, arg, nested)
    elif t.name == "Tuple":
        for arg in t.args:
            skip_data(r, arg, rows)
    elif t.name == "LowCardinality":
        _skip_low_cardinality(r, t.args[0], rows)
    else:
        raise UnsupportedType(f"cannot delimit Native data of {t.name}")


def _skip_low_cardinality(r: Reader, inner: Type, rows: int) -> None:
    keys_type = inner.args[0] if inner.name == "Nullable" else inner  # the dictionary holds no NULL
    left = rows
    while left > 0:  # one granule per dictionary: flags, [keys], indexes
        flags = r.uint64()
        if flags & _LC_NEEDS_GLOBAL_DICTIONARY:
            raise UnsupportedType("LowCardinality with a shared dictionary in Native data")
        if flags & _LC_HAS_ADDITIONAL_KEYS:
            skip_data(r, keys_type, r.uint64())
        count = r.uint64()
        if count == 0 or count > left:
            raise ValueError(f"LowCardinality granule of {count} rows with {left} left")
        r.need(_LC_KEYS_SIZE[flags & 0xFF] * count)
        left -= count


# ------------------------------------------------------------------ writing


def block_info(revision: int) -> bytes:
    """The block info a server writes before each block for `revision` (empty for 0)."""
    if revision < BLOCK_INFO_REVISION:
        return b""
    info = b"\x01\x00\x02\xff\xff\xff\xff"  # is_overflows = false, bucket_num = -1
    if revision >= OUT_OF_ORDER_BUCKETS_REVISION:
        info += b"\x03\x00"  # out_of_order_buckets = []
    return info + b"\x00"


def _varuint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def for_revision(native: bytes, revision: int) -> Iterator[bytes]:
    """chdb's (revision 0) Native bytes as a server writes them for a client of `revision`, block by block."""
    if revision <= 0:
        if native:
            yield native
        return
    info = block_info(revision)
    custom = revision >= CUSTOM_SERIALIZATION_REVISION
    view = memoryview(native)
    r = Reader(view)
    while r.pos < len(view):
        out = bytearray(info)
        columns, rows = r.varuint(), r.varuint()
        out += _varuint(columns) + _varuint(rows)
        for _ in range(columns):
            name, type_name = r.string(), r.string()
            out += _varuint(len(name)) + name + _varuint(len(type_name)) + type_name
            if custom:
                out.append(0)  # no custom (sparse) serialization: chdb writes full columns
            if rows:
                start = r.pos
                t = parse_type(type_name.decode())
                skip_prefix(r, t)
                skip_data(r, t, rows)
                out += view[start:r.pos]
        yield bytes(out)


def header_block(columns: list[tuple[str, str]], revision: int) -> bytes:
    """A block of no rows naming the columns (what a server sends for an empty result)."""
    out = bytearray(block_info(revision))
    out += _varuint(len(columns)) + _varuint(0)
    for name, type_name in columns:
        for text in (name.encode(), type_name.encode()):
            out += _varuint(len(text)) + text
        if revision >= CUSTOM_SERIALIZATION_REVISION:
            out.append(0)
    return bytes(out)

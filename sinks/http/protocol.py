"""The ClickHouse HTTP interface as data: what a request asks for, and how errors and bodies are framed.

Pure functions, no engine and no socket (`areal_metrics.sinks.http.server` is the shell):

- `credentials(...)`: the user and password of a request, from the
  `X-ClickHouse-User`/`X-ClickHouse-Key` headers, HTTP basic auth, or the
  `user`/`password` URL parameters (mixing them is refused, as ClickHouse does);
- `parse_request(...)`: the statement (URL `query=`, POST body, or both: URL
  prefix + body), the data of an INSERT, the database, the output format
  (`default_format`, or the statement's own `FORMAT` clause), the query
  parameters (`param_*`), the settings to apply (every other URL parameter
  but the transport ones), the client's protocol revision;
- `ClickHouseError`, `http_status(code)`, `error_body(...)`: ClickHouse's
  error text (`Code: N. DB::Exception: ...`) and status mapping;
- `response_encoding(...)`, `encode(...)`, `decode(...)`: HTTP compression
  (only with `enable_http_compression=1`, as ClickHouse).
"""

from __future__ import annotations

import base64
import binascii
import gzip
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from areal_metrics.producers.contract.errors import ArealError

# URL parameters the HTTP layer consumes; everything else is a setting for the engine
TRANSPORT_PARAMS = frozenset({
    "query", "database", "default_format", "user", "password", "quota_key", "query_id",
    "session_id", "session_timeout", "session_check", "compress", "decompress", "buffer_size",
    "wait_end_of_query", "client_protocol_version", "role", "enable_http_compression",
    "send_progress_in_http_headers", "http_headers_progress_interval_ms", "http_zlib_compression_level",
    "cancel_http_readonly_queries_on_client_close", "http_native_compression_disable_checksumming_on_decompress",
    "add_http_cors_header", "http_response_buffer_size", "http_wait_end_of_query",
})
SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TRAILING_FORMAT = re.compile(r"\bFORMAT\s+([A-Za-z_][A-Za-z0-9_]*)(\s+SETTINGS\b.*)?\s*;?\s*$", re.IGNORECASE | re.DOTALL)
_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|`(?:[^`\\]|\\.)*`|\"(?:[^\"\\]|\\.)*\"", re.DOTALL)
_INTO_OUTFILE = re.compile(r"\bINTO\s+OUTFILE\b", re.IGNORECASE)
_INSERT_WITH_DATA = re.compile(  # INSERT INTO t [(cols)] [SETTINGS ...] FORMAT x | VALUES, then the data
    rb"^\s*(INSERT\s+INTO\s+(?:TABLE\s+)?[\w.`\"]+\s*(?:\([^()]*\))?(?:\s*SETTINGS\s+[^()]*?)?)"
    rb"\s*(?:FORMAT\s+([A-Za-z_][A-Za-z0-9_]*)|VALUES)[ \t]*\r?\n?", re.IGNORECASE | re.DOTALL)
_RESULT_STATEMENT = re.compile(r"^\s*\(*\s*(SELECT|WITH|SHOW|DESC|DESCRIBE|EXPLAIN|EXISTS|CHECK|VALUES)\b", re.IGNORECASE)

# ClickHouse error codes used here (numbers from the engine's errorCodeToName), and the HTTP
# status ClickHouse's exceptionCodeToHTTPStatus gives each class of them
SYNTAX_ERROR, UNKNOWN_FORMAT, UNKNOWN_SETTING, NOT_IMPLEMENTED, BAD_ARGUMENTS = 62, 73, 115, 48, 36
INTO_OUTFILE_NOT_ALLOWED, ACCESS_DENIED, TOO_MANY_SIMULTANEOUS_QUERIES = 358, 497, 202
READONLY, REQUIRED_PASSWORD, AUTHENTICATION_FAILED, CANNOT_DECOMPRESS, UNKNOWN_EXCEPTION = 164, 194, 516, 271, 1002
_FORBIDDEN = {192, 193, 516, 512}  # UNKNOWN_USER, WRONG_PASSWORD, AUTHENTICATION_FAILED, SET_NON_GRANTED_ROLE
_BAD_REQUEST = {36, 427, 6, 25, 26, 38, 41, 72, 441, 675, 676, 27, 376, 15, 44, 37, 123, 8, 167, 168, 223, 62, 117,
                53, 321}  # BAD_ARGUMENTS, the CANNOT_PARSE_*, the AST errors, SYNTAX_ERROR, INCORRECT_DATA, ...
_NOT_FOUND = {60, 46, 47, 50, 56, 81, 115, 152, 63, 73, 336, 78, 511}  # the UNKNOWN_* errors
_OTHER_STATUS = {194: 401, 229: 413, 48: 501, 209: 503, 76: 503, 381: 411, 159: 408, 439: 503, 202: 503}
_CODE = re.compile(r"Code: (\d+)\.")


class ClickHouseError(ArealError):
    """An error as ClickHouse reports it: a code and its message (without the `Code: N.` prefix)."""

    def __init__(self, code: int, message: str, name: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.name = name

    @classmethod
    def from_engine(cls, exc: BaseException, user: str = "default") -> ClickHouseError:
        """chdb's error text (`Code: N. DB::Exception: ...`), code and all; chdb's own user is
        `default`, the message names the user of the request instead."""
        text = str(exc).strip()
        match = _CODE.search(text)
        if match is None:
            return cls(UNKNOWN_EXCEPTION, f"DB::Exception: {text or type(exc).__name__}")
        message = text[match.end():].strip()
        return cls(int(match.group(1)), message.replace("DB::Exception: default: ", f"DB::Exception: {user}: ", 1))

    def text(self) -> str:
        message = self.message if self.message.startswith("DB::Exception") else f"DB::Exception: {self.message}"
        suffix = f" ({self.name})" if self.name and f"({self.name})" not in message else ""
        return f"Code: {self.code}. {message}{suffix}"


def http_status(code: int) -> int:
    """The HTTP status ClickHouse answers an error code with."""
    if code in _FORBIDDEN:
        return 403
    if code in _BAD_REQUEST:
        return 400
    if code in _NOT_FOUND:
        return 404
    return _OTHER_STATUS.get(code, 500)


def error_body(err: ClickHouseError, version: str) -> bytes:
    return f"{err.text()} (version {version})\n".encode()


def auth_failed(user: str) -> ClickHouseError:
    return ClickHouseError(AUTHENTICATION_FAILED, f"{user}: Authentication failed: password is incorrect, "
                           "or there is no user with such name.", "AUTHENTICATION_FAILED")


# ----------------------------------------------------------------- requests


def credentials(headers: Mapping[str, str], params: Mapping[str, str]) -> tuple[str, str]:
    """(user, password) as ClickHouse reads them; raises ClickHouseError(516) for mixed schemes."""
    user, key = headers.get("X-ClickHouse-User", ""), headers.get("X-ClickHouse-Key", "")
    authorization = headers.get("Authorization", "")
    if user or key:
        if authorization or "user" in params or "password" in params:
            raise ClickHouseError(AUTHENTICATION_FAILED, "Invalid authentication: it is not allowed to use "
                                  "X-ClickHouse HTTP headers and other authentication methods simultaneously")
        return user or "default", key
    if authorization:
        if "user" in params or "password" in params:
            raise ClickHouseError(AUTHENTICATION_FAILED, "Invalid authentication: it is not allowed to use "
                                  "Authorization HTTP header and authentication via parameters simultaneously")
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() != "basic":
            raise ClickHouseError(AUTHENTICATION_FAILED, f"Invalid authentication: '{scheme}' HTTP Authorization "
                                  "scheme is not supported")
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise ClickHouseError(AUTHENTICATION_FAILED, "Invalid authentication: malformed Basic credentials") from None
        name, _, password = decoded.partition(":")
        return name or "default", password
    return params.get("user", "default"), params.get("password", "")


@dataclass(frozen=True)
class Request:
    """One statement to run, as the request asks for it."""

    sql: str  # the statement (for an INSERT with data: up to and without FORMAT/VALUES)
    database: str | None
    default_format: str
    settings: dict[str, str] = field(default_factory=dict)
    parameters: dict[str, str] = field(default_factory=dict)
    revision: int = 0  # client_protocol_version
    insert_format: str | None = None  # set: `data` is the INSERT's input in this format
    data: bytes = b""
    query_id: str = ""


def _int_param(params: Mapping[str, str], name: str) -> int:
    value = params.get(name, "0") or "0"
    try:
        return int(value)
    except ValueError:
        raise ClickHouseError(BAD_ARGUMENTS, f"Cannot parse {name} {value!r} as a number") from None


def parse_request(params: Mapping[str, str], body: bytes, headers: Mapping[str, str]) -> Request:
    """The statement a request asks for (see the module docstring). Raises ClickHouseError."""
    for flag in ("compress", "decompress"):
        if params.get(flag, "0") not in ("", "0", "false"):
            raise ClickHouseError(NOT_IMPLEMENTED, f"{flag}=1 (ClickHouse's native block compression) is not "
                                  "supported by this endpoint; use HTTP compression (enable_http_compression=1 "
                                  "and Accept-Encoding, or Content-Encoding for a request body)")
    url_query = params.get("query", "")
    sql, insert_format, data = _statement(url_query, body)
    if not sql.strip():
        raise ClickHouseError(SYNTAX_ERROR, "Empty query", "SYNTAX_ERROR")
    settings = {}
    for name, value in params.items():
        if name in TRANSPORT_PARAMS or name.startswith("param_"):
            continue
        if not SETTING_NAME.match(name):
            raise ClickHouseError(UNKNOWN_SETTING, f"Unknown setting '{name}'", "UNKNOWN_SETTING")
        settings[name] = value
    return Request(
        sql=sql,
        database=params.get("database") or headers.get("X-ClickHouse-Database") or None,
        default_format=params.get("default_format") or headers.get("X-ClickHouse-Format") or "TabSeparated",
        settings=settings,
        parameters={k[len("param_"):]: v for k, v in params.items() if k.startswith("param_")},
        revision=_int_param(params, "client_protocol_version"),
        insert_format=insert_format,
        data=data,
        query_id=params.get("query_id") or headers.get("X-ClickHouse-Query-Id", ""),
    )


def _statement(url_query: str, body: bytes) -> tuple[str, str | None, bytes]:
    """(sql, insert format, insert data): the text is the URL query followed by the body, as in
    ClickHouse; an INSERT's data is what follows its FORMAT name (or VALUES) in that text."""
    raw = url_query.encode() if url_query else body
    head = _INSERT_WITH_DATA.match(raw)
    if head:
        data = raw[head.end():] + (body if url_query else b"")
        return head.group(1).decode(), head.group(2).decode() if head.group(2) else "Values", data
    return url_query + _text(body), None, b""


def _text(body: bytes) -> str:
    try:
        return body.decode()
    except UnicodeDecodeError:
        raise ClickHouseError(SYNTAX_ERROR, "The query is not valid UTF-8", "SYNTAX_ERROR") from None


# -------------------------------------------------------------- statements


def without_literals(statement: str) -> str:
    """The statement with its quoted strings and identifiers blanked (for keyword checks)."""
    return _QUOTED.sub("''", statement)


def output_format(statement: str, default_format: str) -> str:
    """The format of the result: the statement's FORMAT clause, else default_format."""
    match = _TRAILING_FORMAT.search(without_literals(statement))
    return match.group(1) if match else default_format


def returns_rows(statement: str) -> bool:
    return bool(_RESULT_STATEMENT.match(statement))


def check_statement(canonical: str, *, readonly: bool) -> None:
    """Refuse what a ClickHouse server would refuse that the embedded engine would run.

    `canonical` is the engine's own single-line rendering of the statement
    (`formatQuerySingleLine`: one statement, no comments). INTO OUTFILE would
    write a file in the holder's process: a server refuses it over HTTP (358).
    KILL: every session of the embedded engine is the same engine user, so
    the reader could stop the sink's queries; ClickHouse asks for a grant (497).
    """
    bare = without_literals(canonical)
    if _INTO_OUTFILE.search(bare):
        raise ClickHouseError(INTO_OUTFILE_NOT_ALLOWED, "INTO OUTFILE is not allowed", "INTO_OUTFILE_NOT_ALLOWED")
    if readonly and bare.lstrip().upper().startswith("KILL"):
        raise ClickHouseError(ACCESS_DENIED, "Not enough privileges. To execute this query, it's necessary to have "
                              "the grant KILL QUERY ON *.*", "ACCESS_DENIED")


# -------------------------------------------------------------- compression

_CONTENT_TYPES = {
    "TabSeparated": "text/tab-separated-values; charset=UTF-8", "TSV": "text/tab-separated-values; charset=UTF-8",
    "CSV": "text/csv; charset=UTF-8; header=absent", "CSVWithNames": "text/csv; charset=UTF-8; header=present",
}


def content_type(fmt: str) -> str:
    if fmt in _CONTENT_TYPES:
        return _CONTENT_TYPES[fmt]
    if fmt.startswith(("TabSeparated", "TSV")):
        return "text/tab-separated-values; charset=UTF-8"
    if fmt.startswith("JSON"):
        return "application/json; charset=UTF-8"
    if fmt in ("Native", "Arrow", "ArrowStream", "Parquet", "ORC", "Avro") or fmt.startswith("RowBinary"):
        return "application/octet-stream"
    return "text/plain; charset=UTF-8"


def _zstd():  # type: ignore[no-untyped-def]
    try:
        from compression import zstd  # type: ignore[import-not-found]  # Python 3.14
    except ImportError:
        try:
            from backports import zstd  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return None
    return zstd


def _lz4():  # type: ignore[no-untyped-def]
    try:
        import lz4.frame
    except ImportError:
        return None
    return lz4.frame


def available_encodings() -> list[str]:
    out = ["gzip", "deflate"]
    if _zstd() is not None:
        out.append("zstd")
    if _lz4() is not None:
        out.append("lz4")
    return out


def response_encoding(accept_encoding: str, enabled: bool) -> str | None:
    """The first method the client accepts that we can write; None unless enable_http_compression."""
    if not enabled or not accept_encoding:
        return None
    ours = available_encodings()
    for item in accept_encoding.split(","):
        name = item.split(";")[0].strip().lower()
        if name in ours:
            return name
    return None


def encode(data: bytes, method: str | None) -> bytes:
    if method is None or not data:
        return data
    if method == "gzip":
        return gzip.compress(data, compresslevel=3)
    if method == "deflate":
        return zlib.compress(data, 3)
    if method == "zstd":
        return _zstd().compress(data)  # type: ignore[no-any-return,union-attr]
    if method == "lz4":
        return _lz4().compress(data)  # type: ignore[no-any-return,union-attr]
    raise ValueError(method)


def decode(data: bytes, content_encoding: str) -> bytes:
    """A request body as sent with Content-Encoding (gzip, deflate, zstd, lz4, br)."""
    method = content_encoding.strip().lower()
    if not method or method == "identity" or not data:
        return data
    try:
        if method in ("gzip", "x-gzip"):
            return gzip.decompress(data)
        if method == "deflate":
            return zlib.decompress(data)
        if method == "zstd" and _zstd() is not None:
            return _zstd().decompress(data)  # type: ignore[no-any-return,union-attr]
        if method == "lz4" and _lz4() is not None:
            return _lz4().decompress(data)  # type: ignore[no-any-return,union-attr]
        if method == "br":
            import brotli  # type: ignore[import-not-found]

            return brotli.decompress(data)  # type: ignore[no-any-return]
    except ImportError:
        pass
    except Exception as exc:  # noqa: BLE001 - a corrupt body: one ClickHouse error
        raise ClickHouseError(CANNOT_DECOMPRESS, f"Cannot decompress the request body ({method}): {exc}", "CANNOT_DECOMPRESS") from None
    raise ClickHouseError(NOT_IMPLEMENTED, f"Content-Encoding {method!r} is not supported here")

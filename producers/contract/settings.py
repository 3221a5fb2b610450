"""Settings from the environment (CONTRACT.md, 'Settings' and 'Adoption'): every AREAL_*
variable the project reads is a field of a settings class, declared with its variable, default,
range and readers, and parsed here, by one parser. `Settings` holds those several processes read
(the broker, the topics, the store, security, limits); a setting one process alone reads lives
beside that process in a `SettingGroup` (the client's in producers/client/settings.py, the stream
worker's in streams/shell/settings.py, the sink's in sinks/settings.py, the stack's in
areal_metrics/stack/settings.py, Grafana's in grafana/settings.py, the trainer's in
areal_train/settings.py, the benchmarks' in benchmarks/settings.py). docs/SETTINGS.md is generated from the declarations of them all
(`python -m areal_metrics.all_settings`), and tests/test_settings.py holds it to them.

What the environment leaves unset of the broker, the topic prefix and the store comes from the
stack `areal-metrics up` recorded in the state folder (`AREAL_HOME`, default ~/.areal).

Secrets (SASL password) come from the environment or a file and are never printed:
`Settings.__repr__` and `public()` mask them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, Self, Union, get_args, get_origin, get_type_hints

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.topics import DEFAULT_PREFIX, Topics

DEFAULT_STATE_DIR = ".areal"  # under the user's home directory: one folder per user, whatever the working directory
STACK_FILE = "stack.json"  # written by `areal-metrics up` into the state folder
# The last resort when neither AREAL_KAFKA_BOOTSTRAP nor a stack recorded by `up` names a broker.
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# Who reads a setting, for the docs' table: the client in a trainer, the stream worker, the
# sink, the local stack and CLI, the reference trainer, the benchmarks.
READERS = ("client", "worker", "sink", "stack", "trainer", "benchmarks")
# The SASL mechanisms the clients (kafka-python, aiokafka, librdkafka) and the local broker share;
# lower case, as settings with `choices` are read.
SASL_MECHANISMS = ("plain", "scram-sha-256", "scram-sha-512")
SECURITY_PROTOCOLS = ("plaintext", "ssl", "sasl_plaintext", "sasl_ssl")
# Producer compression codecs Kafka knows; librdkafka (confluent-kafka) has them all built in,
# kafka-python gzip from the standard library and the others from optional packages.
KAFKA_COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")


@dataclass(frozen=True)
class Form:
    """How a text setting is read beyond its type, in its annotation: `Annotated[str, PATH] | None`."""

    name: str


PATH = Form("path")  # a file or folder; `init()` takes an os.PathLike too
HOSTPORTS = Form("hostports")  # host:port[,host:port...], no scheme


def setting(env: str, default: Any, doc: str, *, ge: float | None = None,
            le: float | None = None, choices: tuple[str, ...] = (), readers: str = "client worker sink",
            secret: bool = False, default_doc: str | None = None) -> Any:
    """A Settings field read from the environment variable `env` (docs/SETTINGS.md is made
    from these declarations). The field's annotation is its type: int, float, bool or str, a str
    with `choices`, or a str `Form` (PATH, HOSTPORTS); `| None` when it may be unset."""
    assert set(readers.split()) <= set(READERS), readers
    meta = {"env": env, "doc": doc, "ge": ge, "le": le, "choices": choices,
            "readers": tuple(readers.split()), "secret": secret,
            "default_doc": default_doc if default_doc is not None else _shown(default)}
    return field(default=default, metadata=meta, repr=not secret)


def _shown(default: Any) -> str:
    return "unset" if default is None or default == "" else f"`{default}`"


def _kind(f: Any) -> str:
    """How field `f` is read, from its annotation: int, float, bool, str, choice, path or hostports."""
    return _KINDS[f]


# field -> its kind, for the fields of every settings class (`settings_fields` fills it)
_KINDS: dict[Any, str] = {}


@cache
def settings_fields(cls: type) -> tuple[Any, ...]:
    """The fields of a settings class (`Settings`, or a process's own, a `SettingGroup`), each
    annotation checked to be a setting's type: int, float, bool or str, a str with `choices`, or
    a str `Form`, each `| None` when it may be unset."""
    hints = get_type_hints(cls, include_extras=True)
    out = tuple(fields(cls))
    for f in out:
        assert "env" in f.metadata, f"{cls.__name__}.{f.name}: declare it with setting()"
        hint, forms = hints[f.name], []
        if get_origin(hint) in (Union, UnionType) and NoneType in get_args(hint):  # `X | None`: may be unset
            (hint,) = [a for a in get_args(hint) if a is not NoneType]
        if get_origin(hint) is Annotated:
            hint, *extras = get_args(hint)
            forms = [e.name for e in extras if isinstance(e, Form)]
        plain = {int: "int", float: "float", bool: "bool", str: "str"}.get(hint)
        assert plain is not None, f"{cls.__name__}.{f.name}: {hint} is not a setting's type"
        assert not (forms or f.metadata["choices"]) or plain == "str", f"{cls.__name__}.{f.name}: a form of str"
        _KINDS[f] = forms[0] if forms else "choice" if f.metadata["choices"] else plain
    return out


def _parse(f: Any, raw: str, label: str | None = None) -> Any:
    """One variable's text -> its value; ConfigError naming the variable otherwise."""
    m = f.metadata
    kind, text = _kind(f), raw.strip()
    name = label or f"{m['env']}={text[:40]!r}"
    if kind in ("str", "path"):
        return text
    if kind == "hostports":
        return _hostports(name, text)
    if kind == "choice":
        if text.lower() not in m["choices"]:
            raise ConfigError(f"{name}: expected one of {', '.join(m['choices'])}")
        return text.lower()
    if kind == "bool":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"{name}: expected 1/0, true/false, yes/no or on/off")
    try:
        value: float = int(text) if kind == "int" else float(text)
    except ValueError:
        raise ConfigError(f"{name}: expected {'an integer' if kind == 'int' else 'a number'}") from None
    return _in_range(f, name, value)


def _in_range(f: Any, name: str, value: float) -> float:
    m = f.metadata
    if _kind(f) == "float" and not math.isfinite(value):
        raise ConfigError(f"{name}: expected a finite number")
    if (m["ge"] is not None and value < m["ge"]) or (m["le"] is not None and value > m["le"]):
        low = "" if m["ge"] is None else f">= {m['ge']:g}"
        high = "" if m["le"] is None else f"<= {m['le']:g}"
        raise ConfigError(f"{name}: expected a number {' and '.join(filter(None, (low, high)))}")
    return value


# One bootstrap server: a host name, an IPv4 address or a bracketed IPv6 address, then `:port`.
_HOSTPORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


def _hostports(name: str, text: str) -> str:
    """`host:port[,host:port...]` as given (spaces around commas dropped); ConfigError naming the variable."""
    parts = [p.strip() for p in text.split(",")]
    for part in parts:
        found = _HOSTPORT.fullmatch(part)
        if found is None or not 1 <= int(found.group(1)) <= 65535:
            raise ConfigError(f"{name}: expected host:port[,host:port...] (e.g. 127.0.0.1:9092, no scheme); "
                              f"{part[:60]!r} is not one")
    return ",".join(parts)


def _override(f: Any, value: Any) -> Any:
    """A value given in Python (`init(exit_timeout_s=...)`) -> the setting's value, by the rules the variable
    follows: text goes through the variable's parser, numbers through the same range checks."""
    m = f.metadata
    label = f"{f.name}={'***' if m['secret'] else repr(value)[:40]} ({m['env']})"  # a secret is never printed
    if value is None:
        if f.default is None:
            return None
        raise ConfigError(f"{label}: expected a value (None is not one)")
    if isinstance(value, os.PathLike) and _kind(f) == "path":
        value = os.fspath(value)
    if isinstance(value, str):
        return _parse(f, value, label)
    kind = _kind(f)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return int(_in_range(f, label, value))
    if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(_in_range(f, label, float(value)))
    wanted = {"int": "an integer", "float": "a number", "bool": "True or False"}.get(kind, "a string")
    raise ConfigError(f"{label}: expected {wanted}, got {type(value).__name__}")


def _from_env(f: Any, environ: Mapping[str, str]) -> Any:
    """The field's value from `environ` (a secret also from the file NAME_FILE names), or MISSING."""
    m = f.metadata
    raw = environ.get(m["env"])
    if (raw is None or raw.strip() == "") and m["secret"] and environ.get(m["env"] + "_FILE"):
        path = environ[m["env"] + "_FILE"]
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{m['env']}_FILE={path!r}: cannot read ({exc.strerror})") from None
    if raw is None or raw.strip() == "":
        return MISSING
    return _parse(f, raw)


class SettingGroup:
    """The settings one process alone reads, beside that process (the stream worker's in
    streams/shell/settings.py, the sink's in sinks/settings.py, ...): a frozen dataclass of
    `setting()` fields, read by the parser `Settings` uses, so a variable, its error and an
    override given in Python follow one rule wherever the class lives. docs/SETTINGS.md lists
    every class (`areal_metrics.all_settings`)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """These settings from the environment (the process's own when `environ` is None); ConfigError
        names a variable that cannot be used."""
        environ = os.environ if environ is None else environ
        return cls(**{f.name: v for f in settings_fields(cls) if (v := _from_env(f, environ)) is not MISSING})

    def replace(self, **overrides: Any) -> Self:
        """These settings with `overrides` (field name -> value), each checked by the rule its variable
        follows (`init(exit_timeout_s=-1)` is refused as `AREAL_EXIT_TIMEOUT_S=-1` is)."""
        by_name = {f.name: f for f in settings_fields(type(self))}
        unknown = sorted(set(overrides) - set(by_name))
        if unknown:
            raise TypeError(f"unknown setting(s) {', '.join(unknown)}")
        return dataclasses.replace(self, **{k: _override(by_name[k], v)  # type: ignore[type-var]
                                            for k, v in overrides.items()})

    @classmethod
    def chosen(cls, environ: Mapping[str, str]) -> set[str]:
        """The fields whose variable `environ` sets (non-empty)."""
        return {f.name for f in settings_fields(cls) if environ.get(f.metadata["env"], "").strip()}


@dataclass(frozen=True)
class Settings(SettingGroup):
    """Shared: the settings several processes read (`init(...)` takes each by its field name)"""

    # -- where things are
    kafka_bootstrap: Annotated[str, HOSTPORTS] = setting(
        "AREAL_KAFKA_BOOTSTRAP", "", "Kafka bootstrap servers: host:port, "
        "comma-separated (no scheme)", readers="client worker sink stack trainer benchmarks",
        default_doc=f"the broker `areal-metrics up` recorded, else `{DEFAULT_BOOTSTRAP}`")
    kafka_compression: str = setting("AREAL_KAFKA_COMPRESSION", "none", "compression of the batches the client "
                                     "publishes (the broker stores them so). Every reader must decode it: gzip "
                                     "needs no package anywhere; snappy, lz4 and zstd need cramjam in the stream "
                                     "worker (aiokafka) and python-snappy, lz4 or zstandard in the sink and CLI "
                                     "(kafka-python) and in a kafka-python publisher (confluent-kafka has them)",
                                     choices=KAFKA_COMPRESSIONS, readers="client trainer benchmarks")
    clickhouse_url: str = setting("AREAL_CLICKHOUSE_URL", "", "the store: `chdb:///path` (embedded) or "
                                  "`http://user:pass@host:8123/db` (a server)", readers="sink stack",
                                  default_doc="the store `up` recorded, else `chdb://$AREAL_HOME/clickhouse`")
    topic_prefix: str = setting("AREAL_TOPIC_PREFIX", DEFAULT_PREFIX, "prefix of every topic name",
                                readers="client worker sink stack trainer benchmarks",
                                default_doc=f"the prefix `up` recorded, else `{DEFAULT_PREFIX}`")
    home: Annotated[str, PATH] = setting(
        "AREAL_HOME", "", "the local stack's state: broker data, store, pids, journals, "
        "attempt records (a relative path is made absolute)",
        readers="client worker sink stack trainer", default_doc="`~/.areal`")
    # -- Kafka security (all optional; PLAINTEXT when unset)
    kafka_security_protocol: str = setting("AREAL_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT",
                                           "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL, in any case",
                                           choices=SECURITY_PROTOCOLS)
    kafka_sasl_mechanism: str | None = setting("AREAL_KAFKA_SASL_MECHANISM", None, "the SASL mechanism, in any case "
                                               "(docs/SECURITY.md)",
                                               choices=SASL_MECHANISMS)
    kafka_sasl_username: str | None = setting("AREAL_KAFKA_SASL_USERNAME", None, "SASL user")
    kafka_sasl_password: str | None = setting("AREAL_KAFKA_SASL_PASSWORD", None, "SASL password (or a file named "
                                              "by AREAL_KAFKA_SASL_PASSWORD_FILE); never printed", secret=True)
    kafka_ssl_cafile: Annotated[str, PATH] | None = setting("AREAL_KAFKA_SSL_CAFILE", None, "CA bundle for TLS")
    kafka_ssl_certfile: Annotated[str, PATH] | None = setting("AREAL_KAFKA_SSL_CERTFILE", None, "client certificate")
    kafka_ssl_keyfile: Annotated[str, PATH] | None = setting("AREAL_KAFKA_SSL_KEYFILE", None, "client key")
    # -- topic durability for every topic the project creates (Faust's too); 3 and 2 on a cluster
    kafka_replication_factor: int = setting("AREAL_KAFKA_REPLICATION_FACTOR", 1, "replication factor of new topics",
                                            readers="worker sink stack")
    kafka_min_insync_replicas: int = setting("AREAL_KAFKA_MIN_INSYNC_REPLICAS", 1, "min.insync.replicas of new "
                                             "topics", readers="worker sink stack")
    # Retention in ms (-1 = keep forever). Raw topics are the source of truth that `replay`
    # rebuilds from, so they are kept by default; derived topics likewise unless configured.
    raw_retention_ms: int = setting("AREAL_RAW_RETENTION_MS", -1, "retention of steps, evals, runs (ms; -1 keeps "
                                    "them: replay rebuilds from them)", readers="worker sink stack")
    derived_retention_ms: int = setting("AREAL_DERIVED_RETENTION_MS", -1, "retention of the derived topics (ms; "
                                        "-1 keeps them)", readers="worker sink stack")
    # -- ClickHouse on a cluster: DDL ON CLUSTER; Replicated* engines when replicated
    clickhouse_cluster: str | None = setting("AREAL_CLICKHOUSE_CLUSTER", None, "run DDL ON CLUSTER this cluster "
                                             "(a server only)", readers="sink stack")
    clickhouse_replicated: bool = setting("AREAL_CLICKHOUSE_REPLICATED", False, "Replicated* table engines "
                                          "(Keeper)", readers="sink stack",
                                          default_doc="on when AREAL_CLICKHOUSE_CLUSTER is set")
    clickhouse_steps_ttl_days: int | None = setting("AREAL_CLICKHOUSE_STEPS_TTL_DAYS", None, "delete raw steps "
                                                    "older than this many days (0 or unset: keep)",
                                                    ge=0, readers="sink stack")
    clickhouse_merge_selector_base: int | None = setting(
        "AREAL_CLICKHOUSE_MERGE_SELECTOR_BASE", None, "ClickHouse's merge_selector_base for `steps` and the step "
        "and rank aggregates: larger, wider merges that rewrite each row fewer times and leave more parts for "
        "reads (unset: the server's own, 5; 20 cut the sink's CPU per event by 12 % and cost the panels "
        "9.5-14 %, docs/PERFORMANCE.md 'Background merges')", ge=2, le=1000, readers="sink stack")
    # -- what every reader refuses before decoding a message (producers/contract/limits.py; CONTRACT.md,
    # 'No input stops the pipeline'): a refused message is dead-lettered with its reason
    max_message_bytes: int = setting("AREAL_MAX_MESSAGE_BYTES", 1 << 20, "the largest message a reader "
                                     "decodes, bytes", ge=1024, le=1 << 30,
                                     readers="client worker sink stack")
    max_json_depth: int = setting("AREAL_MAX_JSON_DEPTH", 64, "the deepest nesting of objects and arrays a "
                                  "reader decodes (the message itself is level 1)", ge=8, le=512,
                                  readers="client worker sink stack")
    max_object_keys: int = setting("AREAL_MAX_OBJECT_KEYS", 10_000, "the most names one JSON object of a "
                                   "message may have", ge=64, le=10_000_000,
                                   readers="client worker sink stack")
    max_array_items: int = setting("AREAL_MAX_ARRAY_ITEMS", 100_000, "the most entries one JSON array of a "
                                   "message may have (verdicts, sample_ids, ...)", ge=64,
                                   le=100_000_000, readers="client worker sink stack")
    # -- the client (areal_metrics.init)
    kafka_client: str = setting("AREAL_KAFKA_CLIENT", "auto", "the Kafka client that delivers the trainer's "
                                "events: auto (confluent-kafka when installed), confluent-kafka or kafka-python",
                                choices=("auto", "confluent-kafka", "kafka-python"), readers="client stack")
    run_id: str | None = setting("AREAL_RUN_ID", None, "the run id every rank of a launch shares (before "
                                 "torchrun's and SLURM's ids)", readers="client trainer")
    # -- a crash never loops (producers/runtime/poison.py, areal_metrics/stack/supervisor.py)
    poison_crashes: int = setting("AREAL_POISON_CRASHES", 2, "crashes of a service while one message was being "
                                  "processed after which that message is dead-lettered and skipped, with a "
                                  "`poison_message` alert", ge=1, le=100, readers="worker sink")
    log_repeat_s: float = setting("AREAL_LOG_REPEAT_S", 60.0, "the worker and the sink write a log line that "
                                  "repeats (the same logger, level and text; a library's without its fractional numbers, "
                                  "such as a retry's backoff) at most once per this many seconds, "
                                  "the next one saying how many were held back (the worker's Kafka client wrote "
                                  "~800 KB a minute while the broker was away); 0: every line", ge=0, le=86_400,
                                  readers="worker sink")
    test_crash_on: str | None = setting("AREAL_TEST_CRASH_ON", None, "tests only: `<worker|sink>:<text>`: that "
                                        "service dies (exit 70) while it processes a message holding the text (not on the dead-letter topic)",
                                        readers="worker sink")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, reader: str | None = None) -> Settings:
        """The settings from the environment; ConfigError names a variable that cannot be used.
        With `reader` (e.g. "client"), only the variables that reader uses are read: a trainer
        is never stopped by a sink's setting."""
        environ = os.environ if environ is None else environ
        chosen = [f for f in settings_fields(cls) if reader is None or reader in f.metadata["readers"]]
        values = {f.name: v for f in chosen if (v := _from_env(f, environ)) is not MISSING}
        home = _home(values.get("home"))
        values["home"] = str(home)
        stack = recorded_stack(home)
        values.setdefault("kafka_bootstrap", _text(stack, "kafka_bootstrap") or DEFAULT_BOOTSTRAP)
        values.setdefault("topic_prefix", _text(stack, "topic_prefix") or DEFAULT_PREFIX)
        values.setdefault("clickhouse_url", _text(stack, "clickhouse_url") or f"chdb://{home / 'clickhouse'}")
        values.setdefault("clickhouse_replicated", bool(values.get("clickhouse_cluster")))
        values["clickhouse_steps_ttl_days"] = values.get("clickhouse_steps_ttl_days") or None
        return cls(**values)

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)

    @property
    def state_dir(self) -> Path:
        return Path(self.home).absolute()

    def kafka_python_config(self) -> dict[str, object]:
        """Connection settings in kafka-python's (and aiokafka's) spelling."""
        cfg: dict[str, object] = {
            "bootstrap_servers": self.kafka_bootstrap.split(","),
            "security_protocol": self.kafka_security_protocol.upper(),  # kafka-python compares in upper case
        }
        if self.kafka_sasl_mechanism:
            quiet_client_debug_logs()
            cfg["sasl_mechanism"] = self.kafka_sasl_mechanism.upper()  # Kafka's spelling
            cfg["sasl_plain_username"] = self.kafka_sasl_username
            cfg["sasl_plain_password"] = self.kafka_sasl_password
        for name in ("cafile", "certfile", "keyfile"):
            value = getattr(self, f"kafka_ssl_{name}")
            if value:
                cfg[f"ssl_{name}"] = value
        return cfg

    def public(self) -> dict[str, object]:
        """Settings safe to print: secrets masked, passwords stripped from URLs."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if "password" in f.name and value:
                value = "***"
            out[f.name] = value
        out["clickhouse_url"] = mask_url(self.clickhouse_url)
        return out


settings_fields(Settings)  # every declaration's annotation is a setting's type, or the import fails


# kafka-python and aiokafka log the bytes of a SASL handshake, password included, at
# DEBUG level: with credentials in play, their loggers never go below INFO.
_CLIENT_LOGGERS = ("kafka", "aiokafka")


def quiet_client_debug_logs() -> None:
    for name in _CLIENT_LOGGERS:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.INFO:
            logger.setLevel(logging.INFO)


def mask_url(url: str) -> str:
    """http://user:secret@host -> http://user:***@host"""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in creds else url


def read_setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One setting by its field name, without reading the others (a default where unset)."""
    f = _FIELDS[name]
    value = _from_env(f, os.environ if environ is None else environ)
    return f.default if value is MISSING else value


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Did the environment choose this setting (a non-empty variable)?"""
    return bool((os.environ if environ is None else environ).get(_FIELDS[name].metadata["env"], "").strip())


def _home(raw: str | None) -> Path:
    return Path(raw).expanduser().absolute() if raw else Path.home() / DEFAULT_STATE_DIR


def state_dir() -> Path:
    """Where the local stack keeps its state (broker data, store, pids, journals): AREAL_HOME, else ~/.areal."""
    return _home(read_setting("home"))


def recorded_stack(home: Path | None = None) -> dict[str, object]:
    """What `areal-metrics up` recorded in the state folder ({} when nothing readable is there)."""
    try:
        found = json.loads(((home or state_dir()) / STACK_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _text(stack: Mapping[str, object], name: str) -> str | None:
    value = stack.get(name)
    return value if isinstance(value, str) and value else None


def bootstrap_origin(home: Path | None = None) -> str:
    """Where the client's bootstrap comes from, in words (for the one warning when it cannot deliver); `home`:
    the state folder the client read (`init(home=...)`), else AREAL_HOME's."""
    if is_set("kafka_bootstrap"):
        return "AREAL_KAFKA_BOOTSTRAP"
    home = home or state_dir()
    if _text(recorded_stack(home), "kafka_bootstrap"):
        return f"the stack recorded in {home / STACK_FILE}"
    return f"the default (no AREAL_KAFKA_BOOTSTRAP, no stack recorded in {home / STACK_FILE})"


_FIELDS = {f.name: f for f in fields(Settings)}
VARIABLES = {f.metadata["env"]: f.name for f in fields(Settings)}  # variable -> field name


def markdown_table(groups: tuple[type, ...] = (Settings,)) -> str:
    """docs/SETTINGS.md's tables, from the declarations: one per settings class, under the first
    line of its docstring (`areal_metrics.all_settings` passes every class)."""
    out = []
    for group in groups:
        rows = [f"### {(group.__doc__ or group.__name__).strip().splitlines()[0]}", "",
                "| variable | default | read by | what |", "|---|---|---|---|"]
        for f in settings_fields(group):
            m = f.metadata
            what = m["doc"]
            if _kind(f) in ("int", "float") and (m["ge"] is not None or m["le"] is not None):
                bounds = [f">= {m['ge']:g}" if m["ge"] is not None else "",
                          f"<= {m['le']:g}" if m["le"] is not None else ""]
                what += f" ({' and '.join(filter(None, bounds))})"
            if _kind(f) == "choice":
                what += f" ({' / '.join(m['choices'])})"
            rows.append(f"| `{m['env']}` | {m['default_doc']} | {', '.join(m['readers'])} | {what} |")
        out.append("\n".join(rows) + "\n")
    return "\n".join(out)


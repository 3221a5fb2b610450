"""The Python client: `init()` -> `Run` with `log`, `log_eval`, `commands`, `finish` (CONTRACT.md, 'Python client').

    import areal_metrics as am
    run = am.init(config=cfg, tags=["grpo"])
    run.log({"reward": r, "kl": kl_tensor, "critic/score/mean": np_value}, step=step)
    run.log_eval("math500", step, verdicts=[1, 0, 1])
    for command in run.commands(): ...
    run.finish()

W&B's habits work as they read there: `am.log(...)`, `am.finish()`, `am.alert(...)` and
`am.summary` act on the current run (the last one `init` started in this process);
`run.summary[...] = value` is sent with the run's end; `init(notes=...)`; `AREAL_MODE=disabled`
(or `init(mode="disabled")`) gives a run whose calls do nothing (no thread, no journal, nothing
sent); `AREAL_SYSTEM_METRICS_S` samples CPU, memory and GPUs into the steps (docs/CLIENT.md).

On the caller's thread `log` only copies the values (reading tensors, which
the training loop may change in place afterwards) and enqueues them; numpy
scalars, names, rules and JSON are the sender thread's work (`_Step.encode`).
A step logged twice (same step number) is sent again with the union of its
values, later ones winning: in FINAL reads the later event replaces the earlier
one (steps are keyed by run, rank, step).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import operator
import os
import socket
import sys
import threading
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from areal_metrics.producers.client import attempts, coerce, exit_hooks, run_info, system_metrics
from areal_metrics.producers.client.control_feed import ControlFeed
from areal_metrics.producers.contract.deadletter import rejected
from areal_metrics.producers.contract.errors import UserError
from areal_metrics.producers.contract.events import (
    EVAL_STATUSES,
    SCHEMA_VERSION,
    TERMINAL_STATUSES,
    AlertEvent,
    CommandAckEvent,
    CommandEvent,
    EvalEvent,
    RunEvent,
    ValidationError,
    dumps_compact,
)
from areal_metrics.producers.contract.field_rules import INT64_MAX as MAX_STEP, NUMBER_MAX, fit_message
from areal_metrics.producers.contract.ids import RUN_ID_RULE, is_valid_run_id
from areal_metrics.producers.contract.limits import StructureLimits, default_limits, install_limits
from areal_metrics.producers.client.launcher_env import Identity, identity_from_env, job_run_id
from areal_metrics.producers.delivery.publisher import Publisher, record_room
from areal_metrics.producers.contract.settings import Settings, bootstrap_origin, read_setting
from areal_metrics.producers.client.settings import ClientSettings
from areal_metrics.producers.contract.topics import Topics

_log = logging.getLogger("areal_metrics.client")

SETTINGS_FIELDS = frozenset(f.name for f in dataclasses.fields(Settings))
CLIENT_FIELDS = frozenset(f.name for f in dataclasses.fields(ClientSettings))


@dataclass(frozen=True, slots=True)
class Options:
    """`init(**settings)` keywords that are the client's own options (the rest are `Settings` and
    `ClientSettings` fields)."""

    rank: int | None = None
    world_size: int | None = None  # ranks that log each step (1 when only rank 0 logs)
    local_rank: int | None = None
    node: str | None = None
    journal_dir: str | Path | None = None
    framework: str | None = None
    attempt: int | None = None  # force the attempt (otherwise 0, or the next one on resume)
    resume_timeout_s: float = 10.0
    fsync_journal: bool = False
    git: bool = True  # look up the git commit of the training code


@dataclass(frozen=True, slots=True)
class RunStats:
    steps: int  # log() calls taken
    evals: int
    skipped: int  # values not sent: not numbers (None excluded), or metrics names past AREAL_MAX_METRICS
    queued: int
    sent: int
    journaled: int
    resent: int
    failed: int
    pending: int
    lost: int = 0  # neither delivered nor journaled: the journal could not be written (a full disk), or logged
    # from another thread after finish()


def _split_settings(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Options]:
    """`init`'s keywords as (shared `Settings` overrides, `ClientSettings` overrides, `Options`)."""
    option_names = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(kwargs) - SETTINGS_FIELDS - CLIENT_FIELDS - option_names)
    if unknown:
        hint = " (areal-metrics has no projects: group= and tags= group runs)" if "project" in unknown else ""
        raise TypeError(f"init() got unknown setting(s) {', '.join(unknown)}{hint}")
    options = Options(**{k: v for k, v in kwargs.items() if k in option_names})
    return ({k: v for k, v in kwargs.items() if k in SETTINGS_FIELDS},
            {k: v for k, v in kwargs.items() if k in CLIENT_FIELDS}, options)


def _identity(options: Options) -> Identity:
    found = identity_from_env(os.environ, socket.gethostname())
    changes = {k: getattr(options, k) for k in ("rank", "world_size", "local_rank") if getattr(options, k) is not None}
    for name, value in changes.items():
        if type(value) is not int or value < 0 or (name == "world_size" and value < 1):
            raise TypeError(f"init(): {name} must be a non-negative integer (got {value!r})")
    identity = dataclasses.replace(found, **changes)
    if identity.rank >= identity.world_size:  # readers refuse rank >= world_size: the world is made to hold it
        _log.warning("init(): rank %d is not below world_size %d; world_size %d is reported (pass world_size=)",
                    identity.rank, identity.world_size, identity.rank + 1)
        identity = dataclasses.replace(identity, world_size=identity.rank + 1)
    return identity


def _temp_home() -> Path:
    """This user's folder in the system's temp folder (where the journal goes when AREAL_HOME is not writable)."""
    return Path(tempfile.gettempdir()) / f"areal-{os.getuid()}"


def _finish_previous(run_id: str, rank: int, generated: bool) -> None:
    """A second `init` of the same run and rank in one process (a notebook cell run again, a loop with
    AREAL_RUN_ID set) finishes the first: each open run holds a sender thread and a journal slot. So does
    an `init` without a run id after one without (the cell run again: each gets a new generated id); runs
    given ids of their own stay open side by side."""
    previous = _current
    if not isinstance(previous, Run) or previous._done or previous.rank != rank:
        return
    if previous.run_id == run_id or (generated and previous._generated_id):
        _log.warning("init(): run %s (rank %d) is still open in this process; finishing it first", previous.run_id,
                     rank)
        previous.finish()


def init(run_id: str | None = None, config: Any = None, tags: Iterable[str] = (), group: str | None = None,
         resume: bool = False, name: str | None = None, notes: str | None = None, **settings: Any) -> Run:
    """Start (or, with `resume=True`, continue) a run from this process; see the module doc.

    `name`: a free-form display name (any Unicode, <= 256 chars), kept in `runs.name` beside the run id.
    `notes`: free text about the run (<= 4,096 chars), on its `run` events.
    `**settings`: any `Settings` or `ClientSettings` field (checked by the rule its AREAL_* variable
    follows) and the `Options`.
    With `mode="disabled"` (or AREAL_MODE=disabled) the run's calls do nothing.
    """
    global _current
    if run_id is not None and not isinstance(run_id, str):
        raise TypeError(f"run_id: expected a string, got {type(run_id).__name__}")
    if group is not None and not isinstance(group, str):
        raise TypeError(f"group: expected a string, got {type(group).__name__}")
    if not isinstance(resume, bool):
        raise TypeError(f"resume: expected True or False, got {type(resume).__name__}")
    clean_tags = run_info.clean_tags(tags)
    display_name = run_info.clean_name(name)
    clean_notes = run_info.clean_notes(notes)
    overrides, client_overrides, options = _split_settings(settings)
    # init(home=...) is AREAL_HOME: read before the rest, since the stack recorded there gives the defaults
    chosen_home = overrides.pop("home", None)
    environ = None if chosen_home is None else {**os.environ, "AREAL_HOME": str(chosen_home)}
    base = Settings.from_env(environ, reader="client")
    settings_obj = base.replace(**overrides) if overrides else base
    client = ClientSettings.from_env().replace(**client_overrides)
    # the structure limits (AREAL_MAX_*) of what this process reads and logs: the client's entry installs them
    install_limits(StructureLimits.from_settings(settings_obj))
    identity = _identity(options)
    generated, from_job = False, None
    if run_id is None:
        run_id = from_job = job_run_id(os.environ)
    if run_id is None:
        run_id, generated = run_info.new_run_id(), True
    if not is_valid_run_id(run_id):
        raise ValueError(f"run_id {run_id[:60]!r}: must be {RUN_ID_RULE}; a free-form name goes in "
                         f"init(name=...), e.g. init(run_id={run_info.run_id_for(run_id)!r}, name={run_id[:60]!r})")
    if client.mode == "disabled":
        _current = DisabledRun(run_id, identity, config=config, tags=clean_tags, group=group, name=display_name,
                               notes=clean_notes)
        return _current  # type: ignore[return-value]
    _finish_previous(run_id, identity.rank, generated)
    home = settings_obj.state_dir  # AREAL_HOME (or home=), read at the client's entry: journals and attempt records
    origin = "init(kafka_bootstrap=...)" if "kafka_bootstrap" in overrides else bootstrap_origin(home)
    from_launcher = from_job is not None and not (read_setting("run_id") or "").strip()  # not AREAL_RUN_ID's
    if (from_launcher and not resume and options.attempt is None
            and attempts.state_path(home, run_id, identity.rank).exists()):
        # the launcher's id is the job's: a second training in one allocation (a sweep in one sbatch script,
        # a requeued job) gets the same id, and its steps would replace the first's without a word
        _log.warning("init(): run id %s comes from the launcher's job and was started before on this host (%s): "
                     "this training's steps replace that run's; pass run_id= (or AREAL_RUN_ID) to keep both, or "
                     "resume=True to continue it", run_id, attempts.state_path(home, run_id, identity.rank))
    attempt = _attempt(settings_obj, home, run_id, identity.rank, resume, options)
    run = Run(run_id, identity, settings_obj, client, options, config=config, tags=clean_tags, group=group,
              attempt=attempt,
              name=display_name, bootstrap_from=origin, notes=clean_notes, home=home)
    run._generated_id = generated
    _current = run
    if generated and identity.rank == 0:
        print(f"areal-metrics: run {run_id}", file=sys.stderr)
    if generated and identity.world_size > 1:
        _log.warning("run id %s was generated by rank %d alone: pass run_id= (or AREAL_RUN_ID) so that the "
                    "%d ranks report one run", run_id, identity.rank, identity.world_size)
    return run


def _attempt(settings: Settings, home: Path, run_id: str, rank: int, resume: bool, options: Options) -> int:
    path = attempts.state_path(home, run_id, rank)
    if options.attempt is not None:
        attempt = options.attempt
    elif not resume:
        attempt = 0
    else:
        own, anyone = attempts.logged_attempts(settings, run_id, rank, options.resume_timeout_s)
        attempt = attempts.next_attempt(attempts.read_local(path), own, anyone)
    attempts.write_local(path, attempt)
    return attempt


class Run:
    """One process's part of a run. Use `init()` to get one."""

    def __init__(self, run_id: str, identity: Identity, settings: Settings, client: ClientSettings, options: Options, *,
                 config: Any, tags: tuple[str, ...], group: str | None, attempt: int, name: str | None = None,
                 bootstrap_from: str | None = None, notes: str | None = None, home: Path) -> None:
        self.run_id = run_id
        self.name = name
        self.notes = notes
        self.summary: dict[str, Any] = {}  # sent with this rank's end (its terminal `run` event)
        self.rank = identity.rank
        self.world_size = identity.world_size
        self.local_rank = identity.local_rank
        self.node = (options.node or identity.node)[:128]
        self.host = identity.host[:256]
        self.attempt = attempt
        self.config, config_notes = coerce.config_with_notes(config)
        self.tags = tags
        self.group = group[:256] if group else None
        self.framework = (options.framework or run_info.detect_framework())[:64]
        self.git_commit = run_info.git_commit() if options.git else None
        self.topics: Topics = settings.topics
        self._settings = settings
        self._key = run_id.encode()
        self._exit_timeout_s = client.exit_timeout_s
        self._exit_join_s: float | None = None  # the publisher's own wait for a stuck sender
        journal = Path(options.journal_dir) if options.journal_dir else home / "journal" / run_id / f"rank-{self.rank}"

        def publisher(journal_dir: Path) -> Publisher:
            return Publisher.from_settings(settings, journal_dir=journal_dir, close_at_exit=False,
                                           exit_timeout_s=self._exit_timeout_s, fsync_journal=options.fsync_journal,
                                           bootstrap_origin=bootstrap_from or bootstrap_origin(),
                                           uninterrupted=exit_hooks.finishing)
        try:
            self._publisher = publisher(journal)
        except OSError as exc:  # a read-only home (a container's): the run goes on, its journal in the temp folder
            fallback = _temp_home() / "journal" / run_id / f"rank-{self.rank}"
            _log.warning("init(): cannot make the journal %s (%s); using %s (set AREAL_HOME or journal_dir= to a "
                         "writable folder; areal-metrics sync reads AREAL_HOME)", journal, exc.strerror or exc, fallback)
            self._publisher = publisher(fallback)
        self._started = time.time()
        self._epoch = 0.0  # the sender thread's: the last epoch a step carried
        self._last_step = -1
        self._open_step: int | None = None
        self._held = False  # the last log() said commit=False: the next one without a step adds to its step
        self._generated_id = False  # init() made the run id (no run_id=, no launcher's job id)
        self._open_values: dict[Any, int | float] = {}
        self._steps = self._evals = self._skipped = 0
        self._warned: set[Any] = set()
        self._max_metrics = client.max_metrics
        self._alerted: dict[str, float] = {}  # alert title -> when it was last sent
        for kind in config_notes:  # what the config could not be sent as: once per kind
            self._warn_once(("config", kind), f"init(): config: {coerce.CONFIG_NOTES[kind]}")
        self._done = False
        self._forked = False
        self._exit_status: tuple[str, int] | None = None
        self._feed: ControlFeed | None = None
        self._feed_lock = threading.Lock()
        self._commands_since = self._started
        self._publish_run("running")
        exit_hooks.register(self)
        self._sampler = system_metrics.started(client.system_metrics_s)

    # ------------------------------------------------------------ logging

    def log(self, metrics: Mapping[Any, Any], step: int | None = None, commit: bool | None = None) -> None:
        """Log one training step's values (see the module doc; never raises for a value). `commit=False`
        (W&B's): the next `log` without a step adds to this step instead of starting the next one."""
        if type(metrics) is not dict and not isinstance(metrics, Mapping):
            raise TypeError(f"log(): metrics must be a mapping of name -> value, got {type(metrics).__name__}")
        if step is None:
            step = self._last_step if self._held and self._last_step >= 0 else self._last_step + 1
        elif type(step) is not int:
            if isinstance(step, bool):
                raise TypeError("log(): step must be an integer, got bool")
            step = operator.index(step)  # numpy ints; TypeError for floats and strings
        if not 0 <= step <= MAX_STEP:
            raise ValueError(f"log(): step must be >= 0 and < 2**63 (got {step})")
        if self._done or self._forked:
            self._warn_once("after-finish", "log() after finish() (or in a forked child): ignored")
            return
        values = coerce.snapshot(metrics)
        if step == self._open_step:
            values = {**self._open_values, **values}
        self._open_step, self._open_values, self._last_step = step, values, step
        self._held = commit is False
        self._steps += 1
        self._publisher.publish(_Step(self, step, values, time.time()))

    def log_eval(self, dataset: str, step: int | None = None, *, stage: str = "full", verdicts: Any = None,
                 accuracy: Any = None, samples: Any = None, eval_id: str | None = None, replicas: int | None = None,
                 status: str = "ok", error: str | None = None, response_length: Any = None, reward: Any = None,
                 latency_ms: Any = None, dataset_fingerprint: str | None = None, sample_ids: Any = None,
                 shard_nodes: int | None = None, n_samples: int | None = None, **metrics: Any) -> None:
        """Log this node's result of one evaluation round on one dataset (the cross-node vote uses `verdicts`;
        a sharded round: `sample_ids`, each verdict's sample in the shared order, and `shard_nodes`;
        `n_samples`: the samples behind `accuracy` when no verdicts are given, for its interval)."""
        if not isinstance(dataset, str) or not dataset:
            raise TypeError("log_eval(): dataset must be a non-empty string")
        if stage not in ("quick", "full"):
            raise ValueError(f"log_eval(): stage must be 'quick' or 'full' (got {stage!r})")
        if status not in EVAL_STATUSES:
            raise ValueError(f"log_eval(): status must be one of {', '.join(EVAL_STATUSES)} (got {status!r})")
        step = max(self._last_step, 0) if step is None else operator.index(step)
        if not 0 <= step <= MAX_STEP:
            raise ValueError(f"log_eval(): step must be >= 0 and < 2**63 (got {step})")
        if self._done or self._forked:
            self._warn_once("after-finish", "log_eval() after finish() (or in a forked child): ignored")
            return
        fields = _eval_fields(verdicts, accuracy, samples, status, error, response_length, reward, latency_ms, metrics)
        if fields.pop("_cut", 0):
            self._warn_once("samples-cut", "log_eval(): more samples than an event holds; the first ones are kept")
        try:
            if sample_ids is not None and "verdicts" in fields:
                listed = sample_ids.tolist() if hasattr(sample_ids, "tolist") else sample_ids
                fields["sample_ids"] = tuple(operator.index(s) for s in listed)
            if shard_nodes is not None:
                fields["shard_nodes"] = operator.index(shard_nodes)
            if n_samples is not None and "verdicts" not in fields:
                fields["n_samples"] = operator.index(n_samples)
            replicas = operator.index(replicas) if replicas is not None else 0
            event = EvalEvent(
                run_id=self.run_id, node=self.node, rank=self.rank, eval_id=(eval_id or f"{self.run_id}:{step}:{dataset}:{stage}")[:256],
                step=step, dataset=dataset[:128], stage=stage, replicas=replicas or self.world_size, attempt=self.attempt,
                dataset_fingerprint=dataset_fingerprint[:128] if dataset_fingerprint else None, **fields)
            event = self._fit_eval(event)
        except (ValidationError, TypeError) as exc:  # an argument we could not coerce: say so, never stop training
            _log.warning("log_eval(%s, step %d) not sent: %s", dataset, step, exc)
            return
        self._evals += 1
        self._publisher.publish(event)

    def _fit_eval(self, event: EvalEvent) -> EvalEvent:
        """The eval as readers take it: more verdicts than an array may hold (AREAL_MAX_ARRAY_ITEMS) go as the
        accuracy and its sample count (no cross-node vote); over a record's bytes, samples are halved, then
        the verdicts go the same way. (Sent whole, readers and the producer would refuse it.)"""
        limits = default_limits()
        room = record_room(self._key)
        without_votes = {"verdicts": None, "sample_ids": None, "shard_nodes": None}
        if event.verdicts is not None and len(event.verdicts) > limits.max_items:
            self._warn_once("verdicts-cut", f"log_eval(): more than {limits.max_items} verdicts (AREAL_MAX_ARRAY_ITEMS) "
                                            "are sent as the accuracy and n_samples, without the cross-node vote")
            event = msgspec.structs.replace(event, **without_votes)
        size = len(event.to_json())
        while event.samples and size > room:
            self._warn_once("samples-bytes", f"log_eval(): samples over a message's {room} bytes; the first ones "
                                             "that fit are kept")
            event = msgspec.structs.replace(event, samples=event.samples[:len(event.samples) // 2])
            size = len(event.to_json())
        if size > room and event.verdicts is not None:
            self._warn_once("verdicts-bytes", f"log_eval(): verdicts over a message's {room} bytes are sent as the "
                                              "accuracy and n_samples, without the cross-node vote")
            event = msgspec.structs.replace(event, **without_votes)
        return event

    def alert(self, title: str, text: str = "", level: Any = "warning", wait_duration: Any = 60.0) -> None:
        """Raise an alert of your own (W&B's `run.alert`): an `alert` event of kind `user` on the alerts topic,
        which `alerts --follow --webhook`, `watch` and Grafana show as they show the worker's.

        `level`: info, warning (W&B's WARN) or critical (W&B's ERROR), in any case, or W&B's AlertLevel;
        an alert whose title was sent less than `wait_duration` seconds (a number or a timedelta; None: 60)
        ago is not sent again."""
        if not isinstance(title, str) or not title.strip():
            raise TypeError("alert(): title must be a non-empty string")
        severity = alert_severity(level)
        if self._done or self._forked:
            self._warn_once("after-finish", "alert() after finish() (or in a forked child): ignored")
            return
        now = time.monotonic()
        last = self._alerted.get(title)
        if last is not None and now - last < _seconds(wait_duration, 60.0):
            return
        self._alerted[title] = now
        message = f"{title}: {text}" if text else title
        try:
            event = AlertEvent(run_id=self.run_id, node=self.node, rank=self.rank, kind="user", severity=severity,
                               message=fit_message(coerce.text(message)), step=self._last_step if self._last_step >= 0 else None)
        except ValidationError as exc:  # pragma: no cover - the fields are cleaned above
            _log.warning("alert() not sent: %s", exc)
            return
        self._publisher.publish(event)

    def commands(self, *, every_node: bool = False, since: float | None = None) -> list[CommandEvent]:
        """Control commands for this run (and this node) that arrived since the last call; never blocks.
        `every_node`: those with another node's `target_node` too (what the lead rank of a distributed
        loop reads for every rank: `CommandApplier`). `since` (a time, seconds): read the control topic
        again from there, when it is before what the feed reads from (the process's start): a resumed
        attempt's applier, for the commands its checkpoint had not seen (`commands_since`)."""
        with self._feed_lock:
            if since is not None and since < self._commands_since:
                self._commands_since = float(since)
                if self._feed is not None:  # its successor reads them again: the applier skips those it handled
                    self._feed.close()
                    self._feed = None
            if self._feed is None and not self._done:
                self._feed = ControlFeed(self._settings.kafka_python_config(), self.topics.control, self.run_id,
                                         self.node, since=self._commands_since)
        return self._feed.drain(every_node) if self._feed is not None else []

    @property
    def commands_since(self) -> float:
        """The time (seconds) from which `commands()` reads the control topic: this process's start, or the
        earlier time a resumed attempt asked for."""
        return self._commands_since

    @property
    def started(self) -> float:
        """When `init` started this run in this process (seconds since the epoch)."""
        return self._started

    def acknowledge(self, command: CommandEvent, status: str, *, step: int | None = None,
                    lr_factor: float | None = None, detail: str | None = None) -> None:
        """Say what this node did with `command`: `applied` (from `step`, its cumulative lr factor now) or
        `ignored` (`detail`: why). A `command_ack` on the acks topic; never raises into the loop.
        `CommandApplier` calls it for every command it handles."""
        if self._done or self._forked:
            return
        try:
            step = operator.index(step) if step is not None else None  # numpy ints from a framework's counter
            lr_factor = float(lr_factor) if lr_factor is not None else None
            event = CommandAckEvent(run_id=self.run_id, node=self.node, rank=self.rank, command_id=command.event_id,
                                    command=command.command, status=status, step=step, lr_factor=lr_factor,
                                    detail=fit_message(detail or ""), attempt=self.attempt)
        except (ValidationError, TypeError) as exc:
            _log.warning("acknowledgement of %s not sent: %s", command.command, exc)
            return
        self._publisher.publish(event)

    # ------------------------------------------------------------ the end

    def finish(self, status: str | None = None, exit_code: int | None = None) -> None:
        """Send this rank's terminal status and deliver (or journal) what is queued; idempotent."""
        if status is not None and status not in TERMINAL_STATUSES:
            raise ValueError(f"finish(): status must be one of {', '.join(TERMINAL_STATUSES)} (got {status!r})")
        if self._done or self._forked:
            return
        with exit_hooks.finishing():  # a SIGTERM meanwhile waits for the terminal status and the delivery
            self._done = True
            marked = self._exit_status
            if status is None and marked is not None:
                status, exit_code = marked[0], marked[1] if exit_code is None else exit_code
            if self._sampler is not None:
                self._sampler.close()
            self._publish_run(status or "finished", exit_code)
            exit_hooks.unregister(self)
            _forget(self)
            if self._feed is not None:
                self._feed.close()
            self._publisher.close(self._exit_timeout_s, journaled_ok=True, join_s=self._exit_join_s)

    def mark_exit(self, status: str, exit_code: int) -> None:
        if self._exit_status is None:
            self._exit_status = (status, exit_code)

    def finish_at_exit(self, wait: bool = True) -> None:
        """`finish()` at interpreter exit; `wait=False` (after a Ctrl-C there): journal what is unsent
        without waiting for the broker."""
        if not wait:
            self._exit_timeout_s, self._exit_join_s = 0.0, 1.0
        self.finish()

    @property
    def journal_directory(self) -> Path:
        """Where this run's events wait while the broker is away (`areal-metrics sync` sends them)."""
        return self._publisher.journal.directory

    def forget_after_fork(self) -> None:
        self._forked = True

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            self.finish()
        elif issubclass(exc_type, KeyboardInterrupt):
            self.finish("killed", 130)
        else:
            self.finish("failed", 1)

    def stats(self) -> RunStats:
        p = self._publisher.stats()
        return RunStats(steps=self._steps, evals=self._evals, skipped=self._skipped, queued=p.queued, sent=p.sent,
                        journaled=p.spilled, resent=p.resent, failed=p.failed, pending=p.pending, lost=p.lost)

    def __repr__(self) -> str:
        return f"Run({self.run_id!r}, rank={self.rank}/{self.world_size}, node={self.node!r}, attempt={self.attempt})"

    # ------------------------------------------------------------ helpers

    def _publish_run(self, status: str, exit_code: int | None = None) -> None:
        try:
            event = RunEvent(run_id=self.run_id, node=self.node, rank=self.rank, status=status, config=self.config,
                             tags=self.tags, group=self.group, world_size=self.world_size, host=self.host,
                             attempt=self.attempt, framework=self.framework, git_commit=self.git_commit,
                             exit_code=exit_code, name=self.name, notes=self.notes,
                             summary=coerce.config(self.summary) or None if status != "running" else None)
        except Exception as exc:  # noqa: BLE001 - the fields are cleaned above; never raise into training
            if status != "running" and self.summary:  # send the run's end without the summary rather than not at all
                self._warn_once(("summary", type(exc).__name__), f"run.summary not sent: {coerce.text_of(exc, 300)}")
                self.summary = {}
                self._publish_run(status, exit_code)
                return
            self._warn_once(("run-event", type(exc).__name__), f"run event not sent: {coerce.text_of(exc, 300)}")
            return
        self._publisher.publish(event)

    def _note_dropped(self, count: int) -> None:
        self._skipped += count
        self._warn_once("metrics-cap", f"log(): a step holds more than {self._max_metrics} metrics names "
                        f"(AREAL_MAX_METRICS); the first are sent, the rest skipped (see stats().skipped)")

    def _note_skipped(self, names: tuple[Any, ...]) -> None:
        self._skipped += len(names)
        for name in names:
            self._warn_once(("skipped", name), f"log(): {str(name)[:80]!r} is not a number; skipped")

    def _warn_once(self, key: Any, message: str) -> None:
        if key not in self._warned and len(self._warned) < 1000:
            self._warned.add(key)
            _log.warning(message)


def _eval_fields(verdicts: Any, accuracy: Any, samples: Any, status: str, error: Any, response_length: Any,
                 reward: Any, latency_ms: Any, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """log_eval's values -> EvalEvent fields: accuracy from the verdicts when not given, NaN made explicit."""
    out: dict[str, Any] = {"status": status}
    votes = coerce.verdicts(verdicts) if verdicts is not None else None
    records, cut = coerce.samples(samples)
    if votes is None and records and all("verdict" in r for r in records) and not cut:
        votes = [r["verdict"] for r in records]
    if votes is not None:
        out["verdicts"], out["n_samples"] = votes, len(votes)
    if records:
        out["samples"], out["_cut"] = records, cut
    given = coerce.to_number(accuracy)
    given = None if given is None else coerce.as_float(given)
    acc = None if given is None else coerce.clamp(given, 0.0, 1.0)
    extra = {"accuracy": given} if given is not None and acc is None else {}  # e.g. a percentage: kept in metrics
    if acc is None and votes:
        acc = sum(votes) / len(votes)
    if status == "ok" and acc is None:
        out["status"] = "failed"
        out["error"] = "no accuracy: accuracy was missing, not finite or outside 0..1, and no verdicts were given"
    if acc is not None:
        out["accuracy"] = acc
    for name, value in (("response_length", response_length), ("reward", reward), ("latency_ms", latency_ms)):
        x = coerce.to_number(value)
        x = None if x is None else coerce.as_float(x)
        if x is not None and (name == "reward" or x >= 0):
            out[name] = x
    extras, _ = coerce.float_metrics({**metrics, **extra})
    if extras:
        out["metrics"] = extras
    if error is not None:
        out["error"] = fit_message(str(error))
    return out


class _Step:
    """A logged step, built into its JSON on the sender thread (`Publisher`'s `Outgoing`)."""

    __slots__ = ("run", "step", "ts", "values")

    def __init__(self, run: Run, step: int, values: dict[Any, int | float], ts: float) -> None:
        self.run, self.step, self.values, self.ts = run, step, values, ts

    def encode(self, topics: Topics) -> tuple[str, bytes, bytes]:
        run = self.run
        try:
            given = self.values
            sampler = run._sampler
            if sampler is not None and (sample := sampler.take()):
                given = dict(given)  # the user's names first: the metrics cap keeps them before the samples
                for name, value in sample.items():
                    given.setdefault(name, value)
            values, skipped = coerce.numbers(given)
            if skipped:
                run._note_skipped(skipped)
            parts = coerce.split_step(values, run._epoch, run._max_metrics)
            if parts.dropped:
                run._note_dropped(parts.dropped)
            run._epoch = parts.epoch
            if parts.beyond:
                run._warn_once("beyond", f"log(): a value beyond +-{NUMBER_MAX:g} is sent as null and named in "
                                         f"non_finite (step {self.step})")
            data = {"type": "step", "schema": SCHEMA_VERSION, "event_id": uuid.uuid4().hex, "run_id": run.run_id,
                    "node": run.node, "rank": run.rank, "ts": self.ts, "step": self.step, "epoch": parts.epoch,
                    **parts.columns, "metrics": parts.metrics, "world_size": run.world_size, "attempt": run.attempt,
                    "non_finite": parts.non_finite}
            return topics.steps, run._key, dumps_compact(data)
        except Exception as exc:  # noqa: BLE001 - the sender thread must never raise: a dead letter instead
            run._warn_once(("encode", type(exc).__name__), f"log(): step {self.step} could not be encoded "
                                                          f"({type(exc).__name__}); sent as a dead letter")
            raw = coerce.text_of({coerce.text_of(k, 256): coerce.text_of(v, 256)
                                   for k, v in list(self.values.items())[:200]}, 64 * 1024)
            reason = f"client: step {self.step} could not be encoded: {coerce.text_of(exc, 1000)}"
            bad = rejected(raw, reason, topics.steps, node=run.node, key=run._key)
            return topics.deadletter, run._key, bad.to_json()


# ------------------------------------------------------------ W&B's module-level calls

class AlertLevel(str, enum.Enum):
    """W&B's alert levels (`wandb.AlertLevel`), for scripts that name them: INFO, WARN, ERROR."""

    INFO = "INFO"
    WARN = "WARN"
    ERROR = "ERROR"


_SEVERITIES = {"info": "info", "warn": "warning", "warning": "warning", "error": "critical", "critical": "critical"}


def _seconds(value: Any, default: float) -> float:
    """A duration as W&B's calls give it (seconds, a timedelta, None) in seconds; `default` for anything else."""
    if hasattr(value, "total_seconds"):
        value = value.total_seconds()
    try:
        return float(value) if value is not None else default
    except (TypeError, ValueError):
        return default


def alert_severity(level: Any) -> str:
    """An alert level as W&B spells it (AlertLevel.WARN, "ERROR") or as the contract does -> the contract's."""
    name = getattr(level, "value", level)
    found = _SEVERITIES.get(name.lower()) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"alert(): level must be info, warning or critical (W&B's INFO, WARN, ERROR), got {level!r}")
    return found


_current: Run | DisabledRun | None = None


def _forget(run: Any) -> None:
    global _current
    if _current is run:
        _current = None


def current() -> Run | None:
    """The run `init` last started in this process and that has not finished (W&B's `wandb.run`), or None."""
    return _current  # type: ignore[return-value]


def _need_run(call: str) -> Run:
    if _current is None:
        raise UserError(f"areal_metrics.{call}: no run; call areal_metrics.init() first")
    return _current  # type: ignore[return-value]


def log(data: Mapping[Any, Any], step: int | None = None, commit: bool | None = None) -> None:
    """`run.log` on the current run (W&B's `wandb.log`)."""
    _need_run("log()").log(data, step=step, commit=commit)


def finish(status: str | None = None, exit_code: int | None = None) -> None:
    """`run.finish` on the current run (W&B's `wandb.finish`); nothing when there is none."""
    if _current is not None:
        _current.finish(status, exit_code)


def alert(title: str, text: str = "", level: Any = "warning", wait_duration: Any = 60.0) -> None:
    """`run.alert` on the current run (W&B's `wandb.alert`)."""
    _need_run("alert()").alert(title, text, level, wait_duration)


def summary() -> dict[str, Any]:
    """The current run's `summary` (W&B's `wandb.summary`)."""
    return _need_run("summary").summary


class DisabledRun:
    """What `init` gives with `mode="disabled"` (AREAL_MODE=disabled): the calls of a `Run`, which do nothing.
    No thread, no journal, no state file, nothing sent: for debugging runs and unit tests of training code."""

    attempt = 0
    framework = None
    git_commit = None
    mode = "disabled"

    def __init__(self, run_id: str, identity: Identity, *, config: Any, tags: tuple[str, ...], group: str | None,
                 name: str | None, notes: str | None) -> None:
        self.run_id, self.name, self.notes, self.tags, self.group = run_id, name, notes, tags, group
        self.rank, self.world_size, self.local_rank = identity.rank, identity.world_size, identity.local_rank
        self.node, self.host = identity.node, identity.host
        self.config = config if config is not None else {}
        self.summary: dict[str, Any] = {}
        self.topics = None
        self._steps = 0
        self._started = time.time()

    def log(self, metrics: Mapping[Any, Any], step: int | None = None, commit: bool | None = None) -> None:
        self._steps += 1

    def log_eval(self, dataset: str, step: int | None = None, **fields: Any) -> None:
        return None

    def alert(self, title: str, text: str = "", level: Any = "warning", wait_duration: Any = 60.0) -> None:
        alert_severity(level)  # a wrong level is wrong in either mode

    def commands(self, *, every_node: bool = False, since: float | None = None) -> list[CommandEvent]:
        return []

    @property
    def commands_since(self) -> float:
        return self.started

    @property
    def started(self) -> float:
        return self._started

    def acknowledge(self, command: CommandEvent, status: str, *, step: int | None = None,
                    lr_factor: float | None = None, detail: str | None = None) -> None:
        return None

    def finish(self, status: str | None = None, exit_code: int | None = None) -> None:
        if status is not None and status not in TERMINAL_STATUSES:
            raise ValueError(f"finish(): status must be one of {', '.join(TERMINAL_STATUSES)} (got {status!r})")
        _forget(self)

    def mark_exit(self, status: str, exit_code: int) -> None:
        return None

    def finish_at_exit(self, wait: bool = True) -> None:
        return None

    @property
    def journal_directory(self) -> Path | None:
        return None

    def forget_after_fork(self) -> None:
        return None

    def stats(self) -> RunStats:
        return RunStats(steps=self._steps, evals=0, skipped=0, queued=0, sent=0, journaled=0, resent=0, failed=0,
                        pending=0)

    def __enter__(self) -> DisabledRun:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish()

    def __repr__(self) -> str:
        return f"DisabledRun({self.run_id!r}, rank={self.rank}/{self.world_size})"

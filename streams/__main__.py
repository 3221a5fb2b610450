"""`python -m areal_metrics.streams`: run the stream worker until SIGTERM (or Ctrl-C).

Environment: AREAL_KAFKA_BOOTSTRAP, AREAL_TOPIC_PREFIX, AREAL_KAFKA_REPLICATION_FACTOR,
AREAL_KAFKA_MIN_INSYNC_REPLICAS, AREAL_RAW_RETENTION_MS, AREAL_DERIVED_RETENTION_MS (topics
the worker creates: inputs on a fresh broker, its ticks, its state changelog), AREAL_HOME (Faust's data
directory is $AREAL_HOME/streams/), AREAL_STREAMS_CONFIG (optional JSON, see
areal_metrics.streams.core.config), AREAL_STREAMS_LOGLEVEL (default warning).
Tuning for tests and benchmarks: AREAL_STREAMS_COMMIT_INTERVAL (s, default 0.5),
AREAL_STREAMS_SESSION_TIMEOUT (s, default 10). AREAL_POISON_CRASHES (default 2): a message
in flight in that many crashes is dead-lettered and skipped ($AREAL_HOME/streams/crash/).
AREAL_WORKER_STOP_TIMEOUT_S (default 20): a stop signal ends the worker within that many seconds,
also while Kafka is unreachable (streams/shell/faust_internals.py BoundedStopWorker).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_metrics.streams.core.config import StreamsConfig


def load_config(environ: Mapping[str, str] | None = None) -> StreamsConfig:
    """The worker's StreamsConfig from the environment: the file $AREAL_STREAMS_CONFIG names, and the
    knobs whose defaults a variable may set (ENV_DEFAULTS: AREAL_COMMAND_ACK_STEPS, ...); the one place
    they are read (the pure core takes them as arguments)."""
    import os

    from areal_metrics.streams.core.config import ENV_DEFAULTS, StreamsConfig
    from areal_metrics.streams.shell.settings import WorkerSettings

    environ = os.environ if environ is None else environ
    own = WorkerSettings.from_env(environ)
    chosen = own.chosen(environ)
    env = {name: getattr(own, name) for name in ENV_DEFAULTS if name in chosen}
    return StreamsConfig.load(own.streams_config, env)


def main() -> int:
    from areal_metrics.producers.contract.errors import ArealError
    from areal_metrics.producers.contract.limits import StructureLimits, install_limits
    from areal_metrics.producers.runtime.kafka_wait import quick_bootstrap, until_kafka_answers
    from areal_metrics.producers.runtime.log_repeats import bound_repeated_lines
    from areal_metrics.producers.runtime.service_gc import settle_gc
    from areal_metrics.producers.contract.settings import Settings, state_dir
    from areal_metrics.streams.core.config import ConfigError
    from areal_metrics.streams.shell.kafka_admin import (
        KAFKA_DEFAULT_MAX_MESSAGE_BYTES,
        TopicLayoutError,
        ensure_committed_offsets,
        max_message_bytes,
        prepare_topics,
        repartition_max_bytes,
    )
    from areal_metrics.streams.state.state_store import RECORD_OVERHEAD
    from areal_metrics.streams.shell.settings import WorkerSettings

    try:
        settings = Settings.from_env()
        own = WorkerSettings.from_env()  # the worker's own (AREAL_STREAMS_*, AREAL_WORKER_*)
    except ArealError as exc:  # a setting that cannot be used: one line naming it
        print(f"areal-streams: {exc}", file=sys.stderr)
        return 2
    install_limits(StructureLimits.from_settings(settings))  # every message's structure limits (AREAL_MAX_*)
    topics = settings.topics
    loglevel = own.streams_loglevel.upper()
    logging.basicConfig(level=loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bound_repeated_lines(settings.log_repeat_s)  # a failure that repeats (Kafka gone) is one line a minute
    if loglevel not in ("DEBUG", "INFO"):
        # Faust's notes about timer overlap and producer back-pressure under load are
        # not problems of the worker; keep them out of the stack's log.
        for name in ("mode.timers", "faust.transport.producer"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        config = load_config()
        commit_interval = own.streams_commit_interval_s
        session_timeout = own.streams_session_timeout_s
    except (ConfigError, ValueError) as exc:
        print(f"areal-streams: {exc}", file=sys.stderr)
        return 2

    from kafka.errors import KafkaError

    from areal_metrics.streams.shell.app import (
        app_id_for,
        broker_credentials,
        build_worker,
        repartition_topic_for,
        ticks_topic_for,
    )
    from areal_metrics.streams.shell.faust_internals import BoundedStopWorker

    # Faust's name for the changelog of table "runs" (checked against the app below)
    changelog = f"{app_id_for(topics.prefix)}-runs-changelog"

    client_config = quick_bootstrap(settings.kafka_python_config())

    record_max = own.worker_state_record_max_bytes
    inputs = [topics.steps, topics.evals, topics.runs, topics.acks]
    repartitions = [repartition_topic_for(topics.prefix, name) for name in inputs]
    # the copies' bound from the settings (not the changelog's limit, which may be smaller)
    repartition_bytes = repartition_max_bytes(record_max, settings.max_message_bytes)

    def topics_and_offsets() -> tuple[int, int | None, int]:
        partitions = prepare_topics(
            settings.kafka_bootstrap,
            inputs,
            ticks_topic_for(topics.prefix),
            client_config=client_config,
            durability=settings,
            changelogs=[changelog],
            changelog_max_bytes=record_max,
            repartitions=repartitions,
            repartition_bytes=repartition_bytes,
        )
        # a changelog made before (by an older worker, or by hand) keeps its limit: records stay under it
        limit = max_message_bytes(settings.kafka_bootstrap, changelog, client_config=client_config)
        return partitions, limit, ensure_committed_offsets(
            settings.kafka_bootstrap,
            app_id_for(topics.prefix),
            from_start=[*inputs, *repartitions],
            from_end=[ticks_topic_for(topics.prefix)],
            timeout=max(60.0, 3 * session_timeout),
            client_config=client_config,
        )

    # A broker that does not answer yet is waited for; SIGTERM or Ctrl-C meanwhile stop the worker
    # cleanly (status 0). Faust puts its own handlers in place when it starts.
    stop = threading.Event()
    before = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        found = until_kafka_answers(topics_and_offsets, f"stream worker, Kafka at {settings.kafka_bootstrap}",
                                    settings.kafka_bootstrap.split(","), stop)
        if found is None or stop.is_set():
            return 0
        partitions, topic_limit, committed = found
    except (TopicLayoutError, ArealError) as exc:  # ArealError: a topic the settings cannot make (a timeout is waited out)
        print(f"areal-streams: {exc}", file=sys.stderr)
        return 2
    except KafkaError as exc:  # answered, and refused (an authorization, a request it cannot take)
        print(f"areal-streams: Kafka at {settings.kafka_bootstrap}: {exc}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in before.items():  # until Faust's own: a signal while it starts ends the process
            signal.signal(sig, handler)
    if topic_limit is None:  # not allowed to ask: assume the broker's default, which a topic made before has
        logging.getLogger("streams").warning(
            "could not read the max.message.bytes of changelog %s (grant the worker DESCRIBE_CONFIGS on its "
            "topics: docs/SECURITY.md); assuming Kafka's default, %d bytes", changelog, KAFKA_DEFAULT_MAX_MESSAGE_BYTES)
        topic_limit = KAFKA_DEFAULT_MAX_MESSAGE_BYTES
    if topic_limit < record_max:
        logging.getLogger("streams").warning(
            "changelog %s takes records of %d bytes (max.message.bytes), less than "
            "AREAL_WORKER_STATE_RECORD_MAX_BYTES (%d): a message whose state record would be larger is "
            "dead-lettered", changelog, topic_limit, record_max)
        record_max = max(RECORD_OVERHEAD + 1, topic_limit)
    if committed < 0:
        logging.getLogger("streams").warning(
            "could not give the new partitions of group %s a start offset (another worker is live); "
            "going on", app_id_for(topics.prefix))
    datadir = state_dir() / "streams"
    datadir.mkdir(parents=True, exist_ok=True)
    from areal_metrics.producers.runtime.poison import CrashGuard, crash_marker

    guard = CrashGuard(datadir / "crash", settings.poison_crashes, "stream worker")
    guard.start()  # a batch the last process died on: its messages go alone, or (twice) to the dead letters
    worker = build_worker(
        bootstrap=settings.kafka_bootstrap,
        topics=topics,
        datadir=datadir,
        config=config,
        partitions=partitions,
        commit_interval=commit_interval,
        session_timeout=session_timeout,
        credentials=broker_credentials(settings),
        replication_factor=settings.kafka_replication_factor,
        min_insync_replicas=settings.kafka_min_insync_replicas,
        linger_s=own.streams_linger_ms / 1000.0,
        guard=guard,
        crash_marker=crash_marker("worker", settings.test_crash_on),
        run_limits=(own.worker_run_idle_s, own.worker_ended_run_idle_s, own.worker_max_runs),
        state_record_max_bytes=record_max,
        repartition_bytes=repartition_bytes,
    )
    made = worker.app.tables["runs"].changelog_topic.get_topic_name()
    assert made == changelog, f"the worker made changelog {changelog}, Faust uses {made}"
    faust_worker = BoundedStopWorker(worker.app, loglevel=loglevel, quiet=True, redirect_stdouts=False,
                                     override_logging=False, stop_timeout_s=own.worker_stop_timeout_s,
                                     before_exit=guard.abandon)
    settle_gc()  # this process's own interpreter: everything built so far lives until exit
    try:
        faust_worker.execute_from_commandline()
    except SystemExit as exc:  # mode's worker exits through SystemExit; keep its status
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

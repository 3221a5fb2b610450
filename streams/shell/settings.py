"""The stream worker's own settings (AREAL_STREAMS_*, AREAL_WORKER_*, the knobs' defaults): read by
`python -m areal_metrics.streams` alone, by the contract's one parser (docs/SETTINGS.md).
The shell takes their defaults from here when a caller passes none; it reads no environment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from areal_metrics.producers.contract.settings import LOG_LEVELS, PATH, SettingGroup, setting


@dataclass(frozen=True)
class WorkerSettings(SettingGroup):
    """The stream worker (`python -m areal_metrics.streams`)"""

    streams_config: Annotated[str, PATH] | None = setting(
        "AREAL_STREAMS_CONFIG", None, "JSON file of the worker's thresholds, "
        "per run (docs/STREAMS.md)", readers="worker")
    streams_loglevel: str = setting("AREAL_STREAMS_LOGLEVEL", "warning", "the worker's log level",
                                    choices=LOG_LEVELS, readers="worker")
    streams_commit_interval_s: float = setting("AREAL_STREAMS_COMMIT_INTERVAL", 0.5, "seconds between the "
                                               "worker's offset commits", ge=0.01, le=3600,
                                               readers="worker")
    streams_session_timeout_s: float = setting("AREAL_STREAMS_SESSION_TIMEOUT", 10.0, "consumer group session "
                                               "timeout, seconds", ge=1, le=3600, readers="worker")
    streams_linger_ms: float = setting("AREAL_STREAMS_LINGER_MS", 5.0, "how long a batch waits for more input, "
                                       "ms", ge=0, le=10_000, readers="worker")
    command_ack_steps: int = setting("AREAL_COMMAND_ACK_STEPS", 10, "command_not_applied when a node of a running "
                                     "run has not acknowledged a scale_lr this many steps after its from_step",
                                     ge=0, le=1_000_000, readers="worker")
    vote_undecided_alert: float = setting("AREAL_VOTE_UNDECIDED_ALERT", 0.05, "`vote_undecided` when a round's "
                                          "share of undecided samples exceeds this (the streams config's "
                                          "`vote_undecided_alert` wins)", ge=0, le=1,
                                          readers="worker")
    worker_run_idle_s: float = setting("AREAL_WORKER_RUN_IDLE_S", 86_400.0, "a run with no input for this long "
                                       "(worker clock, s) leaves the worker's state (memory and changelog) once no "
                                       "step, vote round or stall alert of it waits; one that comes back starts "
                                       "over as a new run", ge=1, le=31_536_000, readers="worker")
    worker_ended_run_idle_s: float = setting("AREAL_WORKER_ENDED_RUN_IDLE_S", 900.0, "the same for a run that "
                                             "ended (finished, failed, killed), s", ge=1,
                                             le=31_536_000, readers="worker")
    worker_max_runs: int = setting("AREAL_WORKER_MAX_RUNS", 10_000, "the most runs the worker keeps state for; "
                                   "past it the run whose last input is oldest leaves first, whatever waits in it "
                                   "(docs/SCALING.md: the bytes a run costs)", ge=1, le=10_000_000,
                                   readers="worker")
    worker_state_record_max_bytes: int = setting("AREAL_WORKER_STATE_RECORD_MAX_BYTES", 8 << 20, "the largest "
                                                 "record of the worker's state (a vote round holds every node's "
                                                 "verdicts and sample ids until it is decided): a message that "
                                                 "would make one larger is dead-lettered, naming the sizes. The "
                                                 "worker makes its changelog topic take such records "
                                                 "(max.message.bytes); on a changelog made smaller before, the "
                                                 "topic's limit applies", ge=64 << 10, le=1 << 30,
                                                 readers="worker")
    worker_stop_timeout_s: float = setting("AREAL_WORKER_STOP_TIMEOUT_S", 20.0, "after SIGTERM or SIGINT the "
                                           "worker stops cleanly (a last flush and commit) or, past this many "
                                           "seconds (Kafka unreachable), exits with status 1 without it: Kafka "
                                           "redelivers what it had not committed", ge=1, le=3600,
                                           readers="worker")

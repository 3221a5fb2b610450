"""Topic names, in one place. The prefix comes from AREAL_TOPIC_PREFIX."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.events import (
    AlertEvent,
    CommandAckEvent,
    CommandEvent,
    EvalConsensusEvent,
    EvalEvent,
    Event,
    RejectedEvent,
    RewardSmoothedEvent,
    RunEvent,
    StepEvent,
)

DEFAULT_PREFIX = "areal."

# topic suffix -> the one event type it carries (CONTRACT.md, 'Topics')
TOPIC_TYPES: dict[str, type[Event]] = {
    "steps": StepEvent,
    "evals": EvalEvent,
    "evals.consensus": EvalConsensusEvent,
    "rewards.smoothed": RewardSmoothedEvent,
    "control": CommandEvent,
    "alerts": AlertEvent,
    "deadletter": RejectedEvent,
    "runs": RunEvent,
    "acks": CommandAckEvent,  # trainers' acknowledgements of commands (they need no write access to control)
}

# Written by the stream processor and rebuilt by running it again over the raw
# topics; every other topic (trainers' input, people's commands, dead letters)
# is raw: the source of truth that `replay` rebuilds the tables from.
DERIVED_SUFFIXES = frozenset({"evals.consensus", "rewards.smoothed", "alerts"})


class DurabilitySettings(Protocol):
    """What `topic_spec` reads; `areal_metrics.producers.contract.settings.Settings` has these fields."""

    kafka_replication_factor: int
    kafka_min_insync_replicas: int
    raw_retention_ms: int
    derived_retention_ms: int


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """How a topic is created: replication factor and topic-level configs (Kafka's names)."""

    name: str
    replication_factor: int
    config: Mapping[str, str] = field(default_factory=dict)


def topic_spec(name: str, settings: DurabilitySettings, *, derived: bool) -> TopicSpec:
    """The replication, min ISR and retention of one topic from the settings (pure).

    Raw topics keep `raw_retention_ms` (-1: forever, the default), derived ones
    `derived_retention_ms`; the stream worker uses this for Faust's internal
    topics too (derived=True). ConfigError for values Kafka would refuse.
    """
    rf, min_isr = settings.kafka_replication_factor, settings.kafka_min_insync_replicas
    retention = settings.derived_retention_ms if derived else settings.raw_retention_ms
    if rf < 1:
        raise ConfigError(f"AREAL_KAFKA_REPLICATION_FACTOR: must be >= 1 (got {rf})")
    if not 1 <= min_isr <= rf:
        raise ConfigError(f"AREAL_KAFKA_MIN_INSYNC_REPLICAS: must be in 1..{rf}, the replication factor (got {min_isr})")
    if retention != -1 and retention < 1:
        which = "AREAL_DERIVED_RETENTION_MS" if derived else "AREAL_RAW_RETENTION_MS"
        raise ConfigError(f"{which}: must be -1 (keep forever) or > 0 ms (got {retention})")
    config = {"min.insync.replicas": str(min_isr), "retention.ms": str(retention)}
    if retention == -1:
        config["retention.bytes"] = "-1"  # kept forever: no size limit either
    return TopicSpec(name, rf, config)


@dataclass(frozen=True, slots=True)
class Topics:
    """The full topic names under one prefix."""

    prefix: str = DEFAULT_PREFIX

    @property
    def steps(self) -> str:
        return self.prefix + "steps"

    @property
    def evals(self) -> str:
        return self.prefix + "evals"

    @property
    def consensus(self) -> str:
        return self.prefix + "evals.consensus"

    @property
    def smoothed(self) -> str:
        return self.prefix + "rewards.smoothed"

    @property
    def control(self) -> str:
        return self.prefix + "control"

    @property
    def alerts(self) -> str:
        return self.prefix + "alerts"

    @property
    def deadletter(self) -> str:
        return self.prefix + "deadletter"

    @property
    def runs(self) -> str:
        return self.prefix + "runs"

    @property
    def acks(self) -> str:
        return self.prefix + "acks"

    def all(self) -> list[str]:
        return [self.prefix + suffix for suffix in TOPIC_TYPES]

    def is_derived(self, topic: str) -> bool:
        """True for a topic the stream processor writes (KeyError for a topic not ours)."""
        self.event_type(topic)
        return topic[len(self.prefix):] in DERIVED_SUFFIXES

    def specs(self, settings: DurabilitySettings) -> list[TopicSpec]:
        """Every topic's creation spec under this prefix (see `topic_spec`)."""
        return [topic_spec(name, settings, derived=self.is_derived(name)) for name in self.all()]

    def for_event(self, event: Event | type[Event]) -> str:
        cls = event if isinstance(event, type) else type(event)
        for suffix, event_cls in TOPIC_TYPES.items():
            if event_cls is cls:
                return self.prefix + suffix
        raise KeyError(cls.__name__)

    def event_type(self, topic: str) -> type[Event]:
        """The event type a topic carries; KeyError for a topic not ours."""
        if not topic.startswith(self.prefix):
            raise KeyError(topic)
        return TOPIC_TYPES[topic[len(self.prefix):]]

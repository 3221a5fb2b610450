"""Topic names, in one place. The prefix comes from AREAL_TOPIC_PREFIX."""

from __future__ import annotations

import os
from dataclasses import dataclass

from producers.events import (
    AlertEvent,
    CommandEvent,
    EvalConsensusEvent,
    EvalEvent,
    Event,
    RejectedEvent,
    RewardSmoothedEvent,
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
}


@dataclass(frozen=True, slots=True)
class Topics:
    """The full topic names under one prefix."""

    prefix: str = DEFAULT_PREFIX

    @classmethod
    def from_env(cls) -> Topics:
        return cls(os.environ.get("AREAL_TOPIC_PREFIX", DEFAULT_PREFIX))

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

    def all(self) -> list[str]:
        return [self.prefix + suffix for suffix in TOPIC_TYPES]

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

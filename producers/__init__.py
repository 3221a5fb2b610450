"""The ground floor: the event contract, topics, settings and the publisher.

Imports nothing else of this project; `streams`, `sinks` and `areal_train`
build on it.
"""

from producers.events import (
    AlertEvent,
    CommandEvent,
    EvalConsensusEvent,
    EvalEvent,
    Event,
    RejectedEvent,
    RewardSmoothedEvent,
    StepEvent,
    ValidationError,
    event_from_dict,
    parse_event,
)
from producers.topics import Topics

__all__ = [
    "AlertEvent",
    "CommandEvent",
    "EvalConsensusEvent",
    "EvalEvent",
    "Event",
    "RejectedEvent",
    "RewardSmoothedEvent",
    "StepEvent",
    "Topics",
    "ValidationError",
    "event_from_dict",
    "parse_event",
]

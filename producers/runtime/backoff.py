"""One backoff rule for everything that retries a service that is away (pure).

The publisher reconnecting to Kafka, the control feed re-subscribing and the
sink retrying a store that is down all wait `Backoff.delay(attempt)`:
exponential from `initial_s`, capped at `max_s`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff: initial, multiplied by `factor` per retry, capped."""

    initial_s: float = 0.2
    factor: float = 2.0
    max_s: float = 10.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (1-based); 0 before the first."""
        if attempt < 1:
            return 0.0
        return min(self.max_s, self.initial_s * self.factor ** (attempt - 1))

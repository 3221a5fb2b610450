"""The project's errors, re-exported for the CLI (they live in the ground package)."""

from areal_metrics.producers.contract.errors import ArealError, ConfigError, ServiceUnavailable, UserError, one_line

__all__ = ["ArealError", "ConfigError", "ServiceUnavailable", "UserError", "one_line"]

"""What every long-running process shares beside the contract: topic creation and metadata
waits (Kafka admin), one backoff rule, and the services' garbage-collection settings."""

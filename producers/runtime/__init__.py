"""What every long-running process shares beside the contract: topic creation and metadata
waits (Kafka admin), one backoff rule, the services' garbage-collection settings, and the
crash guard that dead-letters a message which crashed a service twice (poison.py)."""

"""The ground floor, in rooms by concern (installed as `areal_metrics.producers`):

- `contract/`: the events and their field rules, run ids, topics, dead letters, run status,
  settings and errors. Imports nothing else of the project.
- `runtime/`: Kafka admin (topic creation, metadata waits), backoff, the services' GC settings.
- `delivery/`: the non-blocking publisher, its Kafka backends and the journal.
- `client/`: the public client (`init` -> `Run`) that `areal_metrics.init` re-exports.

`streams`, `sinks`, `areal_train` and `grafana` build on `contract` and `runtime` only.
"""

"""Analysis: what the stored rows say about runs, for people.

`report` (the PNG figures of `areal-metrics report`, drawn by `figures`, its evaluation details
in `eval_details`) and `comparison` (two groups of runs compared: `areal-metrics compare`). They
read the store through `areal_metrics.sinks.query` and take their statistics from
`areal_metrics.producers.contract.statistics`; the CLI's verbs (`commands/`) call them.
"""

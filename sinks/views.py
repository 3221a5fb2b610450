"""The views every reader uses (their SQL text; `schema` creates them).

`v_<table>` is the table deduplicated: `SELECT * FROM <table> FINAL`, which
ClickHouse merges only in the key ranges where parts overlap (all versions of
a row share a partition, see `areal_metrics.sinks.schema`); a reader's filter on the
sorting key (run_id first) narrows the partitions and ranges read before that. A filter on another column (`ts`) is
applied after the deduplication, as it must be: of a row's versions only the
winner may be tested. With a TTL on raw steps, `v_steps` also hides rows past
it, whether or not a merge has removed them yet (TTL is applied part by part,
so an expired winner could be gone while the version it replaced is not).
"""

from __future__ import annotations


def final_view(db: str, table: str, ttl: str | None = None) -> str:
    """The deduplicated table; `ttl`: the table's TTL expression (rows past it are left out)."""
    where = f" WHERE {ttl} > now()" if ttl else ""
    return f"SELECT * FROM {db}.{table} FINAL{where}"


# v_runs: one row per run, folded from its run events in three steps (areal_metrics.producers.contract.run_status
# states the same rule in Python, for `watch`):
# - a rank's status in an attempt: its terminal event if it sent one, else `running`;
# - an attempt's status: failed if a rank failed, else killed if a rank was killed, else
#   running while a rank that reported is running, else finished (the ranks that registered: a run
#   logged from rank 0 alone under WORLD_SIZE > 1 ends when rank 0 does);
# - the run: its latest attempt (config, tags, group from its lowest rank), started at its
#   first event of any attempt, ended when its latest attempt ended; its `summary` (run.summary, sent
#   with a rank's end) from the lowest rank that sent one, of the latest attempt that has one, so a
#   resumed attempt still running shows the summary its predecessor ended with (as W&B keeps it).
# argMax skips NULLs: `argMax(tuple(x), a).1` takes the latest attempt's value, NULL included.
RUNS_VIEW = """SELECT
    run_id,
    argMax(a_status, a_attempt) AS status,
    max(a_attempt) AS attempt,
    count() AS attempts,
    argMax(a_config, a_attempt) AS config,
    argMax(a_tags, a_attempt) AS tags,
    argMax(tuple(a_group), a_attempt).1 AS `group`,
    argMax(a_world_size, a_attempt) AS world_size,
    argMax(a_ranks, a_attempt) AS ranks,
    argMax(a_hosts, a_attempt) AS hosts,
    argMax(tuple(a_framework), a_attempt).1 AS framework,
    argMax(tuple(a_git_commit), a_attempt).1 AS git_commit,
    argMax(tuple(a_exit_code), a_attempt).1 AS exit_code,
    argMax(tuple(a_name), a_attempt).1 AS name,
    argMax(tuple(a_notes), a_attempt).1 AS notes,
    argMax(a_summary, a_attempt) AS summary,
    min(a_started) AS started,
    argMax(tuple(a_ended), a_attempt).1 AS ended,
    max(a_ts) AS ts
FROM
(
    SELECT
        run_id,
        attempt AS a_attempt,
        multiIf(countIf(r_status = 'failed') > 0, 'failed', countIf(r_status = 'killed') > 0, 'killed',
                countIf(r_status = 'running') > 0, 'running', 'finished') AS a_status,
        argMin(r_config, rank) AS a_config,
        argMin(r_tags, rank) AS a_tags,
        argMin(r_group, rank) AS a_group,
        max(r_world_size) AS a_world_size,
        count() AS a_ranks,
        arraySort(groupUniqArray(r_host)) AS a_hosts,
        argMin(r_framework, rank) AS a_framework,
        argMin(r_git_commit, rank) AS a_git_commit,
        argMax(r_exit_code, (ifNull(r_exit_code, 0) != 0, r_ts)) AS a_exit_code,
        argMin(r_name, rank) AS a_name,
        argMin(r_notes, rank) AS a_notes,
        argMin(r_summary, rank) AS a_summary,
        min(r_started) AS a_started,
        if(a_status = 'running', NULL, max(r_ended)) AS a_ended,
        max(r_ts) AS a_ts
    FROM
    (
        SELECT
            run_id,
            attempt,
            rank,
            argMax(status, (status != 'running', ts, status)) AS r_status,
            argMax(config, ts) AS r_config,
            argMax(tags, ts) AS r_tags,
            argMax(`group`, ts) AS r_group,
            max(world_size) AS r_world_size,
            ifNull(argMax(host, ts), node) AS r_host,
            argMax(framework, ts) AS r_framework,
            argMax(git_commit, ts) AS r_git_commit,
            argMaxIf(exit_code, ts, status != 'running') AS r_exit_code,
            argMax(name, ts) AS r_name,
            argMax(notes, ts) AS r_notes,
            argMax(summary, ts) AS r_summary,
            min(ts) AS r_started,
            if(countIf(status != 'running') > 0, maxIf(ts, status != 'running'), NULL) AS r_ended,
            max(ts) AS r_ts
        FROM {db}.runs FINAL
        GROUP BY run_id, attempt, rank, node
    )
    GROUP BY run_id, attempt
)
GROUP BY run_id"""


# v_command_status: one row per command (of `commands`) with what the trainers answered (`command_acks`):
# the nodes that applied it, each with the step from which it applies and its cumulative lr factor, the
# first time one applied it, and the nodes that ignored it with their reasons. A command no node
# acknowledged has empty arrays.
COMMAND_STATUS_VIEW = """SELECT
    c.run_id AS run_id,
    c.event_id AS command_id,
    c.command AS command,
    c.args AS args,
    c.reason AS reason,
    c.target_node AS target_node,
    c.ts AS ts,
    arraySort(groupUniqArrayIf(a.node, a.status = 'applied')) AS applied_nodes,
    groupArrayIf((a.node, a.step, a.lr_factor, a.ts), a.status = 'applied') AS applied,
    minIf(a.ts, a.status = 'applied') AS first_applied_at,
    arraySort(groupUniqArrayIf(a.node, a.status = 'ignored')) AS ignored_nodes,
    groupArrayIf((a.node, a.step, a.detail), a.status = 'ignored') AS ignored
FROM (SELECT run_id, event_id, command, args, reason, target_node, ts FROM {db}.commands FINAL) AS c
LEFT JOIN (SELECT run_id, command_id, node, status, step, lr_factor, detail, ts FROM {db}.command_acks FINAL) AS a
    ON a.run_id = c.run_id AND a.command_id = c.event_id
GROUP BY c.run_id, c.event_id, c.command, c.args, c.reason, c.target_node, c.ts"""

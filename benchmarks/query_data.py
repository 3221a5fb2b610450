"""A store the size of a long-lived deployment, generated inside the engine (INSERT ... SELECT from numbers()).

`generate(client, shape)` fills every table the dashboards read, through the
schema of `areal_metrics.sinks.schema` (whatever layout it has), so the same data can be
measured on an old and a new layout:

- `steps`: `shape.runs` runs x `shape.ranks` ranks x `shape.steps` steps
  (50 x 64 x 3,125 = 10,000,000 distinct rows), one run every `run_gap_s`,
  a step every `step_s`, every contract column filled; the node name is the
  client's default `host:local_rank` (8 hosts of 8 ranks). The newest run
  was resumed: attempt 1 from step `resume_from` replaced attempt 0's rows
  (merged away by the time of the measurement, as background merges do),
  and 5 % of its live tail was delivered twice (the same event at a later
  offset, in parts of their own: what `FINAL` has to collapse).
- per run: smoothed rewards (one per step), evaluation rounds every 50 steps
  on two datasets (a quick stage each round, a full stage every fourth) from
  8 nodes, their samples (4 per result), their consensus, alerts, commands (and the trainers' acks),
  and the run events of every rank; a few dead letters.

History is inserted in large blocks and merged (`OPTIMIZE ... FINAL`), as
background merges leave old data; the newest run's last `tail_steps` steps
then arrive as the sink writes them (blocks of `sink_rows`), after which
merges are stopped so that every repetition reads the same parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NOW = 1_773_000_000  # 2026-03-08 19:20 UTC: the generated store's "now"


@dataclass(frozen=True)
class Shape:
    runs: int = 50
    ranks: int = 64
    steps: int = 3_125
    step_s: int = 15
    run_gap_s: int = 86_400
    resume_from: int = 1_900  # the newest run's attempt 1 replaces attempt 0 from this step
    resumed_steps: int = 100  # attempt 0 had reached resume_from + resumed_steps - 1
    redelivered_per_mille: int = 50  # of the newest run's live tail, sent twice
    tail_steps: int = 120  # the newest run's last steps, inserted in sink-sized blocks
    sink_rows: int = 5_000
    now: int = NOW

    @property
    def rows(self) -> int:
        return self.runs * self.ranks * self.steps

    @property
    def duration_s(self) -> int:
        return self.steps * self.step_s

    def run_id(self, r: int) -> str:
        return f"run-{r:03d}"

    @property
    def newest(self) -> str:
        return self.run_id(self.runs - 1)


def _u(salt: int, of: str = "number") -> str:
    """A deterministic uniform value in [0, 1) from `of`."""
    return f"(intHash64({of} * 131 + {salt}) % 1000000) / 1000000.0" if of == "number" else \
        f"(sipHash64({of}, {salt}) % 1000000) / 1000000.0"


def _run_start(shape: Shape, r: str) -> str:
    return f"({shape.now} - {shape.duration_s} - ({shape.runs - 1} - {r}) * {shape.run_gap_s})"


def _step_select(shape: Shape, where: str, attempt: str, ts_shift_steps: str = "0", offset: str = "number",
                 salt: int = 0) -> str:
    """SELECT of steps rows; `number` enumerates (run, step, rank) in log order."""
    per_run = shape.ranks * shape.steps
    r = f"intDiv(number, {per_run})"
    step = f"(intDiv(number % {per_run}, {shape.ranks}) + 1)"
    rank = f"(number % {shape.ranks})"
    progress = f"({step} / {shape.steps})"
    ts = f"({_run_start(shape, r)} + ({step} - {ts_shift_steps}) * {shape.step_s} + {rank} * 0.003)"
    return f"""SELECT
    lower(concat(hex(intHash64(number)), hex(intHash64(number * 7 + {salt})))) AS event_id,
    concat('run-', leftPad(toString({r}), 3, '0')) AS run_id,
    concat('gpu', toString(intDiv({rank}, 8)), ':', toString({rank} % 8)) AS node,
    toUInt32({rank}) AS rank,
    toDateTime64({ts}, 3, 'UTC') AS ts,
    toUInt16(1) AS schema,
    toUInt64({step}) AS step,
    {step} / 100 AS epoch,
    0.2 + 0.6 * {progress} + 0.1 * ({_u(1)} - 0.5) AS reward,
    0.1 + 0.05 * {_u(2)} AS reward_std,
    1.5 - {progress} + 0.05 * {_u(3)} AS entropy,
    0.02 * ({_u(4)} - 0.5) AS advantage_mean,
    0.9 + 0.2 * {_u(5)} AS advantage_std,
    0.01 + 0.02 * {progress} * {_u(6)} AS kl,
    0.05 + 0.1 * {_u(7)} AS clip_ratio,
    0.5 - 0.3 * {progress} + 0.05 * {_u(8)} AS loss,
    3e-6 AS lr,
    0.5 + {_u(9)} AS grad_norm,
    200 + 300 * {progress} + 20 * {_u(10)} AS response_length,
    toUInt64(8192 + 4096 * {_u(11)}) AS tokens,
    1500 + 500 * {_u(12)} AS throughput,
    {shape.step_s} * 1000 * (0.9 + 0.1 * {_u(13)}) AS latency_ms,
    toUInt64(60e9 + 10e9 * {_u(14)}) AS gpu_mem_bytes,
    map('actor/pg_loss', {_u(15)}, 'critic/vf_loss', {_u(16)}, 'perf/mfu', 0.4 + 0.1 * {_u(17)},
        'timing/gen_s', 5 + {_u(18)}) AS metrics,
    toUInt32({shape.ranks}) AS world_size,
    toUInt32({attempt}) AS attempt,
    CAST([], 'Array(String)') AS non_finite,
    toUInt64(256) AS n_samples,
    'areal.steps' AS _topic,
    toUInt32(sipHash64({r}) % 8) AS _partition,
    toUInt64({offset}) AS _offset
FROM numbers({{start}}, {{count}})
WHERE {where}"""


STEP_COLUMNS = ("event_id, run_id, node, rank, ts, schema, step, epoch, reward, reward_std, entropy, advantage_mean, "
                "advantage_std, kl, clip_ratio, loss, lr, grad_norm, response_length, tokens, throughput, latency_ms, "
                "gpu_mem_bytes, metrics, world_size, attempt, non_finite, n_samples, _topic, _partition, _offset")


def _insert_steps(client: Any, db: str, shape: Shape, start: int, count: int, select: str) -> None:
    client.command(f"INSERT INTO {db}.steps ({STEP_COLUMNS}) " + select.format(start=start, count=count))


def generate_steps(client: Any, db: str, shape: Shape) -> None:
    per_run = shape.ranks * shape.steps
    newest = shape.runs - 1
    step = f"(intDiv(number % {per_run}, {shape.ranks}) + 1)"
    attempt = f"if(intDiv(number, {per_run}) = {newest} AND {step} >= {shape.resume_from}, 1, 0)"
    history = _step_select(shape, "1", attempt)
    tail_from = newest * per_run + (shape.steps - shape.tail_steps) * shape.ranks
    for r in range(0, tail_from, per_run):  # one block per run, as a bulk load of the history would be
        _insert_steps(client, db, shape, r, min(per_run, tail_from - r), history)
    # the attempt-0 rows that attempt 1 replaced (earlier in time and in the log)
    replaced = _step_select(shape, f"{step} >= {shape.resume_from}", "0", ts_shift_steps=str(shape.resumed_steps + 10),
                            offset=f"number - {per_run}", salt=1)
    first = newest * per_run + (shape.resume_from - 1) * shape.ranks
    _insert_steps(client, db, shape, first, shape.resumed_steps * shape.ranks, replaced)
    client.command(f"OPTIMIZE TABLE {db}.steps FINAL")
    for start in range(tail_from, shape.rows, shape.sink_rows):  # the live tail, as the sink writes it
        _insert_steps(client, db, shape, start, min(shape.sink_rows, shape.rows - start), history)
    # redelivered events: recent rows again at later offsets (a producer's retry after a lost acknowledgement)
    again = history.replace("WHERE 1", f"WHERE intHash64(number) % 1000 < {shape.redelivered_per_mille}")
    again = again.replace("toUInt64(number) AS _offset", f"toUInt64(number + {shape.rows}) AS _offset")
    _insert_steps(client, db, shape, tail_from, shape.rows - tail_from, again)


def generate_in_sink_blocks(client: Any, db: str, shape: Shape) -> None:
    """Every step row in blocks of `shape.sink_rows`, as the sink writes them (no bulk history, no OPTIMIZE:
    the parts are what the store's merges make of the sink's blocks), then the derived tables."""
    history = _step_select(shape, "1", "0")
    for start in range(0, shape.rows, shape.sink_rows):
        _insert_steps(client, db, shape, start, min(shape.sink_rows, shape.rows - start), history)
    generate_derived(client, db, shape)


def _per_step(shape: Shape, what: str) -> str:
    """FROM numbers over (run, step) with r, step, t (the step's time) and p (progress) as aliases."""
    r = f"intDiv(number, {shape.steps})"
    return (f"SELECT {what} FROM (SELECT number, {r} AS r, (number % {shape.steps}) + 1 AS step, "
            f"{_run_start(shape, 'r')} + step * {shape.step_s} AS t, step / {shape.steps} AS p, "
            f"concat('run-', leftPad(toString(r), 3, '0')) AS run FROM numbers({shape.runs * shape.steps}))")


def generate_derived(client: Any, db: str, shape: Shape) -> None:
    """Smoothed rewards, evaluations and their samples, consensus, alerts, commands, run events, dead letters."""
    c = client.command
    c(f"""INSERT INTO {db}.rewards_smoothed (event_id, run_id, node, rank, ts, schema, step, reward, window, sliding_avg,
        ema, slope, _topic, _partition, _offset)
        {_per_step(shape, f'''lower(hex(MD5(concat(run, ':', toString(step), ':smooth')))), run, 'worker', 0,
        toDateTime64(t + 0.5, 3, 'UTC'), 1, step, 0.2 + 0.6 * p + 0.05 * ({_u(21)} - 0.5), 20, 0.2 + 0.6 * p,
        0.19 + 0.6 * p, 0.6 / {shape.steps}, 'areal.rewards.smoothed', 0, number''')}""")
    # evaluation rounds: every 50 steps, datasets x stages (full every 4th round) x 8 nodes
    rounds = f"""SELECT * FROM ({_per_step(shape, "r, run, step, t, p, number")}) WHERE step % 50 = 0"""
    results = f"""SELECT r, run, step, t, p, number, dataset, stage, node_i FROM ({rounds})
        ARRAY JOIN ['gsm8k', 'math500'] AS dataset
        ARRAY JOIN ['quick', 'full'] AS stage
        ARRAY JOIN range(8) AS node_i
        WHERE stage = 'quick' OR step % 200 = 0"""
    eval_id = "concat(run, ':', toString(step), ':', dataset, ':', stage)"
    c(f"""INSERT INTO {db}.evals (event_id, run_id, node, rank, ts, schema, eval_id, step, dataset, stage, status,
        accuracy, response_length, reward, n_samples, latency_ms, verdicts, replicas, metrics, attempt,
        _topic, _partition, _offset)
        SELECT lower(hex(MD5(concat({eval_id}, ':', toString(node_i))))), run, concat('gpu', toString(node_i), ':0'),
        node_i * 8, toDateTime64(t + 30 + node_i, 3, 'UTC'), 1, {eval_id}, step, dataset, stage, 'ok',
        0.3 + 0.5 * p + 0.05 * {_u(31, 'eval_id, node_i')}, 250 + 200 * p, 0.3 + 0.5 * p, 64,
        20000 + 5000 * {_u(32, 'eval_id, node_i')}, arrayMap(i -> toUInt8(sipHash64(i, node_i, step) % 2), range(64)),
        8, map(), 0, 'areal.evals', 0, number * 100 + node_i
        FROM (SELECT *, {eval_id} AS eval_id FROM ({results}))""")
    c(f"""INSERT INTO {db}.generations (event_id, run_id, node, rank, ts, schema, eval_id, step, dataset, stage, sample,
        prompt, response, verdict, reward, attempt, gold, error_type, _topic, _partition, _offset)
        SELECT event_id, run_id, node, rank, ts, schema, eval_id, step, dataset, stage, toUInt32(s),
        concat('Question ', toString(step), '.', toString(s), ': ', repeat('what is 12 + 30? ', 5)),
        concat('Let me think step by step. ', repeat('12 plus 30 is 42. ', 10), 'Answer: 42'),
        toUInt8(sipHash64(event_id, s) % 2), toFloat64(sipHash64(event_id, s) % 2), 0, '42',
        if(sipHash64(event_id, s) % 2 = 1, '', 'carry'), 'areal.evals', 0, _offset
        FROM {db}.evals ARRAY JOIN range(4) AS s""")
    c(f"""INSERT INTO {db}.eval_consensus (event_id, run_id, node, rank, ts, schema, eval_id, step, dataset, stage,
        accuracy, response_length, votes, replicas, agreement, dissenters, stale, partial, n_samples, n_undecided,
        ci_low, ci_high, metrics, _topic, _partition, _offset)
        SELECT lower(hex(MD5(concat(eval_id, ':consensus')))), run_id, 'worker', 0, max(ts) + 1, 1, eval_id, step,
        dataset, stage, avg(accuracy), avg(response_length), 8, 8, 0.9, ['gpu3:0'], sipHash64(eval_id) % 40 = 0,
        sipHash64(eval_id) % 40 = 1, 256, 4, greatest(avg(accuracy) - 0.06, 0), least(avg(accuracy) + 0.06, 1),
        map('pass@4', least(avg(accuracy) + 0.2, 1), 'maj@4', avg(accuracy), 'greedy_accuracy', avg(accuracy)),
        'areal.evals.consensus', 0, min(_offset)
        FROM {db}.evals GROUP BY run_id, eval_id, step, dataset, stage""")
    alerts = f"SELECT * FROM ({_per_step(shape, 'r, run, step, t, number')}) WHERE step % 300 = 150"
    c(f"""INSERT INTO {db}.alerts (event_id, run_id, node, rank, ts, schema, alert_id, kind, severity, message, step,
        value, threshold, _topic, _partition, _offset)
        SELECT lower(hex(MD5(concat(run, ':', toString(step), ':alert')))), run, 'worker', 0,
        toDateTime64(t + 2, 3, 'UTC'), 1, concat(run, ':', toString(step), ':reward'), 'reward_below_threshold',
        ['info', 'warning', 'critical'][1 + step % 3], concat('reward below threshold at step ', toString(step)), step,
        0.3, 0.35, 'areal.alerts', 0, number FROM ({alerts})""")
    c(f"""INSERT INTO {db}.commands (event_id, run_id, node, rank, ts, schema, command, target_node, args, reason,
        _topic, _partition, _offset)
        SELECT lower(hex(MD5(concat(run, ':', toString(step), ':command')))), run, 'worker', 0,
        toDateTime64(t + 3, 3, 'UTC'), 1, ['scale_lr', 'set_eval_interval', 'evaluate'][1 + step % 3], NULL,
        ['{{"factor":0.5}}', '{{"steps":25}}', '{{}}'][1 + step % 3], concat('alert ', run, ':', toString(step), ':reward'),
        'areal.control', 0, number FROM ({alerts})""")
    # the trainers' acknowledgements of each scale_lr (rank 0 for the run; applied at the next step)
    c(f"""INSERT INTO {db}.command_acks (event_id, run_id, node, rank, ts, schema, command_id, command, status, step,
        lr_factor, detail, attempt, _topic, _partition, _offset)
        SELECT lower(hex(MD5(concat(run, ':', toString(step), ':ack')))), run, 'node-0', 0,
        toDateTime64(t + 4, 3, 'UTC'), 1, lower(hex(MD5(concat(run, ':', toString(step), ':command')))), 'scale_lr',
        'applied', step + 1, 0.5, '', 0, 'areal.acks', 0, number FROM ({alerts}) WHERE step % 3 = 0""")
    _runs(client, db, shape)
    c(f"""INSERT INTO {db}.deadletter (event_id, run_id, node, rank, ts, schema, reason, source_topic, raw,
        _topic, _partition, _offset)
        SELECT lower(hex(MD5(toString(number)))), '', '', 0, toDateTime64({shape.now} - number * 3600, 3, 'UTC'), 1,
        'reward: expected a number, got "x"', 'areal.steps', '{{"type":"step","reward":"x"}}', 'areal.deadletter', 0,
        number FROM numbers(50)""")


def _runs(client: Any, db: str, shape: Shape) -> None:
    """A `running` event per rank at the start and a `finished` one at the end (the newest run still runs)."""
    config = ('{"lr":3e-06,"group_size":8,"batch_prompts":512,"kl_coef":0.001,"clip_eps":0.2,"model":"qwen2.5-7b",'
              '"max_response_len":4096,"eval_interval_steps":50,"seed":1}')
    start = _run_start(shape, "r")
    client.command(f"""INSERT INTO {db}.runs (event_id, run_id, node, rank, ts, schema, status, config, tags, group,
        world_size, host, attempt, framework, git_commit, exit_code, _topic, _partition, _offset)
        SELECT lower(hex(MD5(concat(run, ':', toString(rank), ':', status)))), run,
        concat('gpu', toString(intDiv(rank, 8)), ':', toString(rank % 8)), rank,
        toDateTime64(if(status = 'running', {start}, {start} + {shape.duration_s} + 5), 3, 'UTC'), 1, status,
        '{config}', ['grpo', concat('size-', ['7b', '32b'][1 + r % 2])], concat('exp-', toString(r % 5)),
        {shape.ranks}, concat('gpu', toString(intDiv(rank, 8))), 0, 'verl', 'abc1234', if(status = 'running', NULL, 0),
        'areal.runs', 0, number * 2 + (status = 'finished')
        FROM (SELECT number, intDiv(number, {shape.ranks}) AS r, toUInt32(number % {shape.ranks}) AS rank,
              concat('run-', leftPad(toString(r), 3, '0')) AS run FROM numbers({shape.runs * shape.ranks}))
        ARRAY JOIN ['running', 'finished'] AS status
        WHERE status = 'running' OR r < {shape.runs - 1}""")


def generate(client: Any, db: str, shape: Shape = Shape()) -> None:
    generate_steps(client, db, shape)
    generate_derived(client, db, shape)

"""One benchmark command: `python -m benchmarks [--quick] [--json PATH]`.

Measures in one run, side by side, against one real Kafka broker (started
here unless AREAL_KAFKA_BOOTSTRAP is set):

- publisher: microseconds per publish() on the caller's thread, beside a raw
  kafka-python send() and TensorBoard's add_scalar for the same values;
- client: microseconds per `run.log` of a 100-key step on the caller's
  thread, beside a validated StepEvent + publish(), wandb.log (offline) and
  TensorBoard's add_scalar for the same 100 values;
- training step: the step time of a ~1M-parameter transformer trained on the
  CPU with no monitoring, with `run.log` every step (each Kafka client, and a
  separate delivery process), and with TensorBoard, interleaved
  (`train_overhead_pct`, `tensorboard_overhead_pct`; benchmarks.bench_step);
- delivery: CPU per logged step by delivery option, GIL-holding threads apart
  from native ones (benchmarks.bench_delivery);
- pipeline: events/s from publishers through the stream worker into
  ClickHouse rows, beside the raw produce-then-consume rate on the same broker (median of 5);
- latency: publish() to alert, publish() to row visible to `sql`;
- memory: peak RSS of the stream worker and the sink; CPU per step event of each;
- scale: 1, 8 and 64 simulated ranks publishing at once (64: 8 runs of 8 ranks); these
  phases run `--repeats` times (default 3): `pipeline_events_per_s` (the best phase of a
  repeat), `pipeline_to_raw`, `worker_cpu_us_per_event` and `sink_cpu_us_per_event` are the
  medians over the repeats, each with `<key>_spread` ((max - min) / median) and `<key>_runs`;
- `--scale`: the scale mode instead (benchmarks/bench_scale.py);
- queries: every dashboard query (macros expanded) on 10 million generated step
  rows in an embedded store, p50/p95 per query (`panel_ms_p95_max`: the slowest
  query's p95 in the dashboards' default view; `--quick` times each query 5
  times instead of 20, on the same 10M rows).

The JSON has the keys of CONTRACT.md "Benchmarks" this command measures (others come
from the commands that measure them), plus details; every figure is measured in this run.

The detailed per-wing benchmarks are `benchmarks.bench_*` (see docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from benchmarks import bench_client, bench_delivery, bench_publisher, bench_queries, bench_step, pipeline
from benchmarks.common import broker, machine, print_table
from benchmarks.table import goals


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events and samples (a minute or two)")
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    parser.add_argument("--repeats", type=int, default=3,
                        help="the pipeline's phases run this many times; its keys are medians with a `_spread`")
    parser.add_argument("--scale", action="store_true",
                        help="the scale mode instead (benchmarks/bench_scale.py): panels on 100M step rows from 1,000 "
                             "ranks, the worker with 1 and 1,000 live runs")
    parser.add_argument("--scale-rows", type=int, default=100_000_000, help="step rows of the scale mode's store")
    parser.add_argument("--scale-sizes", default="",
                        help="comma-separated smaller stores for the figure's sweep (e.g. 1000000,10000000)")
    parser.add_argument("--scale-worker-events", type=int, default=200_000, help="events per worker measurement")
    # 20: a p95 of 5 runs is their slowest (one pause of the machine decides it), of 20 the slowest but one
    parser.add_argument("--scale-repetitions", type=int, default=20, help="timed runs of each panel query")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.scale:
        return _scale(args)
    # pipeline phases long enough that the sink's 500 ms flush wait is a small part of each
    n_pub, n_pipe, samples = (20_000, 32_000, 10) if args.quick else (50_000, 48_000, 30)
    n_client = 5_000 if args.quick else 20_000
    step_rounds, n_delivery = (8, 1_000) if args.quick else (24, 3_000)
    print(f"machine: {machine()}")
    with broker() as bootstrap:
        pub = bench_publisher.run(bootstrap, n_pub)
        client = bench_client.run(bootstrap, n_client)
        step = bench_step.run(bootstrap, step_rounds)
        delivery = bench_delivery.run(bootstrap, n_delivery)
        pipe = pipeline.run(bootstrap, n_pipe, samples, scales=(1, 8, 64), repeats=args.repeats)
    queries = bench_queries.run(5 if args.quick else 20)  # no broker needed: after the others, not beside them
    bench_publisher.report(pub)
    bench_client.report(client)
    bench_step.report(step)
    bench_delivery.report(delivery)
    raw = pipe["raw_events_per_s"]
    rows = [(f"raw produce-then-consume ({pipe['raw_library']}, the publishers' library; median of "
             f"{len(pipe['raw_events_per_s_runs'])})", f"{raw:,.0f} ev/s", "1.00 (baseline)")]
    if pipe["raw_library"] != "kafka-python":
        kp = pipe["raw_events_per_s_kafka_python"]
        rows.append(("raw produce-then-consume (kafka-python; median of the same number)", f"{kp:,.0f} ev/s", f"{kp / raw:.2f} of raw"))
    for ranks, s in pipe["scale"].items():
        rows.append((f"pipeline, {ranks} rank(s) publishing ({s['runs']} run(s))", f"{s['events_per_s']:,.0f} ev/s",
                     f"{s['events_per_s'] / raw:.2f} of raw; cores busy: worker {s['worker_core_share']:.2f}, "
                     f"sink {s['sink_core_share']:.2f}, machine {s['machine_core_share']:.2f}; "
                     f"CPU/event: worker {s['worker_cpu_us_per_event']:.0f} us, "
                     f"sink {s['sink_cpu_us_per_event']:.0f} us"))
    print_table(f"pipeline: publishers -> Kafka -> stream worker + sink -> ClickHouse rows ({n_pipe:,} step events)", rows)
    print_table("latency and memory", [
        ("publish() -> alert on the alerts topic p50/p99/max",
         f"{pipe['alert_latency_ms_p50']:.0f}/{pipe['alert_latency_ms_p99']:.0f}/{pipe['alert_latency_ms_max']:.0f} ms", ""),
        ("publish() -> row visible to sql p50/p99/max",
         f"{pipe['visible_latency_ms_p50']:.0f}/{pipe['visible_latency_ms_p99']:.0f}/{pipe['visible_latency_ms_max']:.0f} ms", ""),
        ("stream worker CPU per step event (all phases)", f"{pipe['worker_cpu_us_per_event']:.0f} us", ""),
        ("sink CPU per step event (all phases)", f"{pipe['sink_cpu_us_per_event']:.0f} us", ""),
        ("publishers' CPU per step event (all phases)", f"{pipe['publishers_cpu_us_per_event']:.0f} us", ""),
        ("the machine's CPU per step event, every process (all phases)",
         f"{pipe['machine_cpu_us_per_event']:.0f} us", f"{os.cpu_count()} cores"),
        ("stream worker peak RSS", f"{pipe.get('worker_rss_mib', float('nan')):.0f} MiB", ""),
        ("sink peak RSS", f"{pipe.get('sink_rss_mib', float('nan')):.0f} MiB", ""),
    ])
    bench_queries.report(queries)
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min)")
    figures = {
        "machine": machine(),
        "publish_us_p50": pub["publish_us_p50"],
        "publish_us_p99": pub["publish_us_p99"],
        "raw_send_us_p50": pub["raw_send_us_p50"],
        "tensorboard_us_p50": pub["tensorboard_us_p50"],
        **client,
        "train_overhead_pct": step["train_overhead_pct"],
        "tensorboard_overhead_pct": step["tensorboard_overhead_pct"],
        "train_overhead_cpu_pct": step["train_overhead_cpu_pct"],
        "tensorboard_overhead_cpu_pct": step["tensorboard_overhead_cpu_pct"],
        "train_kafka_client": step["default_client"],
        "train_step": step,
        "delivery_cpu_us": delivery,
        "pipeline_events_per_s": pipe["pipeline_events_per_s"],
        "raw_events_per_s": raw,
        "raw_events_per_s_runs": pipe["raw_events_per_s_runs"],
        "raw_library": pipe["raw_library"],
        "raw_events_per_s_kafka_python": pipe["raw_events_per_s_kafka_python"],
        "raw_events_per_s_kafka_python_runs": pipe["raw_events_per_s_kafka_python_runs"],
        "pipeline_to_raw": pipe["pipeline_events_per_s"] / raw,
        **{k: pipe[k] for k in pipe if k.endswith(("_spread", "_runs")) and k not in (
            "raw_events_per_s_runs", "raw_events_per_s_kafka_python_runs")},
        "scale_repeats": pipe["scale_repeats"],
        "worker_cpu_us_per_event": pipe["worker_cpu_us_per_event"],
        "sink_cpu_us_per_event": pipe["sink_cpu_us_per_event"],
        "publishers_cpu_us_per_event": pipe["publishers_cpu_us_per_event"],
        "machine_cpu_us_per_event": pipe["machine_cpu_us_per_event"],
        "alert_latency_ms_p50": pipe["alert_latency_ms_p50"],
        "alert_latency_ms_p99": pipe["alert_latency_ms_p99"],
        "visible_latency_ms_p50": pipe["visible_latency_ms_p50"],
        "visible_latency_ms_p99": pipe["visible_latency_ms_p99"],
        **{k: pipe[k] for k in ("worker_rss_mib", "sink_rss_mib") if k in pipe},
        "scale": {str(k): v for k, v in pipe["scale"].items()},
        **{key: queries[key] for key in queries if key.startswith("panel_ms_p95_max")},
        "panel_steps_rows": queries["steps_rows"],
        "queries": queries,
        "load_average": list(load),
    }
    figures["goals"] = goals(figures)
    print("\ngoals of the quick run (benchmarks/table.py GOALS):")
    for g in figures["goals"]:
        verdict = "not measured" if g["met"] is None else "met" if g["met"] else "MISSED"
        print(f"  {g['key']} {g['goal']} (here {g['limit']:.4g}): {g['figure']:.4g}, {verdict}" if g["met"] is not None
              else f"  {g['key']} {g['goal']}: {verdict}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
        print(f"\nfigures written to {args.json}")
    return 0


def _scale(args: argparse.Namespace) -> int:
    from benchmarks import bench_scale

    print(f"machine: {machine()}")
    sizes = [int(x) for x in args.scale_sizes.split(",") if x]
    command = (f"python -m benchmarks --scale --scale-rows {args.scale_rows} --scale-sizes '{args.scale_sizes}' "
               f"--scale-worker-events {args.scale_worker_events} --scale-repetitions {args.scale_repetitions}")
    head = {"machine": machine(), "command": command}

    def save(partial: dict) -> None:
        if args.json:
            args.json.write_text(json.dumps({**head, **partial}, indent=2))

    figures = {**head, **bench_scale.run(args.scale_rows, args.scale_repetitions, sizes, args.scale_worker_events,
                                         save)}
    bench_scale.report(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
        print(f"\nfigures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

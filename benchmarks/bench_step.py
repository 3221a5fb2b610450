"""What monitoring costs a training step: no monitoring, `run.log` every step, TensorBoard, in one run.

    python -m benchmarks.bench_step [--rounds 16] [--steps 12] [--threads 1] [--json PATH]

The step is a real torch training step on the CPU: a ~1M-parameter causal
transformer (4 layers, d_model 128, 4 heads, vocabulary 1024), a batch of
16 x 64 tokens, forward, cross-entropy, backward, gradient clipping, AdamW.
After each step the loop has the values a trainer logs (loss, perplexity,
learning rate, gradient norm, tokens, step time, and the gradient norm of
each of the model's parameter tensors: 57 numbers, read in every mode, so
that only the logging differs). Modes, run interleaved in blocks of
`--steps` timed steps (the order rotated each round), `--rounds` times each,
against one real broker:

- off: the values are computed and dropped (the baseline);
- client: `areal_metrics.init(...)` then `run.log(values, step)` each step, through
  each Kafka client the publisher can use (confluent-kafka when installed,
  kafka-python) and through the separate-process prototype
  (`benchmarks.delivery_process`: kafka-python in a child process fed through a pipe);
- tensorboard: `SummaryWriter.add_scalar` for each of the same values.

The step time is the interval between consecutive steps' ends (it includes the
logging call and whatever a background thread takes from the loop); a block's
figure is the 25th percentile of its steps (its first 3 dropped): on a shared
machine other processes preempt random steps, and the quicker quarter keeps
what every step pays (one event per step, the sender woken once per step); the CPU per step is this process's CPU
time over the block (all threads: torch, the client's sender, librdkafka's,
TensorBoard's writer) plus the delivery child's for the pipe prototype. A
mode's overhead is the median over rounds of its block against the `off`
block of the same round, so that a busy minute on a shared machine slows both
alike. `train_overhead_pct` is the default client's (the one `init()` picks:
confluent-kafka when installed), `tensorboard_overhead_pct` TensorBoard's (wall
time; `*_cpu_pct` the same from CPU time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.common import measure_and_report, percentile, print_table

_WARM_STEPS = 3  # dropped at the start of each block


def make_step() -> Callable[[], dict[str, float]]:
    """A seeded ~1M-parameter transformer LM and one training step that returns the values a trainer logs."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    vocab, d, seq, batch = 1024, 128, 64, 16
    layer = nn.TransformerEncoderLayer(d, 4, dim_feedforward=4 * d, dropout=0.0, batch_first=True, norm_first=True)
    model = nn.ModuleDict({"embed": nn.Embedding(vocab, d), "pos": nn.Embedding(seq, d),
                           "body": nn.TransformerEncoder(layer, 4, enable_nested_tensor=False),
                           "head": nn.Linear(d, vocab)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    mask = nn.Transformer.generate_square_subsequent_mask(seq)
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    data = torch.randint(0, vocab, (64, batch, seq + 1))
    state = {"i": 0, "t": time.perf_counter()}

    def step() -> dict[str, float]:
        tokens = data[state["i"] % len(data)]
        state["i"] += 1
        x = model["embed"](tokens[:, :-1]) + model["pos"].weight
        logits = model["head"](model["body"](x, mask=mask, is_causal=True))
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        norms = torch.stack(torch._foreach_norm([p.grad for p in params])).tolist()
        now = time.perf_counter()
        step_ms, state["t"] = (now - state["t"]) * 1000, now
        loss_value = loss.item()
        values = {"loss": loss_value, "ppl": float(torch.tensor(loss_value).exp()), "lr": 3e-4,
                  "grad_norm": float(grad_norm), "tokens": float(batch * seq), "step_time_ms": step_ms,
                  "tokens_per_s": batch * seq / max(step_ms, 1e-6) * 1000}
        values.update({f"grad_norm/{n}": v for n, v in zip(names, norms)})
        return values

    step.parameters = sum(p.numel() for p in params)  # type: ignore[attr-defined]
    return step


class Block(NamedTuple):
    """Per step over one block of one mode."""

    wall_ms: float  # the block's 25th-percentile step
    cpu_ms: float  # this process's threads plus a delivery child's
    background_ms: float  # all but the training loop's thread (sender, librdkafka, TensorBoard's writer, child)
    waits: float  # the training loop's voluntary context switches (it blocked: the GIL, a lock, I/O)
    preempted: float  # its involuntary ones (the scheduler gave its core to another thread or process)


def _switches() -> tuple[int, int]:
    """The calling thread's (voluntary, involuntary) context switches, from /proc ((0, 0) where absent)."""
    try:
        lines = Path("/proc/thread-self/status").read_text().splitlines()
    except OSError:
        return 0, 0
    counts = dict(line.split(":\t") for line in lines if line.endswith(tuple("0123456789")) and ":\t" in line)
    return int(counts.get("voluntary_ctxt_switches", 0)), int(counts.get("nonvoluntary_ctxt_switches", 0))


def _block(step: Callable[[], dict[str, float]], n: int, sink: Callable[[dict[str, float], int], None],
           first: int, child_cpu: Callable[[], float]) -> Block:
    ends, cpu, loop, switches = [], 0.0, 0.0, (0, 0)
    for i in range(n):
        values = step()
        sink(values, first + i)
        ends.append(time.perf_counter())
        if i == _WARM_STEPS:
            cpu, loop, switches = time.process_time() + child_cpu(), time.thread_time(), _switches()
    cpu = time.process_time() + child_cpu() - cpu
    loop = time.thread_time() - loop
    now = _switches()
    walls = [(b - a) * 1000 for a, b in zip(ends, ends[1:])][_WARM_STEPS:]
    k = len(walls)
    return Block(percentile(walls, 25), cpu * 1000 / k, (cpu - loop) * 1000 / k, (now[0] - switches[0]) / k,
                 (now[1] - switches[1]) / k)


def _cpu_of(pid: int) -> Callable[[], float]:
    """CPU seconds (user + system) a child process has used, from /proc (0 where /proc is absent)."""
    ticks = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / ticks

    return read


def _clients(bootstrap: str, tmp: Path) -> dict[str, Any]:
    """One Run per delivery, as a trainer would open it."""
    import importlib.util

    from areal_metrics.stack.kafka_broker import create_topics
    from benchmarks.delivery_process import PipePublisher
    from areal_metrics.producers.client.run import init
    from areal_metrics.producers.contract.topics import Topics

    prefix = f"benchstep{uuid.uuid4().hex[:6]}."
    create_topics(bootstrap, Topics(prefix).all(), partitions=3)
    common = dict(kafka_bootstrap=bootstrap, topic_prefix=prefix, git=False)
    kinds = (["confluent-kafka"] if importlib.util.find_spec("confluent_kafka") else []) + ["kafka-python"]
    runs = {f"client ({kind})": init(f"bench-step-{kind}-{uuid.uuid4().hex[:4]}", journal_dir=tmp / kind,
                                     kafka_client=kind, **common) for kind in kinds}
    piped = init(f"bench-step-pipe-{uuid.uuid4().hex[:4]}", journal_dir=tmp / "pipe-unused", **common)
    piped._publisher.close(10)  # the prototype takes the Run's place in the delivery: the run event went already
    piped._publisher = PipePublisher(bootstrap, Topics(prefix), tmp / "pipe")
    runs["client (separate process, pipe)"] = piped
    return runs


def run(bootstrap: str, rounds: int = 16, steps: int = 12, threads: int = 1) -> dict[str, Any]:
    import torch
    from torch.utils.tensorboard import SummaryWriter

    torch.set_num_threads(threads)
    step = make_step()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        runs = _clients(bootstrap, tmp)
        writer = SummaryWriter(log_dir=str(tmp / "tb"))

        def to_tensorboard(values: dict[str, float], i: int) -> None:
            for tag, value in values.items():
                writer.add_scalar(tag, value, i)

        sinks: dict[str, Callable[[dict[str, float], int], None]] = {"off": lambda values, i: None}
        sinks.update({label: r.log for label, r in runs.items()})
        sinks["tensorboard"] = to_tensorboard
        children = {label: _cpu_of(r._publisher._child.pid) for label, r in runs.items() if "pipe" in label}
        for mode, sink in sinks.items():  # warm torch, the connections and TensorBoard's writer up
            _block(step, _WARM_STEPS + 3, sink, 0, lambda: 0.0)
        modes = list(sinks)
        blocks: dict[str, list[Block]] = {mode: [] for mode in modes}
        for r in range(rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]  # rotate: no mode always follows another
            for mode in order:
                blocks[mode].append(_block(step, steps + _WARM_STEPS + 1, sinks[mode], 10 + r * steps,
                                           children.get(mode, lambda: 0.0)))
        delivered = {}
        for label, client_run in runs.items():
            client_run.finish()
            s = client_run.stats()
            delivered[label] = (s.sent + s.resent, s.queued)
        writer.close()
    wall = {mode: _paired_overhead([b[0] for b in blocks[mode]], [b[0] for b in blocks["off"]]) for mode in modes}
    cpu = {mode: _paired_overhead([b[1] for b in blocks[mode]], [b[1] for b in blocks["off"]]) for mode in modes}
    default = next(label for label in runs if "pipe" not in label)  # what init() picks
    return {"threads": threads, "parameters": step.parameters,  # type: ignore[attr-defined]
            "values_per_step": len(step()), "rounds": rounds, "steps_per_block": steps,
            "step_ms_p25": {mode: statistics.median(b[0] for b in blocks[mode]) for mode in modes},
            "cpu_ms_per_step": {mode: statistics.median(b[1] for b in blocks[mode]) for mode in modes},
            # what each mode's background threads (and child) take per step beyond the idle ones of `off`
            # the training loop's context switches per step: blocked (e.g. waiting for the GIL) and preempted
            "loop_waits_per_step": {mode: statistics.median(b.waits for b in blocks[mode]) for mode in modes},
            "loop_preempted_per_step": {mode: statistics.median(b.preempted for b in blocks[mode]) for mode in modes},
            "background_cpu_ms_per_step": {
                mode: statistics.median(b[2] - o[2] for b, o in zip(blocks[mode], blocks["off"])) for mode in modes},
            "overhead_pct": wall, "cpu_overhead_pct": cpu, "delivered": delivered, "default_client": default,
            "train_overhead_pct": wall[default], "tensorboard_overhead_pct": wall["tensorboard"],
            "train_overhead_cpu_pct": cpu[default], "tensorboard_overhead_cpu_pct": cpu["tensorboard"]}


def _paired_overhead(mode: list[float], off: list[float]) -> float:
    """Median over rounds of (mode / off in the same round - 1), in %: a slow minute slows both alike."""
    return statistics.median((m / o - 1) * 100 for m, o in zip(mode, off))


def report(result: dict[str, Any]) -> None:
    rows = []
    for mode, ms in result["step_ms_p25"].items():
        cpu = result["cpu_ms_per_step"][mode]
        if mode == "off":
            rows.append((mode, f"{ms:.1f} / {cpu:.1f} ms",
                         f"1.00 (baseline); loop switches/step {result['loop_waits_per_step'][mode]:.0f} blocked, "
                         f"{result['loop_preempted_per_step'][mode]:.0f} preempted"))
            continue
        rows.append((mode, f"{ms:.1f} / {cpu:.1f} ms",
                     f"wall {result['overhead_pct'][mode]:+.1f}%, CPU {result['cpu_overhead_pct'][mode]:+.1f}%; "
                     f"background CPU {result['background_cpu_ms_per_step'][mode]:+.2f} ms/step; "
                     f"loop switches/step {result['loop_waits_per_step'][mode]:.0f} blocked, "
                     f"{result['loop_preempted_per_step'][mode]:.0f} preempted"))
    print_table(f"training step (wall p25 / CPU per step) with monitoring: {result['parameters'] / 1e6:.2f}M-param "
                f"transformer on the CPU ({result['threads']} torch thread(s)), {result['values_per_step']} values "
                f"per step, {result['rounds']} rounds x {result['steps_per_block']} steps per mode, interleaved; "
                f"overhead: median over rounds of the same round's ratio to off", rows)
    for label, (acked, queued) in result["delivered"].items():
        if queued:
            print(f"  {label}: {acked} of {queued} events acknowledged")
    print(f"  train_overhead_pct ({result['default_client']}): {result['train_overhead_pct']:+.1f}%; "
          f"tensorboard_overhead_pct: {result['tensorboard_overhead_pct']:+.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_step")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per block")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: 2 shared cores here)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    return measure_and_report(lambda bootstrap: run(bootstrap, args.rounds, args.steps, args.threads), report,
                              args.json)


if __name__ == "__main__":
    raise SystemExit(main())

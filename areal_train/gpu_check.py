"""CUDA check: train a few steps on the GPU and print the device, step times and memory.

    python -m areal_metrics.areal_train.gpu_check [--steps 100] [--json OUT.json]

Needs no Kafka: the step and eval events are collected in memory. It runs
(1) one rank in this process on CUDA, (2) the same on CPU for comparison and
(3) a 2-rank gloo run on CUDA through the launcher (gradients travel through
CPU memory; evaluation in a CUDA evaluation process per rank, sharded), and
exits non-zero if CUDA is absent or a check fails. The policy starts from
random weights (no warm start): this checks devices, not learning.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from areal_metrics.areal_train.config import TrainConfig
from areal_metrics.areal_train.launch import launch
from areal_metrics.areal_train.reporting import RecordedRun
from areal_metrics.areal_train.trainer import train


def one_rank(device: str, steps: int) -> dict[str, object]:
    run = RecordedRun()
    cfg = TrainConfig(device=device, publish=False, batch_prompts=16, eval_every_steps=50, two_stage=False,
                      warmstart_steps=0, checkpoint_every_steps=None, checkpoint_dir=tempfile.mkdtemp())
    summary = train(cfg, f"gpu-check-{device}", steps, open_run=lambda spec: run)
    logged = [s.values for s in run.steps]
    latencies = [v["latency_ms"] for v in logged[5:]]  # after warm-up
    evals = [e for e in run.evals if e["stage"] == "full" and e["status"] == "ok"]
    return {
        "device": summary.device,
        "steps": summary.steps,
        "step_ms_median": statistics.median(latencies),
        "step_ms_mean": statistics.fmean(latencies),
        "generated_tokens_per_s_median": statistics.median(v["throughput"] for v in logged[5:]),
        "gpu_mem_bytes_reported": logged[-1]["gpu_mem_bytes"],
        "mem_bytes_reported": logged[-1]["mem_bytes"],
        "cuda_max_memory_allocated": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "reward_first_10": statistics.fmean(v["reward"] for v in logged[:10]),
        "reward_last_10": statistics.fmean(v["reward"] for v in logged[-10:]),
        "eval_accuracy": {f"{e['dataset']}@{e['step']}": e["accuracy"] for e in evals},
        "seconds": summary.seconds,
    }


def two_ranks(steps: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        cfg = TrainConfig(device="cuda", publish=False, warmstart_steps=0, eval_mode="async", checkpoint_dir=tmp)
        code = launch("gpu-check-2r", 2, steps, cfg, summary_dir=tmp, log_dir=Path(tmp) / "logs", timeout=300)
        summaries = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
        logs = {p.name: p.read_text()[-2000:] for p in (Path(tmp) / "logs").glob("*.log")} if code else {}
    return {"exit_status": code, "wall_s": time.perf_counter() - started, "ranks": summaries, "logs": logs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_metrics.areal_train.gpu_check")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available here: nothing to check", file=sys.stderr)
        return 1
    results = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "cuda": one_rank("cuda", args.steps),
        "cpu": one_rank("cpu", args.steps),
        "two_ranks_cuda": two_ranks(args.steps),
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    cuda = results["cuda"]
    ok = (str(cuda["device"]).startswith("cuda") and (cuda["gpu_mem_bytes_reported"] or 0) > 0
          and results["two_ranks_cuda"]["exit_status"] == 0
          and all(str(r["device"]).startswith("cuda") for r in results["two_ranks_cuda"]["ranks"]))
    print("GPU CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

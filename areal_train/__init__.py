"""A small but real distributed PPO/GRPO trainer on math problems; it reports through the public client.

- `task`, `grader`: procedural math in four skills and three levels, the exact-answer grader with error types;
- `policy`, `warmstart`: a 0.8M-parameter decoder-only transformer and its cached supervised warm start;
- `episodes`, `advantages`, `ppo`: multi-turn rollouts, GRPO/GAE advantages, the clipped PPO update;
- `data`, `evalsets`: each rank's share of the training set; the fixed evaluation sets and their fingerprints;
- `evaluation`, `evaluator`, `eval_process`: two-stage sharded rounds, inline or in a process per rank;
- `scheduler`, `control`, `checkpoint`, `session`: triggers, commands, checkpoints, one rank's state;
- `reporting`: `Run.log` / `Run.log_eval` calls (areal_metrics.producers.client.run, what `areal_metrics.init` re-exports);
- `trainer`: the training loop, top to bottom; `worker`: one rank's process; `launch`: start N ranks;
- `collective`, `metrics`, `config`, `gpu_check`: gloo collectives, device and memory, settings, the CUDA check.
See docs/WORKLOAD.md.
"""

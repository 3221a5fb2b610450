"""A small but real distributed PPO/GRPO trainer that publishes its metrics to Kafka.

- `task`: addition problems and the exact verifier (datasets `add_1digit`, `add_2digit`);
- `policy`: a tiny GRU policy that writes answers token by token;
- `advantages`: group-relative (GRPO) and GAE estimators;
- `scheduler`: when to evaluate (epoch / step / time triggers, commands);
- `control`: which control commands apply, and the control-topic reader;
- `evaluation`: evaluation rounds (two-stage, asynchronous, failures as events);
- `trainer`: the training loop, top to bottom; `worker`: one rank's process;
- `launch`: start N ranks and wait; `gpu_check`: the CUDA check.
"""
